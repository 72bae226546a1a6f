"""The FSDP2 learner: ranks as Ray actors, bucketed weight export, checkpoints.

    parallelize.py    the only place applying FSDP2 / activation checkpointing / compile
    logprobs.py       per-token logprobs (pure) and response logprobs of a padded micro-batch
    update.py         PPO mini-batches and token-budget micro-batches (pure)
    optim.py          learning-rate schedule, peak FLOP/s for MFU
    worker.py         LearnerWorker: one rank (plain class; runs with or without Ray)
    rank_setup.py     a rank's device, process group, seeds and model loading, before FSDP2
    weight_export.py  the rank's full weights, bucketed (a mixin of LearnerWorker)
    group.py          LearnerGroup: one Ray actor per rank in a placement group
    weight_sync.py    WeightSyncer: the driver-side push to the engines (the bucket format and the
                      transports' two ends: async_april/weights/buckets.py)
    weight_group.py   the nccl transport's broadcast group: its members, re-formed when the engines change
    checkpoint.py     per-rank model + optimizer shards (safetensors + JSON, no pickle), resharded on load
    hf_dir.py         a Hugging Face model directory from a full state dict

Imports are lazy so `import learners` pulls in neither torch nor Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LearnerWorker": "learners.worker",
    "LearnerGroup": "learners.group",
    "WeightSyncer": "learners.weight_sync",
    "bucketize": "learners.weight_sync",
    "iter_buckets": "learners.weight_sync",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'learners' has no attribute {name!r}")
