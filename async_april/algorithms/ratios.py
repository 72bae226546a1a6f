"""The building blocks of the policy losses: clamped log-ratios, IS weights and their bounds, the
clipped objective, aggregation and the k3 KL. Pure tensor functions over [B, T] tensors and a
boolean mask; async_april/algorithms/losses.py composes them (its docstring names the policies).
"""

from __future__ import annotations

from typing import Literal

import torch

# Every log-ratio is clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO] before exp. One token whose
# behaviour logprob is -inf or very small (e.g. -1e4 from a sampler's masked logit) would
# otherwise overflow exp to inf and turn the loss and every gradient into NaN. The clip already
# bounds the useful range of the ratio to about [0.8, 1.3] (GSPO: 1 +- 4e-4; dual clip: c), so
# only tokens with |log-ratio| > 20 (ratio ~5e8) are affected: their ratio is capped at e^20 and
# they get zero gradient, as a clipped token would.
MAX_LOG_RATIO = 20.0

LossKind = Literal["ppo", "gspo", "cispo"]
Correction = Literal["direct", "decoupled", "none"]
WeightBound = Literal["truncate", "mask", "none"]
WeightLevel = Literal["token", "sequence", "sequence_product"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "constant"]

_CHOICES = {
    "loss": ("ppo", "gspo", "cispo"),
    "correction": ("direct", "decoupled", "none"),
    "weight_bound": ("truncate", "mask", "none"),
    "weight_level": ("token", "sequence", "sequence_product"),
    "aggregation": ("token_mean", "seq_mean_token_mean", "constant"),
}


