"""Importance-corrected policy losses: PPO-clip (token ratio) and GSPO (sequence ratio).

Pure tensor functions, no distributed code. Three policies are named in the
maths (as in AReaL's `ppo_actor_loss_fn`):

    logprobs            log pi_theta     the policy being trained (carries gradient)
    behavior_logprobs   log pi_behav     what the sampler recorded, token by token, possibly
                                         from several policy versions across resumes
    proximal_logprobs   log pi_prox      the learner's policy before this step's update
                                         (decoupled correction only)

Correction (`algorithm.correction`):
    direct (CoPRIS):     r = pi_theta / pi_behav, inside the PPO clip. The clip is the only bound;
                         `weight_bound` / `weight_level` are not used.
    decoupled (AReaL):   u = pi_theta / pi_prox inside the clip, times the detached weight
                         w = pi_prox / pi_behav, bounded by `weight_bound` (truncate | mask | none)
                         per token or per sequence (`weight_level`, geometric mean).
    none (ablation only): u = pi_theta / pi_prox with no behaviour weight: staleness is ignored,
                         exactly the trap of recomputing behaviour logprobs with the current policy.

Normalisation: the caller passes `global_tokens` and `global_sequences`, the
counts over the WHOLE step batch (all micro-batches, all ranks). Each call
returns its share of the full-batch loss, so summing the returned losses (and
their gradients) over every micro-batch on every rank gives exactly the
full-batch loss: micro-batching, accumulation and data parallelism do not
change the result.

Metrics (all 0-d detached tensors on the input's device, float32 or float64):
    is/weight_mean, is/weight_max   decoupled: the unbounded w = pi_prox / pi_behav;
                                    direct: the effective ratio (ppo: pi_theta / pi_behav per token,
                                    gspo: the sequence ratio)
    is/bounded_frac                 fraction of tokens whose w was truncated or masked (0 in direct)
    loss/clip_frac                  fraction of tokens whose gradient the clip cut (PPO clip or dual clip)
    loss/dual_clip_frac             fraction of tokens where the dual clip was the active bound
    loss/approx_kl                  mean of 0.5 * (log pi_theta - log pi_behav)^2 (k2, vs the behaviour policy)
    loss/policy, loss/kl            the aggregated policy loss and k3 KL (kl before kl_coef; only when used),
                                    rescaled by global_tokens / _tokens (see below)
    _tokens                         masked tokens in this call
Means are over this call's masked tokens. Combine calls with `merge_metrics`:
keys ending in `_max` by max, `_tokens` by sum, every other key by the
`_tokens`-weighted mean. `loss/policy` and `loss/kl` are reported as this
call's share times `global_tokens / _tokens`, so that same weighted mean
returns exactly the full-batch value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from async_april.config import AlgorithmConfig

# Every log-ratio is clamped to [-MAX_LOG_RATIO, MAX_LOG_RATIO] before exp. One token whose
# behaviour logprob is -inf or very small (e.g. -1e4 from a sampler's masked logit) would
# otherwise overflow exp to inf and turn the loss and every gradient into NaN. The clip already
# bounds the useful range of the ratio to about [0.8, 1.3] (GSPO: 1 +- 4e-4; dual clip: c), so
# only tokens with |log-ratio| > 20 (ratio ~5e8) are affected: their ratio is capped at e^20 and
# they get zero gradient, as a clipped token would.
MAX_LOG_RATIO = 20.0

LossKind = Literal["ppo", "gspo"]
Correction = Literal["direct", "decoupled", "none"]
WeightBound = Literal["truncate", "mask", "none"]
WeightLevel = Literal["token", "sequence"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "constant"]

_CHOICES = {
    "loss": ("ppo", "gspo"),
    "correction": ("direct", "decoupled", "none"),
    "weight_bound": ("truncate", "mask", "none"),
    "weight_level": ("token", "sequence"),
    "aggregation": ("token_mean", "seq_mean_token_mean", "constant"),
}


@dataclass(frozen=True)
class LossSettings:
    """The loss knobs, mirroring `AlgorithmConfig` field for field (see docs/algorithms.md)."""

    loss: LossKind = "ppo"
    correction: Correction = "direct"
    weight_bound: WeightBound = "truncate"
    weight_level: WeightLevel = "token"
    weight_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 2.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    aggregation: Aggregation = "token_mean"
    constant_normalizer: float | None = None
    """Per-sequence normaliser for aggregation="constant"; `from_config` fills in max_new_tokens."""
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"algorithm.{name}={value!r} is not one of {allowed}")
        if self.mask_low >= self.mask_high:
            raise ValueError(f"algorithm.mask_low ({self.mask_low}) must be below algorithm.mask_high ({self.mask_high})")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"algorithm.dual_clip={self.dual_clip} must be > 1 (or None to turn it off)")
        if self.constant_normalizer is not None and self.constant_normalizer <= 0:
            raise ValueError(f"algorithm.constant_normalizer={self.constant_normalizer} must be > 0")

    @classmethod
    def from_config(cls, algorithm_config: "AlgorithmConfig", max_new_tokens: int) -> "LossSettings":
        """Settings from `config.algorithm`; constant_normalizer None becomes `rollout.max_new_tokens` (Dr.GRPO)."""
        fields = {name: getattr(algorithm_config, name) for name in cls.__dataclass_fields__}
        if fields["constant_normalizer"] is None:
            fields["constant_normalizer"] = float(max_new_tokens)
        return cls(**fields)


# ----------------------------------------------------------------------------- helpers


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
    log w), broadcast over the sequence. Padding holds 1.
    """
    log_w = _log_ratio(proximal_logprobs.detach(), behavior_logprobs.detach(), mask)
    if level == "sequence":
        log_w = _seq_mean(log_w, mask).unsqueeze(-1).expand_as(log_w)
    return torch.exp(log_w)


