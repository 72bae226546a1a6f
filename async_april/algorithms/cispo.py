"""CISPO: clip the importance weight, not the update (MiniMax-M1, arXiv 2506.13585).

    obj_t = sg[ clip(r_t, weight_min, weight_max) ] * A_t * log pi_theta(y_t)
    grad  = clip(r_t, weight_min, weight_max) * A_t * grad log pi_theta(y_t)

r_t is the token ratio pi_theta / pi_base (base: the behaviour policy with
`correction: direct`, the proximal one with `decoupled`, whose bounded weight
then multiplies the objective as for PPO). Unlike PPO-clip, no token loses its
gradient: a token whose ratio leaves the range keeps a gradient scaled by the
bound, so rare tokens that PPO would clip away (the "fork" tokens of long
reasoning) still learn. The value of the objective is not a surrogate of the
return (log pi is negative), only its gradient matters; `loss/policy` is
therefore not comparable with PPO's.

Sources: MiniMax-M1 (eq. 4, token-level normalised by all tokens of the batch);
verl 0.9.1 `verl/trainer/ppo/core_algos.py` `compute_policy_loss_cispo`
(clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high), detached); TRL 1.16
`trl/trainer/grpo_trainer.py` `loss_type == "cispo"` (clamp(ratio,
max=epsilon_high), detached, no lower bound; its docs recommend 5.0, the
ScaleRL paper's eps_max). Here `weight_min` None means no lower bound, as in
TRL and the paper's setting.
"""

from __future__ import annotations

import torch


def cispo_objective(
    ratio: torch.Tensor,
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weight_min: float | None,
    weight_max: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token CISPO objective (to maximise), [B, T], and bool [B, T] where the ratio was clipped.

    ratio: pi_theta / pi_base per token (any gradient it carries is stopped here);
    logprobs: log pi_theta, the only path of the gradient; advantages: [B, T].
    """
    r = ratio.detach()
    weight = r.clamp(min=weight_min, max=weight_max)
    clipped = r > weight_max
    if weight_min is not None:
        clipped = clipped | (r < weight_min)
    return weight * advantages * logprobs, clipped


__all__ = ["cispo_objective"]
