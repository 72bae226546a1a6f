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
