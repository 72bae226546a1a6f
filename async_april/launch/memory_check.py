"""`async-april check`'s memory plan: the config and the resolved model into async_april/planning/memory.py's
inputs, the per-rank table printed, and a recipe that cannot fit refused (docs/learner.md, Memory plan)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from async_april.config import Config
from async_april.errors import UserError
from async_april.planning.memory import (
    LogitsPath,
    ModelDims,
    Plan,
    PlanInputs,
    plan,
    refusal,
)

__all__ = ["MemoryPlanError", "check_memory", "learner_on_gpu", "model_dims", "plan", "plan_inputs", "show_and_check_memory"]


class MemoryPlanError(UserError, ValueError):
    """The learner's plan does not fit the GPU it is planned against."""


def learner_on_gpu(cfg: Config) -> bool:
    """Where the learner will train: cuda, or auto on a cluster whose engines take GPUs."""
    return cfg.learner.device == "cuda" or (cfg.learner.device == "auto" and cfg.rollout.gpus_per_actor > 0)


def engines_on_learner_gpu(cfg: Config) -> int:
    """SGLang engines Ray packs onto a learner rank's GPU: the GPU share the rank leaves, in engine shares."""
    r, lc = cfg.rollout, cfg.learner
    if r.engine != "sglang" or lc.gpus_per_rank >= 1 or r.gpus_per_actor >= 1:
        return 0
    return min(r.num_actors, max(1, math.floor((1 - lc.gpus_per_rank) / r.gpus_per_actor + 1e-9)))


def gpu_memory_gb(cfg: Config) -> float | None:
    """learner.gpu_memory_gb, else the memory of the GPU torch.cuda sees here (None without one)."""
    if cfg.learner.gpu_memory_gb is not None:
        return cfg.learner.gpu_memory_gb
    try:
        import torch
    except ImportError:
        return None
    if not (learner_on_gpu(cfg) and torch.cuda.is_available()):
        return None
    return torch.cuda.get_device_properties(0).total_memory / 1e9


def plan_inputs(cfg: Config, logits_path: LogitsPath = "chunked") -> PlanInputs:
    lc, r = cfg.learner, cfg.rollout
    engines = engines_on_learner_gpu(cfg)
    return PlanInputs(world_size=lc.world_size, microbatch_tokens=lc.max_tokens_per_microbatch,
                      longest_row=cfg.data.max_prompt_len + r.max_new_tokens, activation_checkpointing=lc.activation_checkpointing,
                      offload_optimizer=lc.offload_optimizer, logits_path=logits_path, on_gpu=learner_on_gpu(cfg),
                      gpu_memory_gb=gpu_memory_gb(cfg), sglang_share=r.sglang.mem_fraction_static if engines else None,
                      sglang_engines=engines)


def model_dims(model_path: str | Path, counts: dict) -> ModelDims:
    """The plan's model numbers: config.json plus learners/lora.py parameter_counts (`total`, `trainable`)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return ModelDims.from_hf_config(config, counts["total"], counts["trainable"])


def check_memory(cfg: Config, dims: ModelDims) -> Plan:
    """The plan of `cfg`'s learner ranks; MemoryPlanError (naming the keys to change) when it cannot fit."""
    inputs = plan_inputs(cfg)
    message = refusal(dims, inputs)
    if message is not None:
        raise MemoryPlanError(message)
    return plan(dims, inputs)


def show_and_check_memory(cfg: Config, model_path: str | Path) -> Plan:
    """`check`'s memory step: the parameter counts and the per-rank table printed, then `check_memory`'s refusal."""
    from async_april.run.console import say
    from learners.lora import describe_counts, parameter_counts

    counts = parameter_counts(model_path, cfg.learner.lora)
    say(describe_counts(counts, gpu_bf16=learner_on_gpu(cfg)))
    dims = model_dims(model_path, counts)
    for line in plan(dims, plan_inputs(cfg)).table():
        say(line)
    return check_memory(cfg, dims)  # refuses a learner that cannot fit, naming the keys to change
