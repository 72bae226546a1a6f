"""Training: the algorithm (advantages, loss, correction), the FSDP2 learner, weight sync."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from async_april.config.base import Section


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """Advantage estimator over each group's rewards."""
    adv_eps: float = Field(1e-6, gt=0.0)
    """Added to the group std in GRPO normalisation."""
    loss: Literal["ppo", "gspo"] = "ppo"
    """Policy loss: token-level PPO-clip or GSPO's sequence-level ratio."""
    correction: Literal["direct", "decoupled", "none"] = "direct"
    """direct (CoPRIS): ratio to the behaviour policy. decoupled (AReaL): ratio to the proximal policy times a bounded weight. none: ignore the behaviour policy (ablations only; biased off-policy)."""
    weight_bound: Literal["truncate", "mask", "none"] = "truncate"
    """How the decoupled IS weight is bounded: truncate at `weight_cap`, mask outside [`mask_low`, `mask_high`], or not at all."""
    weight_level: Literal["token", "sequence"] = "token"
    """Bound the IS weight per token or per sequence (geometric mean)."""
    weight_cap: float = Field(2.0, ge=1.0)
    """Truncation cap C for the IS weight."""
    mask_low: float = Field(0.5, gt=0.0, le=1.0)
    """Mask: lowest IS weight kept."""
    mask_high: float = Field(2.0, ge=1.0)
    """Mask: highest IS weight kept."""
    clip_low: float = Field(0.2, ge=0.0, le=1.0)
    """PPO clip epsilon below 1."""
    clip_high: float = Field(0.28, ge=0.0, le=10.0)
    """PPO clip epsilon above 1 (DAPO clip-higher)."""
    dual_clip: float | None = Field(3.0, gt=1.0)
    """Dual clip c bounding the loss of negative-advantage tokens; None turns it off."""
    gspo_clip_low: float = Field(3e-4, ge=0.0, le=1.0)
    """GSPO sequence-ratio clip below 1."""
    gspo_clip_high: float = Field(4e-4, ge=0.0, le=1.0)
    """GSPO sequence-ratio clip above 1."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    """Loss aggregation: over all tokens, over sequences of token-means, or Dr.GRPO's constant normaliser."""
    constant_normalizer: float | None = Field(None, gt=0.0)
    """Dr.GRPO normaliser; None uses `rollout.max_new_tokens` times the number of sequences."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Coefficient of the k3 KL penalty to the reference (initial) policy; 0 turns it off."""

    @model_validator(mode="after")
    def _check_mask(self) -> "AlgorithmConfig":
        if self.mask_low >= self.mask_high:
            raise ValueError(f"mask_low ({self.mask_low}) must be below mask_high ({self.mask_high})")
        return self


class LearnerConfig(Section):
    world_size: int = Field(1, ge=1, le=4096)
    """Learner ranks (one Ray actor each; FSDP2 across them)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Learner device; auto picks cuda when available."""
    gpus_per_rank: float = Field(1.0, gt=0.0, le=1.0)
    """GPU share Ray reserves per learner rank on GPU clusters; below 1 to colocate with engines on one GPU."""
    lr: float = Field(1e-4, gt=0.0, le=1.0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or decaying linearly or along a half cosine to `lr * min_lr_ratio` at `run.steps` (transformers' `constant_with_warmup` and `warmup_stable_decay` schedules; learners/optim.py)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up to `lr` over this many learner steps (rollout batches, as `run.steps` counts them, not optimizer steps: every mini-batch of a step trains at that step's lr, and a skipped step does not advance the schedule), as transformers does it: from 0 with the constant schedule (the first step then has lr 0), from `lr * min_lr_ratio` with linear / cosine."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """linear / cosine: the learning rate at the last step, as a fraction of `lr`."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value."""
    max_tokens_per_microbatch: int = Field(8192, ge=16)
    """Token budget per micro-batch; gradients accumulate across micro-batches."""
    mini_batches: int = Field(1, ge=1, le=4096)
    """Optimizer steps per rollout batch (PPO mini-batches): the batch's rows are split into this many
    consecutive parts, each normalised on its own. With decoupled correction and more than one, the
    proximal policy is a no-grad forward of the pre-update weights (docs/learner.md)."""
    max_bad_steps: int = Field(3, ge=1)
    """Consecutive learner steps (rollout batches, whatever `mini_batches` is) with a NaN/inf loss or gradient in every optimizer step (each skipped) before the run stops."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    compile: bool = False
    """torch.compile each decoder layer."""


class WeightSyncConfig(Section):
    transport: Literal["object_store", "nccl", "disk"] = "object_store"
    """How new weights reach the engines: Ray object store (CPU default), NCCL broadcast (GPU), or files."""
    bucket_mb: float = Field(256.0, gt=0.0)
    """Largest weight bucket in MB; tensors are grouped by dtype into buckets of at most this size."""
    disk_dir: str | None = None
    """Directory for the disk transport, visible to learner rank 0 and every engine; None uses `run.dir/weights`."""
