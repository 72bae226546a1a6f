"""Group-relative advantage estimators (GRPO, Dr.GRPO, RLOO) and DAPO's zero-variance filter.

Pure functions on a `[groups, n]` reward matrix: row g holds the rewards of the
n responses to prompt g. They run before the learner (which is
algorithm-blind) on the controller, so every function accepts either a torch
tensor or a numpy array and returns the same kind it was given.

    grpo:   A_gi = (R_gi - mean_g) / (std_g + eps)      std with unbiased=False (divide by n)
    drgrpo: A_gi =  R_gi - mean_g                       no std scaling (Dr.GRPO)
    rloo:   A_gi =  R_gi - mean_{j != i} R_gj = n / (n - 1) * (R_gi - mean_g);  n = 1 gives 0
"""

from __future__ import annotations

from typing import Callable, TypeVar

import numpy as np
import torch

ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)

ESTIMATORS = ("grpo", "drgrpo", "rloo")


def _as_tensor(rewards: torch.Tensor | np.ndarray) -> torch.Tensor:
    """[groups, n] rewards as a floating tensor (numpy non-float input becomes float64)."""
    if isinstance(rewards, np.ndarray):
        if not np.issubdtype(rewards.dtype, np.floating):
            rewards = rewards.astype(np.float64)
        t = torch.from_numpy(np.ascontiguousarray(rewards))
    elif isinstance(rewards, torch.Tensor):
        t = rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())
    else:
        raise TypeError(f"rewards must be a torch.Tensor or numpy.ndarray, got {type(rewards).__name__}")
    if t.dim() != 2:
        raise ValueError(f"rewards must have shape [groups, n], got shape {tuple(t.shape)}")
    return t


def _same_kind(fn: Callable[[torch.Tensor], torch.Tensor], rewards: ArrayT) -> ArrayT:
    """Apply a tensor function and hand back numpy if numpy came in."""
    out = fn(_as_tensor(rewards))
    return out.numpy() if isinstance(rewards, np.ndarray) else out


def _centred(r: torch.Tensor) -> torch.Tensor:
    """R - group mean, exactly 0 in a group whose rewards are all equal.

    In floating point the mean of n equal values is not always that value (8 x 0.6 in float32 is
    off by one ulp), so R - mean is a tiny delta of one sign for the whole group; GRPO then divides
    it by a std of about |delta| and hands every response the same advantage of up to ~0.1. A
    group with nothing to compare carries no signal: its deviations are zeroed, not rounded."""
    equal = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(equal, torch.zeros_like(r), r - r.mean(dim=1, keepdim=True))


def _grpo(r: torch.Tensor, eps: float) -> torch.Tensor:
    d = _centred(r)
    std = d.square().mean(dim=1, keepdim=True).sqrt()  # = r.std(unbiased=False), and exactly 0 for an equal group
    return d / (std + eps)


def _drgrpo(r: torch.Tensor) -> torch.Tensor:
    return _centred(r)


def _rloo(r: torch.Tensor) -> torch.Tensor:
    n = r.shape[1]
    if n < 2:
        return torch.zeros_like(r)
    return _centred(r) * (n / (n - 1))  # R_i - mean of the others = n / (n - 1) * (R_i - mean)


def grpo_advantages(rewards: ArrayT, eps: float = 1e-6) -> ArrayT:
    """GRPO: `(R - group mean) / (group std + eps)`, std with unbiased=False (divides by n).

    rewards: [groups, n]. Returns [groups, n]. A group whose rewards are all
    equal gets exactly zero advantages, in any float dtype (see `_centred`).
    """
    return _same_kind(lambda r: _grpo(r, eps), rewards)


def drgrpo_advantages(rewards: ArrayT) -> ArrayT:
    """Dr.GRPO: `R - group mean`, no std division. rewards: [groups, n] -> [groups, n]."""
    return _same_kind(_drgrpo, rewards)


def rloo_advantages(rewards: ArrayT) -> ArrayT:
    """RLOO: `R_i - mean of the other n - 1 rewards`; n = 1 gives zeros. [groups, n] -> [groups, n]."""
    return _same_kind(_rloo, rewards)


def compute_advantages(rewards: ArrayT, estimator: str, eps: float = 1e-6) -> ArrayT:
    """Dispatch on `algorithm.advantage` ("grpo" | "drgrpo" | "rloo"); `eps` is `algorithm.adv_eps` (GRPO only).

    rewards: [groups, n] tensor or numpy array; returns the same kind and shape.
    """
    if estimator == "grpo":
        return grpo_advantages(rewards, eps)
    if estimator == "drgrpo":
        return drgrpo_advantages(rewards)
    if estimator == "rloo":
        return rloo_advantages(rewards)
    raise ValueError(f"unknown advantage estimator {estimator!r}; set algorithm.advantage to one of {ESTIMATORS}")


def zero_variance_groups(rewards: ArrayT, atol: float = 1e-6) -> ArrayT:
    """DAPO dynamic sampling: True for each group whose rewards all lie within `atol` of each other.

    rewards: [groups, n]. Returns a bool [groups] (tensor or numpy, as given).
    Such groups have zero advantage under every estimator and teach nothing.
    """
    return _same_kind(lambda r: (r.amax(dim=1) - r.amin(dim=1)) <= atol, rewards)
