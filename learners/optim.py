"""Optimizer-side helpers of a learner rank: the learning-rate schedule and the GPU's peak FLOP/s (for MFU)."""

from __future__ import annotations

import torch

PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
}
"""Dense bf16 peak TFLOP/s by a substring of `torch.cuda.get_device_name()` (first match wins)."""


def peak_flops(device_name: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key.lower() in device_name.lower():
            return tflops * 1e12
    return None


def make_lr_scheduler(optimizer: torch.optim.Optimizer, lc, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """`learner.lr_schedule` from transformers' schedules (LambdaLRs, checkpointed with the optimizer):
    constant -> `constant_with_warmup`; linear / cosine -> `warmup_stable_decay` with no stable phase,
    decaying from `lr` after the warm-up to `lr * min_lr_ratio` at `total_steps` (run.steps; a resume to a
    larger run.steps stretches the decay from where it is). Schedule positions count learner steps (rollout
    batches, the unit of run.steps and learner.warmup_steps), not optimizer steps: the worker steps it once
    per batch whatever learner.mini_batches is, and not for a skipped batch (verl and AReaL step theirs
    once per training step too; TRL's Trainer counts optimizer steps)."""
    from transformers import get_scheduler

    if lc.lr_schedule == "constant":
        return get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=lc.warmup_steps)
    decay = max(1, total_steps - lc.warmup_steps)
    return get_scheduler("warmup_stable_decay", optimizer, num_warmup_steps=lc.warmup_steps, scheduler_specific_kwargs={
        "num_stable_steps": 0, "num_decay_steps": decay, "decay_type": lc.lr_schedule, "min_lr_ratio": lc.min_lr_ratio})
