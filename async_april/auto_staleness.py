"""`async.max_staleness: auto`: eta that tunes itself from measured off-policyness.

Pure logic, no Ray, like `StalenessController`. After every learner step the
controller reads three numbers of that step:

    ess        mismatch/ess: normalised effective sample size of the token IS weights pi_theta / pi_behav
    k3         mismatch/k3: KL(pi_behav || pi_theta), k3 estimator
    wait_frac  timing_s/rollout / timing_s/step: the share of the step the learner waited for generation

and moves eta by at most one per step inside [low, high]:

    budget broken (ess < min_ess or k3 > max_k3)          -> eta - 1   (at once: the data are too stale)
    budget holds and wait_frac >= raise_wait_frac
        for raise_after consecutive steps                 -> eta + 1   (generation is the bottleneck)
    otherwise (or a budget signal missing)                -> eta       (the streak restarts)

Raising is slow on purpose: tokens of a new lag reach the learner only in later
steps, so the budget is judged on the new regime before the next raise.
Admission stays exact through each change (async_april/store.py
`set_max_staleness`): a raise opens admission at once; a lowering applies to
groups admitted afterwards, while every group admitted before keeps the bound
it was admitted under, so none becomes too stale to train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from async_april.config import AsyncConfig

Decision = Literal["raise", "lower", "hold"]


@dataclass(frozen=True)
class StepSignals:
    ess: float | None
    k3: float | None
    wait_frac: float

    @classmethod
    def from_metrics(cls, metrics: dict[str, float]) -> "StepSignals":
        """From one step's metrics (learner and controller keys)."""
        step_s = float(metrics.get("timing_s/step", 0.0))
        wait = float(metrics.get("timing_s/rollout", 0.0)) / step_s if step_s > 0 else 0.0
        ess, k3 = metrics.get("mismatch/ess"), metrics.get("mismatch/k3")
        return cls(None if ess is None else float(ess), None if k3 is None else float(k3), wait)


@dataclass(frozen=True)
class AutoEta:
    low: int
    high: int
    min_ess: float | None = 0.9
    max_k3: float | None = None
    raise_wait_frac: float = 0.1
    raise_after: int = 2

    @classmethod
    def from_config(cls, async_config: "AsyncConfig") -> "AutoEta":
        a = async_config.auto
        return cls(a.min, a.max, a.min_ess, a.max_k3, a.raise_wait_frac, a.raise_after)

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"auto eta needs 0 <= low ({self.low}) <= high ({self.high})")
        if self.min_ess is None and self.max_k3 is None:
            raise ValueError("auto eta needs a budget: min_ess or max_k3")
        if self.raise_after < 1:
            raise ValueError(f"raise_after={self.raise_after} must be >= 1")

    def budget_broken(self, s: StepSignals) -> bool:
        """Whether this step's off-policyness exceeds the budget (a missing signal breaks nothing)."""
        low_ess = self.min_ess is not None and s.ess is not None and s.ess < self.min_ess
        high_kl = self.max_k3 is not None and s.k3 is not None and s.k3 > self.max_k3
        return low_ess or high_kl

    def decide(self, eta: int, streak: int, s: StepSignals) -> tuple[int, int, Decision]:
        """(new eta, new streak, what was decided) after a step measured as `s` at `eta`."""
        eta = min(max(eta, self.low), self.high)
        measured = (self.min_ess is None or s.ess is not None) and (self.max_k3 is None or s.k3 is not None)
        if self.budget_broken(s):
            return max(self.low, eta - 1), 0, ("lower" if eta > self.low else "hold")
        if not measured or s.wait_frac < self.raise_wait_frac or eta >= self.high:
            return eta, 0, "hold"
        if streak + 1 >= self.raise_after:
            return eta + 1, 0, "raise"
        return eta, streak + 1, "hold"


__all__ = ["AutoEta", "StepSignals"]
