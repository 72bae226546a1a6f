"""Learner checkpoints: sharded model + optimizer as safetensors + JSON, resharded on load, no pickle.

Layout of one checkpoint directory (written to `<dir>.tmp` and renamed by
rank 0 once every rank has finished, so a crash never leaves a half
checkpoint under the final name):

    <dir>/rank_00000.safetensors   this rank's local shard of every model parameter and optimizer
    <dir>/rank_00000.json          state tensor, its RNG state arrays; the JSON holds the rest as plain
                                   data (async_april/run/state_codec.py): for each sharded tensor its
                                   global shape and this shard's offset, scheduler state, RNG
                                   states, step, policy version, consecutive bad steps
    <dir>/rank_00001.*             the same for every other rank
    <dir>/learner.json             world size, step, version (written last by rank 0)

Loading needs neither pickle nor torch.distributed.checkpoint (whose `.metadata`
is a pickle): every rank reads the index of every saved rank, computes the box
of each tensor it holds at the current world size, and copies the overlapping
parts of the saved shards into it (`assemble`), so a checkpoint saved at world
size W loads at any world size. Per-rank RNG states then come from the rank's
own file if it exists, else rank 0's (bit-exact resume needs the same world
size). All ranks must see the same filesystem.
"""

from __future__ import annotations

import json
import random
import shutil
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from async_april.run import state_codec

SHARD_TAG = "$shard"


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


def _rank_name(rank: int) -> str:
    return f"rank_{rank:05d}"


def _local_box(t: DTensor) -> tuple[list[int], list[int]]:
    """(global offset, local shape) of this rank's shard of `t`."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return list(offset), list(shape)


def _store_shard(path: str, value: Any, arrays: dict) -> dict | None:
    """state_codec hook: a DTensor is saved as this rank's local shard plus where it sits in the whole."""
    if not isinstance(value, DTensor):
        return None
    offset, shape = _local_box(value)
    arrays[path] = value.to_local()
    return {SHARD_TAG: path, "global_shape": list(value.shape), "offset": offset, "shape": shape,
            "dtype": str(value.dtype).removeprefix("torch.")}


