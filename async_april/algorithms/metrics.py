"""Per-step figures about the data rather than the loss: how far each token lags the learner."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


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


HISTOGRAM_SUFFIX = "_hist"
"""Keys ending so hold counts per integer lag (index = lag): the tracker logs them to W&B as histograms."""


def trajectory_staleness(versions: Sequence[np.ndarray], policy_version: int) -> dict[str, float | list[int]]:
    """Per trajectory (a row of `TrainBatch.model_versions()`: the model's tokens only), how many policy
    versions sampled it and how far its oldest token lags; then the step's figures over trajectories.

        rollout/versions_spanned_mean, _max   distinct versions among a trajectory's tokens (1: one policy
                                              sampled all of it; more: resumed or continued across updates)
        rollout/multi_version_frac            share of trajectories sampled by more than one version
        staleness/oldest_lag_mean             mean over trajectories of its oldest token's lag (the worst
                                              case of the step, the max of the same, is `staleness/max`)
        staleness/token_lag_hist              tokens at lag 0, 1, .. max (a W&B histogram per step)
        staleness/oldest_lag_hist             trajectories whose oldest token lags 0, 1, .. max

    Trajectories without model tokens are left out; none at all gives zeros and empty histograms.
    The per-lag mismatch (mismatch/k1_lag{l}, k3_lag{l}) is the learner's (algorithms/mismatch.py).
    """
    rows = [np.asarray(v, np.int64).reshape(-1) for v in versions]
    rows = [v for v in rows if v.size]
    if not rows:
        return {"rollout/versions_spanned_mean": 0.0, "rollout/versions_spanned_max": 0, "rollout/multi_version_frac": 0.0,
                "staleness/oldest_lag_mean": 0.0, f"staleness/token_lag{HISTOGRAM_SUFFIX}": [],
                f"staleness/oldest_lag{HISTOGRAM_SUFFIX}": []}
    spanned = np.array([len(np.unique(v)) for v in rows])
    # No token is newer than the policy it trains at; clipped all the same, since a histogram cannot count -1.
    oldest = np.maximum(np.array([policy_version - int(v.min()) for v in rows]), 0)
    token_lags = np.maximum(policy_version - np.concatenate(rows), 0)
    return {
        "rollout/versions_spanned_mean": float(spanned.mean()),
        "rollout/versions_spanned_max": int(spanned.max()),
        "rollout/multi_version_frac": float((spanned > 1).mean()),
        "staleness/oldest_lag_mean": float(oldest.mean()),
        f"staleness/token_lag{HISTOGRAM_SUFFIX}": np.bincount(token_lags).tolist(),
        f"staleness/oldest_lag{HISTOGRAM_SUFFIX}": np.bincount(oldest).tolist(),
    }
