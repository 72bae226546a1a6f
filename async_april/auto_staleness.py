"""`async.max_staleness: auto` and `rollout.over_provision: auto`: settings that tune themselves.

Pure logic, no Ray, like `StalenessController`. After every learner step the
tuner reads three figures of that step:

    ess        mismatch/ess: normalised effective sample size of the token IS weights pi_theta / pi_behav
    k3         mismatch/k3: KL(pi_behav || pi_theta), k3 estimator
    wait       timing_s/rollout of timing_s/step: how long the learner waited for generation

and moves at most one knob by one step (eta by 1, over-provisioning by
`async.auto.over_provision_step`), each inside its bounds:

    budget broken (ess < min_ess or k3 > max_k3)          -> lower, at once (the data are too stale)
    budget holds on each of the last raise_after steps
        and the learner waited >= raise_wait_frac of
        their summed time                                 -> raise (generation is the bottleneck)
    otherwise                                             -> hold (the window slides on)
    a budget signal missing                               -> hold (the window restarts)

The wait is judged over a window, not step by step, because at a low eta the
learner waits in bursts: measured on the tiny task at eta 1, it found its
batch ready (waits of 1-2% of the step) and then waited 30-50% of one step,
every 3-6 steps; a rule of consecutive waiting steps read that as never
bottlenecked and held eta at 1 for 159 of 160 steps, where eta 2 and 4 reach
the target reward sooner (docs/benchmarks.md, "Auto eta on the tiny task").

Knobs are raised in order (eta first, then over-provisioning) and lowered in
reverse, so the last raise is undone first. After every change the window
starts empty: tokens of a new lag reach the learner only in later steps, so
the budget is judged on the new regime before the next raise.

Admission stays exact through each change (async_april/store.py
`set_max_staleness`, `set_over_provision`): a raise opens admission at once; a
lowering closes it until the learner catches up, and every group admitted
before keeps the eta it was admitted under, so none becomes too stale to train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from async_april.config import Config

Decision = Literal["raise", "lower", "hold"]


@dataclass(frozen=True)
class StepSignals:
    ess: float | None
    k3: float | None
    wait_s: float
    """How long the learner waited for this step's batch (timing_s/rollout)."""
    step_s: float
    """The whole step (timing_s/step)."""

    @property
    def wait_frac(self) -> float:
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> "StepSignals":
        """From one step's metrics (learner and controller keys)."""
        ess, k3 = metrics.get("mismatch/ess"), metrics.get("mismatch/k3")
        return cls(None if ess is None else float(ess), None if k3 is None else float(k3),
                   float(metrics.get("timing_s/rollout", 0.0)), float(metrics.get("timing_s/step", 0.0)))


Window = tuple[tuple[float, float], ...]
"""(wait_s, step_s) of the last steps within budget since the last change, newest last, at most raise_after."""


def wait_share(window: Window) -> float:
    """The share of the window's summed step time the learner spent waiting for its batches (0 if empty)."""
    took = sum(t for _, t in window)
    return sum(w for w, _ in window) / took if took > 0 else 0.0


@dataclass(frozen=True)
class Knob:
    """A setting the tuner may move, within [low, high] by `step`; `name` is its metric (`async/<name>`)."""

    name: str
    low: float
    high: float
    step: float

    def __post_init__(self) -> None:
        if not self.low <= self.high or self.step <= 0:
            raise ValueError(f"auto {self.name} needs low ({self.low}) <= high ({self.high}) and step ({self.step}) > 0")

    def clamp(self, value: float) -> float:
        return min(max(value, self.low), self.high)


@dataclass(frozen=True)
class OffPolicyTuner:
    knobs: tuple[Knob, ...]
    """In raise order; lowered in reverse."""
    min_ess: float | None = 0.9
    max_k3: float | None = None
    raise_wait_frac: float = 0.1
    raise_after: int = 2

    def __post_init__(self) -> None:
        if not self.knobs:
            raise ValueError("the tuner needs at least one knob")
        if self.min_ess is None and self.max_k3 is None:
            raise ValueError("auto tuning needs a budget: min_ess or max_k3")
        if self.raise_after < 1:
            raise ValueError(f"raise_after={self.raise_after} must be >= 1")

    @classmethod
    def from_config(cls, cfg: "Config") -> "OffPolicyTuner | None":
        """The tuner of `cfg`'s `auto` settings, or None when nothing is `auto`."""
        a = cfg.async_.auto
        knobs = []
        if cfg.async_.max_staleness == "auto":
            knobs.append(Knob("eta", a.min, a.max, 1))
        if cfg.rollout.over_provision == "auto":
            knobs.append(Knob("over_provision", a.over_provision_min, a.over_provision_max, a.over_provision_step))
        return cls(tuple(knobs), a.min_ess, a.max_k3, a.raise_wait_frac, a.raise_after) if knobs else None

    def budget_broken(self, s: StepSignals) -> bool:
        """Whether this step's off-policyness exceeds the budget (a missing signal breaks nothing)."""
        low_ess = self.min_ess is not None and s.ess is not None and s.ess < self.min_ess
        high_kl = self.max_k3 is not None and s.k3 is not None and s.k3 > self.max_k3
        return low_ess or high_kl

    def judged(self, window: Window, s: StepSignals) -> Window:
        """The steps a raise after `s` is judged on: the window with `s` added, its last raise_after."""
        return (*window, (s.wait_s, s.step_s))[-self.raise_after:]

    def decide(self, values: dict[str, float], window: Window, s: StepSignals) -> tuple[dict[str, float], Window, Decision]:
        """(new values by knob name, the new window, what was decided) after a step measured as `s`."""
        values = {k.name: k.clamp(values[k.name]) for k in self.knobs}
        if self.budget_broken(s):
            for k in reversed(self.knobs):
                if values[k.name] > k.low:
                    return {**values, k.name: k.clamp(values[k.name] - k.step)}, (), "lower"
            return values, (), "hold"
        measured = (self.min_ess is None or s.ess is not None) and (self.max_k3 is None or s.k3 is not None)
        if not measured:
            return values, (), "hold"
        window = self.judged(window, s)
        raisable = [k for k in self.knobs if values[k.name] < k.high]
        if raisable and len(window) == self.raise_after and wait_share(window) >= self.raise_wait_frac:
            k = raisable[0]
            return {**values, k.name: k.clamp(values[k.name] + k.step)}, (), "raise"
        return values, window, "hold"


__all__ = ["Knob", "OffPolicyTuner", "StepSignals", "Window", "wait_share"]
