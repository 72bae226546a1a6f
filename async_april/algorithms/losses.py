"""Importance-corrected policy losses: PPO-clip (token ratio), GSPO (sequence ratio), CISPO.

The building blocks (log-ratios, IS weights and their bounds, the clipped objective, aggregation,
k3 KL) are async_april/algorithms/ratios.py; per-token staleness figures algorithms/metrics.py;
rejection sampling algorithms/rejection.py; CISPO's objective algorithms/cispo.py; the
behaviour/current mismatch figures algorithms/mismatch.py.

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
                         per token or per sequence (`weight_level`: geometric mean, or the
                         product of the token weights), truncation optionally floored (`weight_floor`).
    none (ablation only): u = pi_theta / pi_prox with no behaviour weight: staleness is ignored,
                         exactly the trap of recomputing behaviour logprobs with the current policy.

Loss (`algorithm.loss`): ppo (PPO-clip on the token ratio), gspo (on the sequence ratio),
cispo (the clipped ratio as a detached weight on log pi_theta: no token loses its gradient).

Rejection (`algorithm.rejection`): tokens or whole sequences whose k1/k2/k3 divergence between
the behaviour policy and the proximal (or current) one leaves [low, high] get zero loss (policy
and KL terms alike, so no gradient at all); they
stay in the normaliser or leave it (then the caller passes the KEPT counts as global_tokens /
global_sequences and the batch's real token count as `batch_tokens`).

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
    is/rejected_frac                fraction of tokens rejected by `algorithm.rejection` (0 when off)
    loss/clip_frac                  fraction of tokens whose gradient the clip cut (PPO clip or dual clip);
                                    cispo: whose ratio was clipped (its gradient is scaled, not cut)
    loss/dual_clip_frac             fraction of tokens where the dual clip was the active bound
    loss/approx_kl                  mean of 0.5 * (log pi_theta - log pi_behav)^2 (k2, vs the behaviour policy)
    loss/policy, loss/kl            the aggregated policy loss and k3 KL (kl before kl_coef; only when used),
                                    rescaled by global_tokens / _tokens (see below)
    mismatch/*                      when the caller passes token_lags: KL k1/k3 and IS effective sample
                                    size between behaviour and current policy, by token lag
                                    (algorithms/mismatch.py; finalise after merging)
    _tokens                         masked tokens in this call
Means are over this call's masked tokens. Combine calls with `merge_metrics`:
keys ending in `_max` by max, `_tokens` by sum, every other key by the
`_tokens`-weighted mean. `loss/policy` and `loss/kl` are reported as this
call's share times `batch_tokens / _tokens` (batch_tokens defaults to
global_tokens), so that same weighted mean returns exactly the full-batch value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from async_april.algorithms.cispo import cispo_objective
from async_april.algorithms.mismatch import mismatch_metrics
from async_april.algorithms.rejection import RejectionSettings, rejection_keep
from async_april.algorithms.ratios import (
    _CHOICES,
    Aggregation,
    Correction,
    LossKind,
    WeightBound,
    WeightLevel,
    MAX_LOG_RATIO,
    _log_ratio,
    _masked_mean,
    _masked_max,
    _broadcast_advantages,
    _check_inputs,
    importance_weight,
    bound_weight,
    token_ratio,
    gspo_ratio,
    clipped_objective,
    aggregate,
    k3_kl,
)

if TYPE_CHECKING:
    from async_april.config import AlgorithmConfig


@dataclass(frozen=True)
class LossSettings:
    """The loss knobs, mirroring `AlgorithmConfig` field for field (see docs/algorithms.md)."""

    loss: LossKind = "ppo"
    correction: Correction = "direct"
    weight_bound: WeightBound = "truncate"
    weight_level: WeightLevel = "token"
    weight_cap: float = 2.0
    weight_floor: float = 0.0
    mask_low: float = 0.5
    mask_high: float = 2.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    cispo_weight_min: float | None = None
    cispo_weight_max: float = 5.0
    aggregation: Aggregation = "token_mean"
    constant_normalizer: float | None = None
    """Per-sequence normaliser for aggregation="constant"; `from_config` fills in max_new_tokens."""
    kl_coef: float = 0.0
    rejection: RejectionSettings = RejectionSettings()

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
        if not 0.0 <= self.weight_floor <= self.weight_cap:
            raise ValueError(f"algorithm.weight_floor={self.weight_floor} must be in [0, algorithm.weight_cap={self.weight_cap}]")
        if self.cispo_weight_min is not None and not 0.0 <= self.cispo_weight_min < self.cispo_weight_max:
            raise ValueError(f"algorithm.cispo_weight_min={self.cispo_weight_min} must be in [0, "
                             f"algorithm.cispo_weight_max={self.cispo_weight_max})")

    @property
    def needs_proximal(self) -> bool:
        """Whether `policy_loss` reads proximal_logprobs: decoupled weights, or rejection against pi_prox."""
        return self.correction == "decoupled" or (self.rejection.on and self.rejection.against == "proximal")

    @classmethod
    def from_config(cls, algorithm_config: "AlgorithmConfig", max_new_tokens: int) -> "LossSettings":
        """Settings from `config.algorithm`; constant_normalizer None becomes `rollout.max_new_tokens` (Dr.GRPO)."""
        fields = {name: getattr(algorithm_config, name) for name in cls.__dataclass_fields__ if name != "rejection"}
        fields["rejection"] = RejectionSettings(**algorithm_config.rejection.model_dump())
        if fields["constant_normalizer"] is None:
            fields["constant_normalizer"] = float(max_new_tokens)
        return cls(**fields)


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
    token_lags: torch.Tensor | None = None,
    max_lag: int = 0,
    batch_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance-corrected PPO-clip, GSPO or CISPO loss for one micro-batch.

    Args:
        logprobs: [B, T] log pi_theta of the response tokens (with gradient), right-padded.
        behavior_logprobs: [B, T] the sampler's recorded logprobs. Never pass logprobs
            recomputed with the current policy: the ratio becomes 1 and the correction vanishes.
        advantages: [B] (per sequence, broadcast over tokens) or [B, T].
        mask: [B, T], 1 (True) on real response tokens.
        settings: the loss knobs.
        global_tokens: response tokens in the whole step batch (all micro-batches, all ranks);
            with rejected tokens out of the normaliser, the KEPT ones.
        global_sequences: sequences in the whole step batch (kept: with at least one kept token).
        proximal_logprobs: [B, T] log pi_prox; required for correction="decoupled" and for
            rejection against the proximal policy.
        ref_logprobs: [B, T] reference-policy logprobs; required when kl_coef > 0.
        token_lags: [B, T] policy version minus each token's version; given, the metrics gain
            the `mismatch/` figures for lags 0..max_lag.
        batch_tokens: real response tokens of the whole step batch, when global_tokens counts
            only the kept ones (for the metrics' rescaling; default global_tokens).

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

    if s.needs_proximal and proximal_logprobs is None:
        why = "correction='decoupled'" if s.correction == "decoupled" else "rejection.against='proximal'"
        raise ValueError(
            f"algorithm.{why} needs proximal_logprobs: the learner must compute "
            "logprobs with the pre-update policy and pass them as proximal_logprobs"
        )
    if s.correction == "decoupled":
        base = proximal_logprobs
        # GSPO's ratio is a geometric mean, so its weight is one too, unless the product is asked for.
        level: WeightLevel = "sequence" if s.loss == "gspo" and s.weight_level == "token" else s.weight_level
        raw_weight = importance_weight(proximal_logprobs, behavior_logprobs, m, level)
        weight, bounded = bound_weight(raw_weight, s.weight_bound, s.weight_cap, s.mask_low, s.mask_high, s.weight_floor)
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

    if s.loss == "cispo":
        obj, clip_active = cispo_objective(ratio, logprobs, adv, s.cispo_weight_min, s.cispo_weight_max)
        dual_active = torch.zeros_like(m)
    else:
        obj, clip_active, dual_active = clipped_objective(ratio, adv, clip_low, clip_high, s.dual_clip)
    per_token = -obj if weight is None else -obj * weight
    rejected, counted = torch.zeros_like(m), m  # counted: the tokens in the normaliser
    if s.rejection.on:
        r = s.rejection
        target = proximal_logprobs if r.against == "proximal" else logprobs.detach()
        keep = rejection_keep(target, behavior_logprobs, m, r.divergence, r.level, r.low, r.high,
                              adv if r.negative_advantages_only else None)
        rejected = m & ~keep
        per_token = torch.where(rejected, torch.zeros_like(per_token), per_token)
        counted = m if r.keep_in_normalizer else keep
    agg = dict(aggregation=s.aggregation, global_tokens=global_tokens,
               global_sequences=global_sequences, constant_normalizer=s.constant_normalizer)
    pg_loss = aggregate(per_token, counted, **agg)
    loss = pg_loss

    kl_loss = None
    if s.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"algorithm.kl_coef={s.kl_coef} > 0 needs ref_logprobs; pass them or set algorithm.kl_coef=0")
        kl = k3_kl(logprobs, ref_logprobs, m)
        # A rejected token gets no loss, so no KL either, in or out of the normaliser (verl 0.9.1 drops it
        # from response_mask, which verl/workers/utils/losses.py `ppo_loss` also aggregates the KL over).
        kl = torch.where(rejected, torch.zeros_like(kl), kl)
        kl_loss = aggregate(kl, counted, **agg)
        loss = loss + s.kl_coef * kl_loss

    is_weight = ratio.detach() if weight is None else raw_weight
    metrics = _metrics(logprobs, behavior_logprobs, m, is_weight, bounded, rejected, clip_active, dual_active,
                       pg_loss, kl_loss, global_tokens if batch_tokens is None else batch_tokens)
    if token_lags is not None:
        metrics.update(mismatch_metrics(logprobs, behavior_logprobs, m, token_lags, max_lag, bounded, rejected))
    return loss, metrics


def _metrics(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    is_weight: torch.Tensor,
    bounded: torch.Tensor,
    rejected: torch.Tensor,
    clip_active: torch.Tensor,
    dual_active: torch.Tensor,
    pg_loss: torch.Tensor,
    kl_loss: torch.Tensor | None,
    batch_tokens: float,
) -> dict[str, torch.Tensor]:
    """Detached metrics over this call's masked tokens (see the module docstring)."""
    with torch.no_grad():
        dtype = logprobs.dtype
        tokens = mask.sum().to(dtype)
        # Rescale the loss shares so that the _tokens-weighted mean over all calls is the full-batch value.
        to_mean = batch_tokens / tokens if tokens > 0 else tokens.new_zeros(())
        log_r = _log_ratio(logprobs.detach(), behavior_logprobs.detach(), mask)
        out = {
            "is/weight_mean": _masked_mean(is_weight, mask),
            "is/weight_max": _masked_max(is_weight, mask),
            "is/bounded_frac": _masked_mean(bounded.to(dtype), mask),
            "is/rejected_frac": _masked_mean(rejected.to(dtype), mask),
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


__all__ = [
    "MAX_LOG_RATIO",
    "LossSettings",
    "policy_loss",
    "merge_metrics",
    "importance_weight",
    "bound_weight",
    "token_ratio",
    "gspo_ratio",
    "clipped_objective",
    "aggregate",
    "k3_kl",
]
