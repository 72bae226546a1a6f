"""Training: the algorithm (advantages, loss, correction), the FSDP2 learner, weight sync."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from async_april.config.base import Section

Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
"""An Adam moment decay rate."""


class RejectionConfig(Section):
    divergence: Literal["none", "k1", "k2", "k3"] = "none"
    """Reject tokens whose divergence between the behaviour policy and `against` leaves [`low`, `high`]: k1 = log pi_behav - log pi_target (signed), k2 = (log ratio)^2 / 2, k3 = r - 1 - log r with r = pi_target / pi_behav; none turns rejection off."""
    level: Literal["token", "sequence_sum", "sequence_mean", "sequence_max"] = "token"
    """Judge each token by its own divergence, or whole sequences by the sum, mean or max over their tokens (a rejected sequence loses every token)."""
    low: float | None = None
    """Lowest divergence kept (None: no lower bound); useful for the signed k1."""
    high: float | None = Field(None, ge=0.0)
    """Highest divergence kept (None: no upper bound)."""
    against: Literal["proximal", "current"] = "proximal"
    """Target policy: the learner's pre-update (proximal) policy, or the current one at each micro-batch (TRL's off-policy mask)."""
    negative_advantages_only: bool = False
    """Reject only tokens with a negative advantage; positive ones always stay (TRL / DeepSeek-V3.2 off-policy sequence mask)."""
    keep_in_normalizer: bool = True
    """A rejected token gets zero loss but still counts in the loss normaliser (slime), or leaves it (verl; then the learner counts the kept tokens of the batch before the step, which needs against=proximal)."""

    @model_validator(mode="after")
    def _check(self) -> "RejectionConfig":
        # The same checks as algorithms/rejection.py RejectionSettings (this module imports no torch).
        if self.divergence == "none":
            return self
        if self.low is None and self.high is None:
            raise ValueError(f"algorithm.rejection.divergence={self.divergence} rejects nothing without a bound; "
                             "set algorithm.rejection.high (and/or low)")
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"algorithm.rejection.low ({self.low}) must not exceed algorithm.rejection.high ({self.high})")
        if not self.keep_in_normalizer and self.against == "current":
            raise ValueError(
                "algorithm.rejection.keep_in_normalizer=false needs algorithm.rejection.against=proximal: the learner "
                "counts the kept tokens of the whole batch before the step, and the current policy moves during it")
        return self


class AlgorithmConfig(Section):
    advantage: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """Advantage estimator over each group's rewards."""
    adv_eps: float = Field(1e-6, gt=0.0)
    """Added to the group std in GRPO normalisation."""
    loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """Policy loss: token-level PPO-clip, GSPO's sequence-level ratio, or CISPO (MiniMax-M1: the clipped ratio as a detached weight on log pi_theta; every token keeps its gradient)."""
    correction: Literal["direct", "decoupled", "none"] = "direct"
    """direct (CoPRIS): ratio to the behaviour policy. decoupled (AReaL): ratio to the proximal policy times a bounded weight. none: ignore the behaviour policy (ablations only; biased off-policy)."""
    weight_bound: Literal["truncate", "mask", "none"] = "truncate"
    """How the decoupled IS weight is bounded: truncate at `weight_cap`, mask outside [`mask_low`, `mask_high`], or not at all."""
    weight_level: Literal["token", "sequence", "sequence_product"] = "token"
    """The decoupled IS weight per token, per sequence as the geometric mean of its token weights, or per sequence as their product (the true sequence weight, computed in log space, clamped at e^20, then bounded)."""
    weight_cap: float = Field(2.0, ge=1.0)
    """Truncation cap C for the IS weight."""
    weight_floor: float = Field(0.0, ge=0.0, le=1.0)
    """Truncation: the lowest IS weight used (weights below are raised to it; slime's tis_clip_low). 0: no lower clamp."""
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
    cispo_weight_min: float | None = Field(None, ge=0.0, le=1.0)
    """CISPO: lowest value of the clipped ratio; None: no lower bound (MiniMax-M1, TRL)."""
    cispo_weight_max: float = Field(5.0, ge=1.0, le=100.0)
    """CISPO: highest value of the clipped ratio (TRL's epsilon_high for cispo; 5.0 is the ScaleRL recommendation)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "constant"] = "token_mean"
    """Loss aggregation: over all tokens, over sequences of token-means, or Dr.GRPO's constant normaliser."""
    constant_normalizer: float | None = Field(None, gt=0.0)
    """Dr.GRPO normaliser; None uses `rollout.max_new_tokens` times the number of sequences."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Coefficient of the k3 KL penalty to the reference (initial) policy; 0 turns it off."""
    rejection: RejectionConfig = Field(default_factory=RejectionConfig)
    """Rejection sampling of tokens or sequences by divergence (verl rollout_rs, TRL off-policy mask); off by default."""

    @model_validator(mode="after")
    def _check_mask(self) -> "AlgorithmConfig":
        if self.mask_low >= self.mask_high:
            raise ValueError(f"mask_low ({self.mask_low}) must be below mask_high ({self.mask_high})")
        return self


