"""`async.max_staleness: auto` and `rollout.over_provision: auto`: settings that tune themselves.

Pure logic, no Ray, like `StalenessController`. After every learner step the
tuner reads three figures of that step:

    ess        mismatch/ess: normalised effective sample size of the token IS weights pi_theta / pi_behav
    k3         mismatch/k3: KL(pi_behav || pi_theta), k3 estimator
    wait       timing_s/rollout of timing_s/step: how long the learner waited for generation

and moves at most one knob by one step (eta by 1, over-provisioning by
`async.auto.over_provision_step`), each inside its bounds:

    within a lowering's admission wave (eta + 1 steps)    -> hold (what arrives was admitted before it)
    budget broken (ess < min_ess or k3 > max_k3)          -> lower, at once (the data are too stale)
    budget holds on each of the last raise_after steps,
        the learner waited >= raise_wait_frac of
        their summed time, and the regime in force has
        been judged (eta + 1 steps since the change, and
        raise_after x 2^n if the next value broke the
        budget n times before)                            -> raise (generation is the bottleneck)
    otherwise                                             -> hold (the window slides on)
    a budget signal missing                               -> hold (the window restarts); never
                                                             present: said once (`warning`)

The wait is judged over a window, not step by step, because at a low eta the
learner waits in bursts: measured on the tiny task at eta 1, it found its
batch ready (waits of 1-2% of the step) and then waited 30-50% of one step,
every 3-6 steps; a rule of consecutive waiting steps read that as never
bottlenecked and held eta at 1 for 159 of 160 steps, where eta 2 and 4 reach
the target reward sooner (docs/benchmarks.md, "Auto eta on the tiny task").

The budget breaks with a lag: a group admitted at version v under eta is
trained up to v + eta, so tokens of a new lag reach the learner eta + 1 steps
after a raise, and groups admitted before a lowering keep arriving as long.
Lowering on every broken step therefore drove eta to `auto.min` after one
breach and it swung over the whole range for ever (a scripted lagged budget:
0112233443210001122...); now a lowering holds for its wave, every raise waits
until the regime in force has been trained, and a value that broke the budget
is retried after exponentially more calm steps, so eta settles on the highest
value within budget and only probes the next one ever more rarely
(tests/test_auto_staleness.py::test_a_lagged_budget_settles_on_the_highest_eta_within_it_and_stays).

Knobs are raised in order (eta first, then over-provisioning) and lowered in
reverse, so the last raise is undone first. After every change the window
starts empty. What the tuner remembers between steps is a `TunerState`,
saved with the controller state.

Admission stays exact through each change (async_april/rollout/store.py
`set_max_staleness`, `set_over_provision`): a raise opens admission at once; a
lowering closes it until the learner catches up, and every group admitted
before keeps the eta it was admitted under, so none becomes too stale to train.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    eta: float | None = None
    """The eta in force during the step (async/eta): how long a lowering's admission wave lasts when eta is not tuned."""

    @property
    def wait_frac(self) -> float:
        return self.wait_s / self.step_s if self.step_s > 0 else 0.0

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> "StepSignals":
        """From one step's metrics (learner and controller keys)."""
        ess, k3 = metrics.get("mismatch/ess"), metrics.get("mismatch/k3")
        eta = metrics.get("async/eta")
        return cls(None if ess is None else float(ess), None if k3 is None else float(k3),
                   float(metrics.get("timing_s/rollout", 0.0)), float(metrics.get("timing_s/step", 0.0)),
                   None if eta is None else float(eta))


Window = tuple[tuple[float, float], ...]
"""(wait_s, step_s) of the last steps within budget since the last change, newest last, at most raise_after."""


def wait_share(window: Window) -> float:
    """The share of the window's summed step time the learner spent waiting for its batches (0 if empty)."""
    took = sum(t for _, t in window)
    return sum(w for w, _ in window) / took if took > 0 else 0.0


MISSING_WARN_AFTER = 3
"""Steps without the budget's signal (none ever seen) after which the tuner says, once, that it cannot tune."""


