"""Rejection sampling: drop tokens or whole sequences whose policies diverge too far.

Pure tensor functions, no distributed code. With the log-ratio of a target
policy (the proximal policy, or the current one) to the behaviour policy

    d_t  = log pi_target(y_t) - log pi_behav(y_t)        clamped to +-MAX_LOG_RATIO
    k1_t = -d_t                   log pi_behav - log pi_target: signed; its mean over behaviour
                                  samples estimates KL(pi_behav || pi_target)
    k2_t = d_t^2 / 2              >= 0
    k3_t = exp(d_t) - d_t - 1     >= 0, unbiased for KL(pi_behav || pi_target), low variance

a token is kept when its statistic lies in [low, high] (either bound may be
None). The statistic is the token's own (`token`) or its sequence's sum, mean
or max over real tokens (`sequence_sum`, `sequence_mean`, `sequence_max`),
which keeps or drops the whole sequence.

Sources: verl 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py`
(`compute_rollout_rejection_mask`: token_k*, seq_sum_k*, seq_mean_k*,
seq_max_k*, same k1/k2/k3 definitions on `log_ratio = old - rollout`); TRL
1.16 `trl/trainer/grpo_trainer.py` (`get_off_policy_mask`, DeepSeek-V3.2's
off-policy sequence mask: sequence mean of k1 <= delta, and a sequence with a
non-negative advantage is always kept), reproduced here by
`negative_advantages_only`.

Whether a rejected token still counts in the loss normaliser is the caller's
choice (`policy_loss`): verl removes it from the response mask (it leaves the
normaliser), slime's `policy_loss_function` zeroes its loss and keeps the
per-rollout denominators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from async_april.algorithms.ratios import MAX_LOG_RATIO

Divergence = Literal["k1", "k2", "k3"]
RejectLevel = Literal["token", "sequence_sum", "sequence_mean", "sequence_max"]
DIVERGENCES = ("k1", "k2", "k3")
REJECT_LEVELS = ("token", "sequence_sum", "sequence_mean", "sequence_max")


@dataclass(frozen=True)
class RejectionSettings:
    """`algorithm.rejection`, field for field (see docs/algorithms.md); divergence "none" turns it off."""

    divergence: Literal["none", "k1", "k2", "k3"] = "none"
    level: RejectLevel = "token"
    low: float | None = None
    high: float | None = None
    against: Literal["proximal", "current"] = "proximal"
    negative_advantages_only: bool = False
    keep_in_normalizer: bool = True

    def __post_init__(self) -> None:
        if self.divergence not in ("none", *DIVERGENCES):
            raise ValueError(f"algorithm.rejection.divergence={self.divergence!r} is not one of {('none', *DIVERGENCES)}")
        if self.level not in REJECT_LEVELS:
            raise ValueError(f"algorithm.rejection.level={self.level!r} is not one of {REJECT_LEVELS}")
        if self.against not in ("proximal", "current"):
            raise ValueError(f"algorithm.rejection.against={self.against!r} is not one of ('proximal', 'current')")
        if self.on and self.low is None and self.high is None:
            raise ValueError(f"algorithm.rejection.divergence={self.divergence} rejects nothing without a bound; "
                             "set algorithm.rejection.high (and/or low)")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"algorithm.rejection.low ({self.low}) must not exceed algorithm.rejection.high ({self.high})")
        if self.on and not self.keep_in_normalizer and self.against == "current":
            raise ValueError(
                "algorithm.rejection.keep_in_normalizer=false needs algorithm.rejection.against=proximal: the learner "
                "counts the kept tokens of the whole batch before the step, and the current policy moves during it")

    @property
    def on(self) -> bool:
        return self.divergence != "none"

    @property
    def counts_before_step(self) -> bool:
        """Whether the normaliser must be the batch's KEPT tokens (and sequences), known before the step."""
        return self.on and not self.keep_in_normalizer


def token_divergence(target_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                     divergence: Divergence) -> torch.Tensor:
    """[B, T] k1, k2 or k3 per token (see the module docstring), 0 on padding. No gradient."""
    d = torch.where(mask, target_logprobs.detach() - behavior_logprobs.detach(), torch.zeros_like(target_logprobs))
    d = d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if divergence == "k1":
        return -d
    if divergence == "k2":
        return 0.5 * d**2
    if divergence == "k3":
        return torch.exp(d) - d - 1.0
    raise ValueError(f"unknown divergence {divergence!r}; set algorithm.rejection.divergence to one of {DIVERGENCES}")


def rejection_statistic(target_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                        divergence: Divergence, level: RejectLevel) -> torch.Tensor:
    """[B, T] the statistic each token is judged by: its own divergence, or its sequence's sum,
    mean or max over real tokens broadcast to every token of the sequence (an empty row gives 0)."""
    tok = token_divergence(target_logprobs, behavior_logprobs, mask, divergence)
    if level == "token":
        return tok
    if level == "sequence_sum":
        seq = tok.sum(dim=-1)
    elif level == "sequence_mean":
        seq = tok.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(tok.dtype)
    elif level == "sequence_max":
        seq = torch.where(mask, tok, torch.full_like(tok, float("-inf"))).max(dim=-1).values
        seq = torch.where(mask.any(dim=-1), seq, torch.zeros_like(seq))
    else:
        raise ValueError(f"unknown rejection level {level!r}; set algorithm.rejection.level to one of {REJECT_LEVELS}")
    return seq.unsqueeze(-1).expand_as(tok)


def rejection_keep(
    target_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    divergence: Divergence,
    level: RejectLevel,
    low: float | None,
    high: float | None,
    advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [B, T]: real tokens that pass (low <= statistic <= high), False on padding.

    advantages: [B, T]; when given, only tokens with a negative advantage can be rejected
    (TRL's off-policy sequence mask keeps every non-negative-advantage sequence).
    """
    stat = rejection_statistic(target_logprobs, behavior_logprobs, mask, divergence, level)
    passes = torch.ones_like(mask)
    if low is not None:
        passes = passes & (stat >= low)
    if high is not None:
        passes = passes & (stat <= high)
    if advantages is not None:
        passes = passes | (advantages >= 0)
    return mask & passes


__all__ = ["DIVERGENCES", "REJECT_LEVELS", "RejectionSettings", "token_divergence", "rejection_statistic", "rejection_keep"]