LORA_TARGETS_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama/Qwen-style decoder block (attention and MLP), peft's usual names."""


class LoraConfig(Section):
    enabled: bool = False
    """Train LoRA adapters (peft) on a frozen base instead of every weight (docs/learner.md, LoRA). The switch: any other `learner.lora` key set without `enabled: true` is refused (it would be ignored); `enabled: false` turns a LoRA config off."""
    rank: int = Field(16, ge=1, le=4096)
    """Adapter rank r: each target `W` (out x in) gains `B @ A` with A r x in, B out x r."""
    alpha: float = Field(32.0, gt=0.0)
    """LoRA alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input, in the gradient only: every logprob value (the loss's ratios, proximal, reference, entropy) comes from a forward without dropout, the policy the engines sample (they run merged weights); costs one more no-grad forward per micro-batch (learners/dropout.py)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS_ALL_LINEAR), min_length=1)
    """Module names (suffixes, as peft matches them) that get adapters; the default is every linear layer of a decoder block."""
    sync: Literal["auto", "adapter", "merged"] = "auto"
    """What goes to the engines each version: the adapter factors (the torch engine merges them into its kept base weights), or merged full weights through the usual routes (SGLang). auto: adapter for the torch engine, merged otherwise (docs/learner.md has the measurement)."""

    @model_validator(mode="after")
    def _check_switch(self) -> "LoraConfig":
        # A LoRA key set without the switch would train every weight and ignore the key. verl switches LoRA
        # on by `lora_rank > 0` (verl/workers/config/model.py, HFModelConfig: default 0), but `rank` has a
        # default here, so the half-set section is refused instead; an explicit `enabled: false` (a LoRA
        # config switched off by an override) is a knowing choice.
        # model_fields_set: the keys the user's YAML / overrides gave (pydantic), not the defaults.
        if self.enabled or "enabled" in self.model_fields_set:
            return self
        given = sorted(self.model_fields_set)
        if given:
            keys = ", ".join(f"learner.lora.{k}" for k in given)
            verb = "is" if len(given) == 1 else "are"
            raise ValueError(f"{keys} {verb} set without learner.lora.enabled=true: LoRA is off by default, so every "
                             f"weight would train and {keys} would be ignored; set learner.lora.enabled=true, or remove {keys}")
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
    betas: tuple[Beta, Beta] = (0.9, 0.99)
    """AdamW betas, each in [0, 1) (torch.optim.AdamW refuses others, inside the learner actor)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning rate after warm-up: constant, or decaying linearly or along a half cosine to `lr * min_lr_ratio` at `run.steps` (transformers' `constant_with_warmup` and `warmup_stable_decay` schedules; learners/optim.py)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up to `lr` over this many learner steps (rollout batches, as `run.steps` counts them, not optimizer steps: every mini-batch of a step trains at that step's lr, and a skipped step does not advance the schedule), as transformers does it: from 0 with the constant schedule (the first step then has lr 0), from `lr * min_lr_ratio` with linear / cosine."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """linear / cosine: the learning rate at the last step, as a fraction of `lr`."""
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value."""
    max_tokens_per_microbatch: int = Field(8192, ge=16)
    """Token budget per micro-batch; gradients accumulate across micro-batches. Packed: the rows' summed
    lengths; padded: rows x the longest row. A row longer than the budget trains alone."""
    packing: bool = True
    """Pack each micro-batch: rows concatenated without padding, position ids restarting per row, attention
    kept within each row (flash_attention_2's varlen kernel; a block-diagonal causal mask on sdpa/eager).
    On a long-tailed batch most of a padded micro-batch is padding; packed, compute goes to real tokens
    only, with the same logprobs, loss and gradients. False keeps the right-padded micro-batches (for
    comparison, or a model whose attention ignores position ids)."""
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
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (off by default)."""
    sequence_parallel: int = Field(1, ge=1, le=4096)
    """Ulysses sequence parallelism: each row's positions are split over this many ranks, which all-to-all over attention heads (docs/learner.md, Sequence parallelism). Must divide `world_size` and the model's attention and KV heads; the ranks form world_size / sequence_parallel data-parallel groups, FSDP2 shards over all ranks."""
    # -- memory plan (docs/learner.md, Memory plan): keep these two together
    gpu_memory_gb: float | None = Field(None, gt=0.0)
    """GPU memory (GB) `async-april check` plans each learner rank against (async_april/planning/memory.py); None: the GPU torch.cuda sees where check runs, and no refusal where it sees none."""
    offload_optimizer: bool = False
    """Keep the fp32 master weights, gradients and AdamW state in host memory and run the optimizer step on the CPU (FSDP2 `CPUOffloadPolicy`): the GPU holds only the gathered bf16 weights and activations. For a 1-GPU recipe that shares its GPU with SGLang; each step copies the weights in and the gradients out."""

    @model_validator(mode="after")
    def _check_decay(self) -> "LearnerConfig":
        if self.lr * self.weight_decay >= 1.0:
            # AdamW decays decoupled: p <- p * (1 - lr * weight_decay); at >= 1 every step zeroes or flips the weights.
            raise ValueError(f"learner.lr x learner.weight_decay = {self.lr * self.weight_decay:g} must be below 1 "
                             "(AdamW multiplies the weights by 1 - lr x weight_decay each step); lower one of them")
        return self

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> LearnerConfig:
        if self.world_size % self.sequence_parallel:
            # The same check as learners/sequence_parallel.py (this module imports no torch).
            raise ValueError(f"learner.sequence_parallel={self.sequence_parallel} must divide learner.world_size="
                             f"{self.world_size} (the ranks form world_size / sequence_parallel data-parallel groups); "
                             f"set learner.world_size to a multiple of {self.sequence_parallel}")
        return self


class WeightSyncConfig(Section):
    transport: Literal["object_store", "nccl", "disk"] = "object_store"
    """How new weights reach the engines: Ray object store (CPU default), a broadcast group from learner rank 0 to every SGLang engine (`nccl`: NCCL from GPU ranks, gloo from CPU ranks; re-formed whenever the set of engines changes), or files."""
    bucket_mb: float = Field(256.0, gt=0.0)
    """Largest weight bucket in MB; tensors are grouped by dtype into buckets of at most this size."""
    group_timeout_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """`transport: nccl`: how long forming the broadcast group (every engine joining) and each broadcast may wait for a member before failing; torch's NCCL default. A member that died is left out before a push, so this bounds only a member lost during one."""
    disk_dir: str | None = None
    """Directory for the disk transport, visible to learner rank 0 and every engine; None uses `run.dir/weights`. Only with `transport: disk`."""

    @model_validator(mode="after")
    def _check_disk_dir(self) -> "WeightSyncConfig":
        if self.disk_dir is not None and self.transport != "disk":
            raise ValueError(f"weight_sync.disk_dir is only used by weight_sync.transport=disk (this config has "
                             f"{self.transport}); set weight_sync.transport=disk or remove weight_sync.disk_dir")
        return self
