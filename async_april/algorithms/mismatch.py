"""Mismatch metrics: how far the trained policy is from the one that sampled, every step.

Pure tensor functions. With d_t = log pi_theta(y_t) - log pi_behav(y_t)
(clamped to +-MAX_LOG_RATIO) on every real response token:

    mismatch/k1            mean of -d              KL(pi_behav || pi_theta), direct estimator
    mismatch/k3            mean of e^d - d - 1     the same KL, k3 estimator (>= 0, low variance)
    mismatch/ess           (sum w)^2 / (N sum w^2) with w = e^d: normalised effective sample size
                           of the token IS weights, in (0, 1]; 1 means on-policy
    mismatch/k1_lag{l}, mismatch/k3_lag{l}, mismatch/token_frac_lag{l}
                           the same KLs over tokens sampled l versions ago (l = 0 .. max_lag; the
                           last one also holds any larger lag), and their share of the tokens
    mismatch/ess_lag0, mismatch/bounded_frac_lag0, mismatch/rejected_frac_lag0
                           on lag-0 tokens alone: sampled by the very weights being trained, so
                           what is left is the engine / learner numeric mismatch (bf16 engine vs
                           fp32 learner, kernels), the floor no staleness setting can go under

The learner combines micro-batches and ranks with a `_tokens`-weighted mean,
which is exact only for means over all tokens. So `mismatch_metrics` returns
such means (raw keys under `_mm/`: sums over a subset divided by all the
call's tokens) and `finalize_mismatch` turns the combined values into the
ratios above, once per optimizer step.

Sources: verl 0.9.1 `verl/trainer/ppo/rollout_corr_helper.py`
(`compute_offpolicy_metrics`: kl = mean(rollout - training), k3_kl;
`compute_is_metrics`: rollout_is_eff_sample_size = 1 / mean((w / mean w)^2)).
The split by token lag is this project's: only per-token versions make it possible.
"""

from __future__ import annotations

import torch

from async_april.algorithms.ratios import MAX_LOG_RATIO

RAW = "_mm/"


def mismatch_metrics(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    token_lags: torch.Tensor,
    max_lag: int,
    bounded: torch.Tensor | None = None,
    rejected: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Means over this call's real tokens (see the module docstring); detached 0-d tensors.

    logprobs, behavior_logprobs: [B, T]; mask: bool [B, T]; token_lags: [B, T] integer lags
    (policy version - token version); bounded, rejected: bool [B, T] from the loss, or None.
    """
    with torch.no_grad():
        m = mask.bool()
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        d = torch.where(m, logprobs.detach().to(dtype) - behavior_logprobs.detach().to(dtype), torch.zeros((), dtype=dtype))
        d = d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        w = torch.exp(d)
        k1, k3 = -d, w - d - 1.0
        n = m.sum().clamp(min=1).to(dtype)
        share = lambda x, sel: torch.where(sel, x, torch.zeros((), dtype=dtype)).sum() / n  # noqa: E731
        lag = token_lags.to(torch.int64).clamp(0, max_lag)
        out = {"mismatch/k1": share(k1, m), "mismatch/k3": share(k3, m), f"{RAW}w": share(w, m), f"{RAW}w2": share(w * w, m)}
        for l in range(max_lag + 1):
            sel = m & (lag == l)
            out[f"{RAW}frac_lag{l}"] = share(torch.ones_like(d), sel)
            out[f"{RAW}k1_lag{l}"] = share(k1, sel)
            out[f"{RAW}k3_lag{l}"] = share(k3, sel)
        fresh = m & (lag == 0)
        out[f"{RAW}w_lag0"] = share(w, fresh)
        out[f"{RAW}w2_lag0"] = share(w * w, fresh)
        if bounded is not None:
            out[f"{RAW}bounded_lag0"] = share(bounded.to(dtype), fresh)
        if rejected is not None:
            out[f"{RAW}rejected_lag0"] = share(rejected.to(dtype), fresh)
    return out


def finalize_mismatch(merged: dict[str, float]) -> dict[str, float]:
    """`merged` with the raw `_mm/` means replaced by the final mismatch metrics. A lag with no
    tokens gets no KL keys (only token_frac 0); no lag-0 tokens, no lag-0 keys."""
    raw = {k[len(RAW):]: v for k, v in merged.items() if k.startswith(RAW)}
    out = {k: v for k, v in merged.items() if not k.startswith(RAW)}
    if not raw:
        return out
    out["mismatch/ess"] = raw["w"] ** 2 / raw["w2"] if raw["w2"] > 0 else 0.0
    lags = sorted(int(k.removeprefix("frac_lag")) for k in raw if k.startswith("frac_lag"))
    for l in lags:
        frac = raw[f"frac_lag{l}"]
        out[f"mismatch/token_frac_lag{l}"] = frac
        if frac > 0:
            out[f"mismatch/k1_lag{l}"] = raw[f"k1_lag{l}"] / frac
            out[f"mismatch/k3_lag{l}"] = raw[f"k3_lag{l}"] / frac
    f0 = raw.get("frac_lag0", 0.0)
    if f0 > 0:
        out["mismatch/ess_lag0"] = raw["w_lag0"] ** 2 / (raw["w2_lag0"] * f0) if raw["w2_lag0"] > 0 else 0.0
        for name in ("bounded", "rejected"):
            if f"{name}_lag0" in raw:
                out[f"mismatch/{name}_frac_lag0"] = raw[f"{name}_lag0"] / f0
    return out


__all__ = ["mismatch_metrics", "finalize_mismatch"]