def bound_weight(
    weight: torch.Tensor, bound: WeightBound, cap: float, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound a [B, T] weight. Returns (bounded weight, bool [B, T] where the bound acted).

    truncate: min(w, cap) (TIS). mask: w where low <= w <= high, else 0 (the token's loss is
    dropped; it still counts in the normaliser). none: w unchanged.
    """
    if bound == "truncate":
        return weight.clamp(max=cap), weight > cap
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


# ----------------------------------------------------------------------------- the loss


def policy_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    global_tokens: float,
    global_sequences: float,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance-corrected PPO-clip or GSPO loss for one micro-batch.

    Args:
        logprobs: [B, T] log pi_theta of the response tokens (with gradient), right-padded.
        behavior_logprobs: [B, T] the sampler's recorded logprobs. Never pass logprobs
            recomputed with the current policy: the ratio becomes 1 and the correction vanishes.
        advantages: [B] (per sequence, broadcast over tokens) or [B, T].
        mask: [B, T], 1 (True) on real response tokens.
        settings: the loss knobs.
        global_tokens: response tokens in the whole step batch (all micro-batches, all ranks).
        global_sequences: sequences in the whole step batch.
        proximal_logprobs: [B, T] log pi_prox; required for correction="decoupled".
        ref_logprobs: [B, T] reference-policy logprobs; required when kl_coef > 0.

    Returns:
        (loss, metrics): loss is a 0-d tensor, this call's share of the full-batch loss;
        metrics as described in the module docstring. Both are computed in at least
        float32 (bf16/fp16 inputs are upcast; gradients flow back in the input dtype).
    """
    s = settings
    m = _check_inputs(logprobs, mask, behavior_logprobs=behavior_logprobs,
                      proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs)
    # Compute in at least float32: bf16 cannot even count past 256 tokens exactly.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    logprobs, behavior_logprobs = logprobs.to(dtype), behavior_logprobs.to(dtype)
    proximal_logprobs = None if proximal_logprobs is None else proximal_logprobs.to(dtype)
    ref_logprobs = None if ref_logprobs is None else ref_logprobs.to(dtype)
    if global_tokens <= 0 or global_sequences <= 0:
        raise ValueError(f"global_tokens ({global_tokens}) and global_sequences ({global_sequences}) must be > 0")
    adv = _broadcast_advantages(advantages, logprobs).detach()

    if s.correction == "decoupled":
        if proximal_logprobs is None:
            raise ValueError(
                "algorithm.correction='decoupled' needs proximal_logprobs: the learner must compute "
                "logprobs with the pre-update policy and pass them as proximal_logprobs"
            )
        base = proximal_logprobs
        level: WeightLevel = "sequence" if s.loss == "gspo" else s.weight_level
        raw_weight = importance_weight(proximal_logprobs, behavior_logprobs, m, level)
        weight, bounded = bound_weight(raw_weight, s.weight_bound, s.weight_cap, s.mask_low, s.mask_high)
    elif s.correction == "none":
        # Deliberately uncorrected, for ablations: the behaviour policy is ignored.
        base = logprobs.detach() if proximal_logprobs is None else proximal_logprobs
        weight, bounded = None, torch.zeros_like(m)
    else:
        base, weight, bounded = behavior_logprobs, None, torch.zeros_like(m)

    if s.loss == "gspo":
        ratio = gspo_ratio(logprobs, base, m)
        clip_low, clip_high = s.gspo_clip_low, s.gspo_clip_high
    else:
        ratio = token_ratio(logprobs, base, m)
        clip_low, clip_high = s.clip_low, s.clip_high

    obj, clip_active, dual_active = clipped_objective(ratio, adv, clip_low, clip_high, s.dual_clip)
    per_token = -obj if weight is None else -obj * weight
    agg = dict(aggregation=s.aggregation, global_tokens=global_tokens,
               global_sequences=global_sequences, constant_normalizer=s.constant_normalizer)
    pg_loss = aggregate(per_token, m, **agg)
    loss = pg_loss

    kl_loss = None
    if s.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"algorithm.kl_coef={s.kl_coef} > 0 needs ref_logprobs; pass them or set algorithm.kl_coef=0")
        kl_loss = aggregate(k3_kl(logprobs, ref_logprobs, m), m, **agg)
        loss = loss + s.kl_coef * kl_loss

    is_weight = ratio.detach() if weight is None else raw_weight
    metrics = _metrics(logprobs, behavior_logprobs, m, is_weight, bounded, clip_active, dual_active,
                       pg_loss, kl_loss, global_tokens)
    return loss, metrics


