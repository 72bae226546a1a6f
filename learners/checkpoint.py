"""Learner checkpoints: sharded model + optimizer with torch.distributed.checkpoint.

Layout of one checkpoint directory (written to `<dir>.tmp` and renamed by
rank 0 once every rank has finished, so a crash never leaves a half
checkpoint under the final name):

    <dir>/dcp/              DCP shards (one .distcp file per rank) + .metadata; model and optimizer
    <dir>/rank_00000.pt     per rank: scheduler state, RNG states (torch, cuda, numpy, python),
    <dir>/rank_00001.pt     step, policy version, consecutive bad steps
    <dir>/learner.json      world size, step, version (written last by rank 0)

DCP reshards on load, so a checkpoint saved at world size W loads at any
world size; the per-rank RNG states then come from rank 0's file (bit-exact
resume needs the same world size). All ranks must see the same filesystem.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank_{rank:05d}.pt"


def save(path: str | Path, model, optimizer, scheduler, rank: int, world_size: int, extra: dict[str, Any]) -> Path:
    """Collective: every rank writes its shards and its small state file."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
    torch.save({"scheduler": scheduler.state_dict(), "rng": rng_state(), **extra}, _rank_file(tmp, rank))
    dist.barrier()
    if rank == 0:
        meta = {"world_size": world_size, **{k: v for k, v in extra.items() if isinstance(v, (int, float, str))}}
        (tmp / "learner.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    dist.barrier()
    return final


def load(path: str | Path, model, optimizer, scheduler, rank: int) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler and RNG in place; return the small state."""
    path = Path(path)
    if not (path / "learner.json").is_file():
        raise FileNotFoundError(f"{path} is not a learner checkpoint (no learner.json); was the save interrupted?")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    own = _rank_file(path, rank)
    extra = torch.load(own if own.is_file() else _rank_file(path, 0), weights_only=False)
    scheduler.load_state_dict(extra.pop("scheduler"))
    set_rng_state(extra.pop("rng"))
    return extra