def save(path: str | Path, model, optimizer, scheduler, rank: int, world_size: int, extra: dict[str, Any],
         model_keys: frozenset[str] | None = None) -> Path:
    """Collective: every rank writes its shards and its small state. `model_keys`: save only these model
    tensors (LoRA: the adapters; the frozen base is model.path)."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if model_keys is not None:
        model_sd = {k: v for k, v in model_sd.items() if k in model_keys}
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "rng": rng_state(), "extra": extra}
    state_codec.save(state, tmp, _rank_name(rank), hook=_store_shard, meta={"rank": rank, "world_size": world_size})
    dist.barrier()
    if rank == 0:
        meta = {"world_size": world_size, **{k: v for k, v in extra.items() if isinstance(v, (int, float, str))}}
        (tmp / "learner.json").write_text(json.dumps(meta, indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    dist.barrier()
    return final


class _Shards:
    """Every saved rank's shards of one checkpoint, read lazily: where each tensor's pieces are."""

    def __init__(self, path: Path, world_size: int):
        from safetensors import safe_open

        self.files = [safe_open(str(path / f"{_rank_name(r)}.safetensors"), framework="pt") for r in range(world_size)]
        self.pieces: dict[str, list[tuple[int, dict]]] = {}
        for r in range(world_size):
            doc = state_codec.read_doc(path, _rank_name(r))
            self._index(doc["tree"], r)

    def _index(self, node: Any, rank: int) -> None:
        if isinstance(node, dict):
            if SHARD_TAG in node:
                self.pieces.setdefault(node[SHARD_TAG], []).append((rank, node))
                return
            for v in node.values():
                self._index(v, rank)
        elif isinstance(node, list):
            for v in node:
                self._index(v, rank)

    def assemble(self, key: str, offset: list[int], shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """The box [offset, offset + shape) of tensor `key`, copied from every saved shard that overlaps it."""
        out = torch.empty(shape, dtype=dtype)
        covered = 0
        for rank, piece in self.pieces.get(key, []):
            lo = [max(a, b) for a, b in zip(offset, piece["offset"])]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, piece["offset"], piece["shape"])]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            src = tuple(slice(lo_ - b, h - b) for lo_, h, b in zip(lo, hi, piece["offset"]))
            dst = tuple(slice(lo_ - a, h - a) for lo_, h, a in zip(lo, hi, offset))
            out[dst] = self.files[rank].get_slice(key)[src] if src else self.files[rank].get_tensor(key)
            covered += prod(h - lo_ for lo_, h in zip(lo, hi))
        if covered != prod(shape):
            raise ValueError(f"learner checkpoint: the saved shards of {key} cover {covered} of the {prod(shape)} "
                             "elements this rank needs (missing rank files?)")
        return out


def load(path: str | Path, model, optimizer, scheduler, rank: int, model_keys: frozenset[str] | None = None) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler and RNG in place; return the small state.
    `model_keys`: the checkpoint holds exactly these model tensors (as saved with them); the rest stay."""
    path = Path(path)
    if not (path / "learner.json").is_file():
        raise FileNotFoundError(f"{path} is not a learner checkpoint (no learner.json); was the save interrupted?")
    saved_world = int(json.loads((path / "learner.json").read_text())["world_size"])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if model_keys is not None:
        model_sd = {k: v for k, v in model_sd.items() if k in model_keys}
    targets = _dtensors({"model": model_sd, "optim": optim_sd})
    shards = _Shards(path, saved_world)

    def fetch(tag: dict) -> Any:
        if SHARD_TAG not in tag:
            raise state_codec.StateFormatError(f"{path}: unknown tag {sorted(tag)}")
        key = tag[SHARD_TAG]
        want = targets.get(key)
        if want is None:  # a tensor this model does not have; set_state_dict will name it
            return shards.assemble(key, [0] * len(tag["global_shape"]), tag["global_shape"], getattr(torch, tag["dtype"]))
        offset, shape = _local_box(want)
        local = shards.assemble(key, offset, shape, want.dtype).to(want.device)
        return DTensor.from_local(local, want.device_mesh, want.placements, run_check=False, shape=want.shape, stride=want.stride())

    own = rank if rank < saved_world else 0
    state = state_codec.load(path, _rank_name(own), fetch=fetch)
    if model_keys is None:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
        if set(state["model"]) != set(model_keys):
            raise ValueError(f"learner checkpoint {path}: it holds {len(state['model'])} model tensors, this LoRA "
                             f"learner trains {len(model_keys)} (e.g. {sorted(set(state['model']) ^ set(model_keys))[:2]}); "
                             "resume with the learner.lora settings it was saved with")
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))  # the frozen base is not in it, by design
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state["extra"]


def _dtensors(tree: Any, prefix: str = "") -> dict[str, DTensor]:
    """Path (as state_codec names it) -> DTensor, for every DTensor in a state tree."""
    out: dict[str, DTensor] = {}
    if isinstance(tree, DTensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_dtensors(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_dtensors(v, f"{prefix}/{i}"))
    return out


def full_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every model tensor of learner checkpoint `path`, whole, as saved (any saved world size), read in
    one process without torch.distributed: what `async-april export` writes. The optimizer is not read."""
    from safetensors import safe_open

    path = Path(path)
    if not (path / "learner.json").is_file():
        raise FileNotFoundError(f"{path} is not a learner checkpoint (no learner.json); was the save interrupted?")
    shards = _Shards(path, int(json.loads((path / "learner.json").read_text())["world_size"]))
    doc = state_codec.read_doc(path, _rank_name(0))
    with safe_open(str(path / f"{_rank_name(0)}.safetensors"), framework="pt") as f:
        def fetch(tag: dict) -> torch.Tensor:
            if SHARD_TAG in tag:
                shape = tag["global_shape"]
                return shards.assemble(tag[SHARD_TAG], [0] * len(shape), shape, getattr(torch, tag["dtype"]))
            if "$pt" in tag:
                return f.get_tensor(tag["$pt"])
            raise state_codec.StateFormatError(f"{path}: unknown tag {sorted(tag)} in the model state")

        return state_codec.decode(doc["tree"]["model"], fetch)