def _log_ratio(num: torch.Tensor, den: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log(num / den) on real tokens, 0 on padding, clamped to +-MAX_LOG_RATIO."""
    diff = torch.where(mask, num - den, torch.zeros_like(num))
    return diff.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _seq_lengths(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B] number of real tokens per sequence, at least 1 (so empty rows divide safely)."""
    return mask.sum(dim=-1).clamp(min=1).to(dtype)


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: mean over each sequence's real tokens (0 for an empty row)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum(dim=-1) / _seq_lengths(mask, x.dtype)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over all real tokens of this call (0 if there are none)."""
    return torch.where(mask, x, torch.zeros_like(x)).sum() / mask.sum().clamp(min=1).to(x.dtype)


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over real tokens (0 if there are none)."""
    return x[mask].max() if bool(mask.any()) else x.new_zeros(())


def _broadcast_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] or [B, T] advantages -> [B, T], in `like`'s dtype."""
    adv = advantages.to(like.dtype)
    if adv.shape == like.shape:
        return adv
    if adv.dim() == 1 and adv.shape[0] == like.shape[0]:
        return adv.unsqueeze(-1).expand_as(like)
    raise ValueError(f"advantages must have shape [B]={like.shape[0]} or [B, T]={tuple(like.shape)}, got {tuple(adv.shape)}")


def _check_inputs(logprobs: torch.Tensor, mask: torch.Tensor, **others: torch.Tensor | None) -> torch.Tensor:
    """Validate [B, T] shapes; return the mask as bool."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    for name, t in {"mask": mask, **others}.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logprobs has {tuple(logprobs.shape)}; both must be [B, T]")
    return mask.bool()


def importance_weight(
    proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor, level: WeightLevel
) -> torch.Tensor:
    """Detached decoupled weight w = pi_prox / pi_behav, [B, T].

    level "token": per token. level "sequence": exp(mean over the sequence's real tokens of
    log w), the geometric mean, broadcast over the sequence. level "sequence_product": the true
    sequence weight prod_t w_t = exp(sum of log w_t), summed in log space and clamped to
    +-MAX_LOG_RATIO before exp (verl rollout_is="sequence"), broadcast. Padding holds 1.
    """
    log_w = _log_ratio(proximal_logprobs.detach(), behavior_logprobs.detach(), mask)
    if level == "sequence":
        log_w = _seq_mean(log_w, mask).unsqueeze(-1).expand_as(log_w)
    elif level == "sequence_product":
        log_w = log_w.sum(dim=-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).unsqueeze(-1).expand_as(log_w)
    return torch.exp(log_w)


def bound_weight(
    weight: torch.Tensor, bound: WeightBound, cap: float, low: float, high: float, floor: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound a [B, T] weight. Returns (bounded weight, bool [B, T] where the bound acted).

    truncate: clamp(w, floor, cap) (TIS; slime's tis_clip_low / tis_clip; floor 0 is min(w, cap)).
    mask: w where low <= w <= high, else 0 (the token's loss is
    dropped; it still counts in the normaliser). none: w unchanged.
    """
    if bound == "truncate":
        return weight.clamp(min=floor, max=cap), (weight > cap) | (weight < floor)
    if bound == "mask":
        keep = (weight >= low) & (weight <= high)
        return torch.where(keep, weight, torch.zeros_like(weight)), ~keep
    return weight, torch.zeros_like(weight, dtype=torch.bool)


def token_ratio(logprobs: torch.Tensor, base_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO ratio pi_theta / pi_base per token, [B, T]; gradient flows through `logprobs`."""
    return torch.exp(_log_ratio(logprobs, base_logprobs.detach(), mask))


def gspo_ratio(logprobs: torch.Tensor, base_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token ratio, [B, T]: s_it = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)].

    s_i = exp(mean over the sequence's tokens of log(pi_theta / pi_base)). Every token's value
    is s_i; its gradient is s_i * grad log pi_theta(y_t), so with per-sequence advantages and
    seq_mean_token_mean aggregation the gradient equals GSPO's sequence-level one.
    """
    log_s = _seq_mean(_log_ratio(logprobs, base_logprobs.detach(), mask), mask).detach()
    lp = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    return torch.exp(log_s.unsqueeze(-1) + (lp - lp.detach()))


def clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip objective per token (to maximise), [B, T].

    obj = min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); with dual clip c and A < 0,
    obj = max(obj, c A). Returns (obj, clip_active, dual_active), the last two bool [B, T]:
    clip_active is True wherever either clip cut the gradient.
    """
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    obj = torch.minimum(unclipped, clipped)
    ppo_active = clipped < unclipped
    dual_active = torch.zeros_like(ppo_active)
    if dual_clip is not None:
        floor = dual_clip * advantages
        dual_active = (advantages < 0) & (obj < floor)
        obj = torch.where(dual_active, floor, obj)
    return obj, ppo_active | dual_active, dual_active


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    aggregation: Aggregation,
    global_tokens: float,
    global_sequences: float,
    constant_normalizer: float | None = None,
) -> torch.Tensor:
    """This call's share of the full-batch mean of a [B, T] per-token quantity.

    token_mean:           sum(x * mask) / global_tokens
    seq_mean_token_mean:  sum_i (mean of x over sequence i's tokens) / global_sequences
    constant:             sum(x * mask) / (constant_normalizer * global_sequences)   (Dr.GRPO)
    """
    total = torch.where(mask, per_token, torch.zeros_like(per_token))
    if aggregation == "token_mean":
        return total.sum() / global_tokens
    if aggregation == "seq_mean_token_mean":
        return _seq_mean(per_token, mask).sum() / global_sequences
    if aggregation == "constant":
        if constant_normalizer is None:
            raise ValueError(
                "aggregation='constant' needs constant_normalizer; build LossSettings with "
                "LossSettings.from_config(cfg.algorithm, cfg.rollout.max_new_tokens) or set algorithm.constant_normalizer"
            )
        return total.sum() / (constant_normalizer * global_sequences)
    raise ValueError(f"unknown aggregation {aggregation!r}; set algorithm.aggregation to one of {_CHOICES['aggregation']}")


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token, [B, T]: exp(d) - d - 1 with d = log pi_ref - log pi_theta."""
    d = _log_ratio(ref_logprobs.detach(), logprobs, mask)
    return torch.exp(d) - d - 1.0
