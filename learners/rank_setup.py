"""What a learner rank sets up before its model exists: its device, its process group, its seeds,
and the Hugging Face model it loads (attention implementation and logprob head chosen here).

Functions in the order `LearnerWorker.__init__` calls them; each says why its step is where it is.
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from learners import packed_attention
from learners.chunked_logprobs import install_logprob_head
from learners.host_allocator import return_freed_blocks_to_os
from learners.parallelize import resolve_attn_implementation

if TYPE_CHECKING:
    from async_april.config import Config, LearnerConfig


def pick_device(lc: "LearnerConfig") -> torch.device:
    """learner.device, or CUDA when `auto` sees one. On CPU: OMP_NUM_THREADS threads, and freed
    activations leave the RSS (learners/host_allocator.py)."""
    want = lc.device if lc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("learner.device=cuda but no CUDA device is visible to this rank; set learner.device=cpu")
    if want == "cuda":
        # Under Ray each rank sees only its own GPU; under torchrun all of them (pick LOCAL_RANK).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) if torch.cuda.device_count() > 1 else 0)
        return torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return_freed_blocks_to_os()
    return torch.device("cpu")


def join_process_group(device: torch.device, lc: "LearnerConfig", rank: int, world_size: int,
                       master_addr: str, master_port: int) -> None:
    """The ranks' default group (a no-op when torchrun already made it): NCCL on GPUs, gloo on CPUs."""
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if not dist.is_initialized():
        # Offloaded shards live on the CPU: their collectives (grad-norm, full_tensor) need gloo beside NCCL.
        backend = ("cpu:gloo,cuda:nccl" if lc.offload_optimizer else "nccl") if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size)


def seed_everything(seed: int) -> None:
    """torch, numpy and Python's random from run.seed, before the model is built."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def load_model(cfg: "Config", model_path: str) -> torch.nn.Module:
    """The model in fp32 with its attention implementation: packed rows without a [T, T] mask when
    packing runs on sdpa (learners/packed_attention.py), and the logprob head installed before any
    copy and FSDP2, so logprobs come from the head, not full logits (learners/chunked_logprobs.py)."""
    from transformers import AutoModelForCausalLM

    lc = cfg.learner
    attn = resolve_attn_implementation(cfg.model.attn_implementation)
    if attn == "sdpa" and lc.packing and lc.sequence_parallel == 1 and not cfg.model.parity:
        attn = packed_attention.register()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation=attn)
    if attn == packed_attention.ATTN_NAME:
        packed_attention.check_model(model.config)  # plain causal within rows: no sliding window
    install_logprob_head(model)
    return model
