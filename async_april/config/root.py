"""`Config`: every section together, and the checks that span sections."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, model_validator

from async_april.config.base import Section
from async_april.config.inputs import DataConfig, EvalConfig, ModelConfig, RewardConfig
from async_april.config.learner import AlgorithmConfig, LearnerConfig, WeightSyncConfig
from async_april.config.placement import PlacementConfig
from async_april.config.rollout import AsyncConfig, RolloutConfig
from async_april.config.run import CheckpointConfig, LoggingConfig, RunConfig


class Config(Section):
    """The whole run configuration."""

    run: RunConfig = Field(default_factory=RunConfig)
    """Run-level settings."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompt data."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward function."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation actors and engines."""
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    """Staleness limits."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantages and policy loss."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """The FSDP2 learner."""
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """Weight broadcast to the engines."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Learner and rollout-store checkpoints."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation during training (docs/evaluation.md)."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Metrics and progress output."""
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    """Where the learner, store, generation and evaluation actors go on a multi-node cluster (docs/cluster.md)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, populate_by_name=True)

    @model_validator(mode="after")
    def _check_combinations(self) -> "Config":
        r = self.rollout
        if (r.top_p < 1.0 or r.top_k > 0) and self.algorithm.weight_bound != "none":
            # Engines report log_softmax(logits / T) before top-k/top-p, as SGLang does, so the
            # recorded behaviour logprob is not that of the truncated distribution actually
            # sampled from and the importance weight would be biased.
            raise ValueError(
                "rollout.top_p < 1 or rollout.top_k > 0 makes the recorded behaviour logprobs differ "
                "from the sampled distribution, which biases importance correction; set top_p=1 and "
                "top_k=-1, or set algorithm.weight_bound=none to accept the bias"
            )
        if self.run.overwrite and self.run.resume is not None:
            raise ValueError("run.overwrite=true starts from scratch and run.resume continues a run; set only one of them")
        rows = r.batch_groups * r.n_samples
        if self.learner.mini_batches > rows:
            raise ValueError(
                f"learner.mini_batches={self.learner.mini_batches} is more than the {rows} responses of a batch "
                f"(rollout.batch_groups x rollout.n_samples); set learner.mini_batches <= {rows}"
            )
        if self.learner.lora.enabled and self.learner.lora.sync == "adapter" and r.engine == "sglang":
            # SGLang's weight routes take full tensors; its own LoRA serving is not used (docs/learner.md, LoRA).
            raise ValueError("learner.lora.sync=adapter needs rollout.engine=torch (it merges adapters itself); "
                             "SGLang gets merged weights: set learner.lora.sync=merged or auto")
        if self.weight_sync.transport == "nccl" and self.learner.device == "cpu" and r.engine != "sglang":
            # Only SGLang servers join a broadcast group (/init_weights_update_group); from CPU ranks it runs over gloo.
            raise ValueError(f"weight_sync.transport=nccl needs rollout.engine=sglang (the {r.engine} engine cannot join "
                             "the broadcast group); use object_store or disk")
        if self.model.parity:
            if r.engine == "simulated":
                raise ValueError("model.parity needs rollout.engine=torch (or sglang): the simulated engine computes no "
                                 "logprobs to match; set model.parity=false")
            if r.engine == "sglang" and not r.sglang.deterministic:
                # --rl-on-policy-target turns deterministic inference on anyway (sglang 0.5.23
                # srt/arg_groups/attention_hook.py handle_deterministic_inference): say so rather than override.
                raise ValueError("model.parity launches SGLang with --rl-on-policy-target fsdp, which turns its "
                                 "deterministic inference on; set rollout.sglang.deterministic=true (or model.parity=false)")
            if self.learner.compile:
                # Inductor fuses and reorders the kernels' reductions: the learner's values would leave the engine's.
                raise ValueError("model.parity runs the learner's forward through its own batch-invariant kernels, which "
                                 "torch.compile would fuse and reorder; set learner.compile=false (or model.parity=false)")
        return self

    @property
    def initial_over_provision(self) -> float:
        """`rollout.over_provision` at the start of a run: the fixed value, or `async.auto.over_provision_min`."""
        op = self.rollout.over_provision
        return self.async_.auto.over_provision_min if op == "auto" else float(op)

    @property
    def run_dir(self) -> Path:
        return Path(os.path.expanduser(self.run.dir.replace("${name}", self.run.name)))

    def to_yaml_dict(self) -> dict[str, Any]:
        """The resolved config as plain data, with `async` under its YAML name."""
        return self.model_dump(mode="json", by_alias=True)