@dataclass(frozen=True)
class TunerState:
    """What the tuner remembers between steps; saved with the controller state (`to_dict`/`from_dict`)."""

    window: Window = ()
    calm: int = 0
    """Measured steps within budget since the last change (or the end of a hold): what a raise waits for."""
    hold: int = 0
    """Steps left after a lowering in which no breach is judged: the groups admitted before it still arrive."""
    strikes: tuple[tuple[str, float, int], ...] = ()
    """(knob, value, times that value broke the budget): a raise back to it waits raise_after x 2^times steps."""
    seen: bool = False
    """Whether the budget's signal (mismatch/ess, mismatch/k3) was ever present."""
    missing: int = 0
    """Steps without it while it was never seen (the warning comes at MISSING_WARN_AFTER)."""

    def struck(self, knob: str, value: float) -> int:
        return next((n for k, v, n in self.strikes if k == knob and v == value), 0)

    def strike(self, knob: str, value: float) -> tuple[tuple[str, float, int], ...]:
        rest = tuple(x for x in self.strikes if (x[0], x[1]) != (knob, value))
        return (*rest, (knob, value, self.struck(knob, value) + 1))

    def to_dict(self) -> dict:
        return {"window": [list(x) for x in self.window], "calm": self.calm, "hold": self.hold,
                "strikes": [list(x) for x in self.strikes], "seen": self.seen, "missing": self.missing}

    @classmethod
    def from_dict(cls, d: dict) -> "TunerState":
        return cls(tuple((float(w), float(t)) for w, t in d.get("window", [])), int(d.get("calm", 0)), int(d.get("hold", 0)),
                   tuple((str(k), float(v), int(n)) for k, v, n in d.get("strikes", [])), bool(d.get("seen", False)),
                   int(d.get("missing", 0)))


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

    def measured(self, s: StepSignals) -> bool:
        """Whether `s` carries every signal of the budget."""
        return (self.min_ess is None or s.ess is not None) and (self.max_k3 is None or s.k3 is not None)

    def decide(self, values: dict[str, float], state: TunerState, s: StepSignals) -> tuple[dict[str, float], TunerState, Decision]:
        """(new values by knob name, the new state, what was decided) after a step measured as `s`."""
        values = {k.name: k.clamp(values[k.name]) for k in self.knobs}
        seen = state.seen or (s.ess is not None or s.k3 is not None)
        state = replace(state, seen=seen, missing=state.missing if seen else state.missing + 1)
        if state.hold > 0:  # a lowering's admission wave is still being trained: its breaches are old news
            return values, replace(state, hold=state.hold - 1), "hold"
        if self.budget_broken(s):
            for k in reversed(self.knobs):
                if values[k.name] > k.low:
                    # Groups admitted under the old setting keep arriving for up to eta + 1 steps (admission
                    # at version v under eta is trained by v + eta; one more for the leases made before the
                    # store heard of the change): judge the budget again only once they are trained.
                    return ({**values, k.name: k.clamp(values[k.name] - k.step)},
                            replace(state, window=(), calm=0, hold=self.wave(values, s), strikes=state.strike(k.name, values[k.name])),
                            "lower")
            return values, replace(state, window=(), calm=0), "hold"
        if not self.measured(s):
            return values, replace(state, window=(), calm=0), "hold"
        state = replace(state, window=self.judged(state.window, s), calm=state.calm + 1)
        raisable = [k for k in self.knobs if values[k.name] < k.high]
        if raisable and len(state.window) == self.raise_after and wait_share(state.window) >= self.raise_wait_frac:
            k = raisable[0]
            to = k.clamp(values[k.name] + k.step)
            # Judged on the regime in force (its groups trained: a wave), and a setting that broke the budget
            # n times is tried again only after raise_after x 2^n calm steps (back-off).
            if state.calm >= max(self.wave(values, s), self.raise_after * 2 ** state.struck(k.name, to)):
                return {**values, k.name: to}, replace(state, window=(), calm=0), "raise"
        return values, state, "hold"

    @staticmethod
    def wave(values: dict[str, float], s: StepSignals) -> int:
        """Steps until the groups admitted under the settings in force are the ones trained: eta + 1 (a group
        admitted at version v under eta is trained by v + eta, and leases made before the store heard of a
        change add one). eta is the tuned one, else the step's `async/eta`."""
        return int(values.get("eta", s.eta if s.eta is not None else 0.0)) + 1

    def warning(self, state: TunerState) -> str | None:
        """The one line to print when the budget's signal has never arrived (the tuner cannot raise), else None."""
        if state.seen or state.missing != MISSING_WARN_AFTER:
            return None
        keys = " and ".join(k for k, on in (("mismatch/ess", self.min_ess is not None), ("mismatch/k3", self.max_k3 is not None)) if on)
        return (f"warning: auto: {MISSING_WARN_AFTER} steps and no {keys} in the learner's metrics, so the budget "
                "cannot be judged and nothing will be raised; the learner must report them (learners/worker.py does, "
                "from the token lags it is given), or fix the settings by hand (async.max_staleness, rollout.over_provision)")


__all__ = ["MISSING_WARN_AFTER", "Knob", "OffPolicyTuner", "StepSignals", "TunerState", "Window", "wait_share"]