def _metrics(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    is_weight: torch.Tensor,
    bounded: torch.Tensor,
    clip_active: torch.Tensor,
    dual_active: torch.Tensor,
    pg_loss: torch.Tensor,
    kl_loss: torch.Tensor | None,
    global_tokens: float,
) -> dict[str, torch.Tensor]:
    """Detached metrics over this call's masked tokens (see the module docstring)."""
    with torch.no_grad():
        dtype = logprobs.dtype
        tokens = mask.sum().to(dtype)
        # Rescale the loss shares so that the _tokens-weighted mean over all calls is the full-batch value.
        to_mean = global_tokens / tokens if tokens > 0 else tokens.new_zeros(())
        log_r = _log_ratio(logprobs.detach(), behavior_logprobs.detach(), mask)
        out = {
            "is/weight_mean": _masked_mean(is_weight, mask),
            "is/weight_max": _masked_max(is_weight, mask),
            "is/bounded_frac": _masked_mean(bounded.to(dtype), mask),
            "loss/clip_frac": _masked_mean(clip_active.to(dtype), mask),
            "loss/dual_clip_frac": _masked_mean(dual_active.to(dtype), mask),
            "loss/approx_kl": _masked_mean(0.5 * log_r**2, mask),
            "loss/policy": pg_loss.detach() * to_mean,
            "_tokens": tokens,
        }
        if kl_loss is not None:
            out["loss/kl"] = kl_loss.detach() * to_mean
    return out


def merge_metrics(metrics: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Combine the metrics of several `policy_loss` calls (micro-batches) into one dict.

    `_max` keys: max; `_tokens`: sum; every other key: `_tokens`-weighted mean. Across ranks,
    do the same with all-reduce: SUM of value * _tokens and of _tokens, MAX of `_max` keys.
    """
    if not metrics:
        return {}
    tokens = torch.stack([m["_tokens"] for m in metrics])
    total = tokens.sum()
    out: dict[str, torch.Tensor] = {"_tokens": total}
    for key in metrics[0]:
        if key == "_tokens":
            continue
        values = torch.stack([m[key] for m in metrics])
        if key.endswith("_max"):
            out[key] = values.max()
        else:
            out[key] = (values * tokens).sum() / total.clamp(min=1)
    return out


def staleness_metrics(
    versions: Sequence[np.ndarray] | np.ndarray | torch.Tensor,
    policy_version: int,
    mask: np.ndarray | torch.Tensor | None = None,
) -> dict[str, float]:
    """Per-token lag `policy_version - version`: `staleness/token_lag_mean` and `staleness/token_lag_max`.

    versions: a list of per-sequence version arrays (as in `TrainBatch.versions`), or one
    array/tensor of versions; with a padded [B, T] array pass `mask` to drop the padding.
    No tokens gives zeros.
    """
    if isinstance(versions, torch.Tensor):
        versions = versions.detach().cpu().numpy()
    if isinstance(versions, np.ndarray):
        flat = versions if mask is None else versions[np.asarray(mask).astype(bool)]
    else:
        flat = np.concatenate([np.asarray(v).reshape(-1) for v in versions]) if len(versions) else np.zeros(0)
    lag = policy_version - np.asarray(flat, np.float64).reshape(-1)
    if lag.size == 0:
        return {"staleness/token_lag_mean": 0.0, "staleness/token_lag_max": 0.0}
    return {"staleness/token_lag_mean": float(lag.mean()), "staleness/token_lag_max": float(lag.max())}


__all__ = [
    "MAX_LOG_RATIO",
    "LossSettings",
    "policy_loss",
    "merge_metrics",
    "staleness_metrics",
    "importance_weight",
    "bound_weight",
    "token_ratio",
    "gspo_ratio",
    "clipped_objective",
    "aggregate",
    "k3_kl",
]
