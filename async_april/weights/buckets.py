"""The weight-bucket format both sides share: full weights in dtype-grouped, size-bounded buckets.

Moving weights one tensor at a time costs minutes (one round trip each);
one giant blob doubles peak memory. Buckets bound both: at most `bucket_mb`
per bucket (a single tensor larger than the cap travels alone in its own,
larger bucket), all tensors of a bucket share a dtype, names are kept.

Transports (`weight_sync.transport`):

    object_store  learner rank 0 gathers one bucket at a time and `ray.put`s it; the engine
                  actors receive the list of ObjectRefs and await them (`fetch_buckets`; a
                  blocking `ray.get` in an async actor stalls its event loop) or, outside an
                  async actor, `ray.get` them one at a time (`iter_buckets`). CPU default.
    disk          rank 0 writes root/v{version:08d}/bucket_NNNNN.safetensors + manifest.json
                  into a temporary directory renamed into place (atomic); engines get the
                  directory path and read the buckets one at a time. Needs a shared filesystem.
    nccl          a broadcast group [learner rank 0, every TP rank of engines 1..N] on its own
                  TCP store (as SGLang's /init_weights_update_group), NCCL when the learner is on
                  GPUs, gloo when it runs on CPU (`broadcast_backend`); engines are told the bucket
                  plan (names, dtypes, shapes) and receive each tensor by broadcast. Every member
                  takes every broadcast, so the group is re-formed whenever the set of engines
                  changes (learners/weight_sync.py).

Engines see one call whatever the transport: `update_weights(payload, version)`,
where payload is a list of ObjectRefs (object_store) or a directory (disk), and
`await fetch_buckets(payload)` (in an async actor) or `iter_buckets(payload)` gives the `WeightBucket`s
for `Engine.update_weights`.

The learner writes this format (learners/), the engines read it (actors/): it lives in the core so
that neither imports the other. The driver-side push is learners/weight_sync.py `WeightSyncer`.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

import torch

WeightBucket = dict[str, torch.Tensor]
MB = 1 << 20
MANIFEST = "manifest.json"
KEEP_DISK_VERSIONS = 2
"""Weight versions kept on disk by the disk transport (older directories are deleted)."""


class TensorSpec(NamedTuple):
    name: str
    dtype: str
    """torch dtype name without the `torch.` prefix, e.g. float32."""
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))


def plan_buckets(specs: Iterable[TensorSpec], bucket_mb: float) -> list[list[TensorSpec]]:
    """Group tensor specs into buckets: one dtype each, at most `bucket_mb` MiB each.

    One open bucket per dtype; a bucket is closed when the next tensor of its
    dtype would overflow it. A tensor larger than the cap gets a bucket of its
    own. Deterministic, so every rank (and an NCCL receiver) computes the same plan.
    """
    if bucket_mb <= 0:
        raise ValueError(f"weight_sync.bucket_mb must be > 0, got {bucket_mb}")
    cap = int(bucket_mb * MB)
    done: list[list[TensorSpec]] = []
    open_: dict[str, tuple[list[TensorSpec], int]] = {}
    for spec in specs:
        size = spec.nbytes
        bucket, used = open_.get(spec.dtype, ([], 0))
        if bucket and used + size > cap:
            done.append(bucket)
            bucket, used = [], 0
        bucket.append(spec)
        used += size
        if used >= cap:  # full, or a single oversized tensor
            done.append(bucket)
            open_.pop(spec.dtype, None)
        else:
            open_[spec.dtype] = (bucket, used)
    done.extend(b for b, _ in open_.values())
    return done


def bucketize(named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor], bucket_mb: float) -> list[WeightBucket]:
    """Split named tensors into dtype-grouped buckets of at most `bucket_mb` MiB (see `plan_buckets`)."""
    items = dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
    plan = plan_buckets((spec_of(n, t) for n, t in items.items()), bucket_mb)
    return [{s.name: items[s.name] for s in bucket} for bucket in plan]


def bucket_nbytes(bucket: WeightBucket) -> int:
    return sum(t.numel() * t.element_size() for t in bucket.values())


# --------------------------------------------------------------------- receive side


def iter_buckets(payload: Any) -> Iterator[WeightBucket]:
    """Yield the buckets of one weight update one at a time (engine side).

    payload: a list of Ray ObjectRefs (object_store transport) or a directory
    written by the disk transport. Only one bucket is resident at a time,
    provided the caller drops each bucket after loading it.
    """
    if isinstance(payload, (str, os.PathLike)):
        yield from iter_disk_buckets(payload)
        return
    import ray

    for ref in payload:
        yield ray.get(ref)


async def fetch_buckets(payload: Any) -> Iterable[WeightBucket]:
    """The buckets of one weight update, for an async actor (generation, evaluation): ObjectRefs awaited
    one after the other, never a blocking `ray.get` (Ray logs "Using blocking ray.get inside async
    actor" for one even from another thread, and it stalls the loop meanwhile); a disk directory is
    read lazily, as `iter_buckets` does. All fetched buckets are held until the engine loads them,
    which the engines need anyway (the torch engine stages a whole set before copying any of it,
    actors/engines/torch_batch.py; the SGLang client sends them within one pause)."""
    if isinstance(payload, (str, os.PathLike)):
        return iter_disk_buckets(payload)
    return [await ref for ref in payload]


def iter_disk_buckets(directory: str | os.PathLike) -> Iterator[WeightBucket]:
    from safetensors.torch import load_file

    d = Path(directory)
    manifest = json.loads((d / MANIFEST).read_text())
    for name in manifest["buckets"]:
        yield load_file(str(d / name))


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(directory) / MANIFEST).read_text())


# ------------------------------------------------------------------------- disk


class DiskBucketWriter:
    """Writes buckets into root/.v{version}.tmp, then renames it to root/v{version:08d} (atomic)."""

    def __init__(self, root: str | os.PathLike, version: int) -> None:
        self.root = Path(root)
        self.version = version
        self.final = self.root / f"v{version:08d}"
        self.tmp = self.root / f".v{version:08d}.tmp-{os.getpid()}"
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.files: list[str] = []
        self.nbytes = 0

    def add(self, bucket: WeightBucket) -> None:
        from safetensors.torch import save_file

        name = f"bucket_{len(self.files):05d}.safetensors"
        seen: set[int] = set()
        tensors = {}
        for k, t in bucket.items():
            t = t.detach().contiguous()
            if t.data_ptr() in seen:  # safetensors refuses shared storage (tied weights)
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[k] = t
        save_file(tensors, str(self.tmp / name))
        self.files.append(name)
        self.nbytes += bucket_nbytes(bucket)

    def commit(self) -> str:
        manifest = {"version": self.version, "buckets": self.files, "bytes": self.nbytes}
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)
        old = sorted(p for p in self.root.glob("v*") if p.is_dir() and p.name[1:].isdigit())
        for p in old[:-KEEP_DISK_VERSIONS]:
            shutil.rmtree(p, ignore_errors=True)
        return str(self.final)


# ------------------------------------------------------------------------- nccl


def broadcast_backend(device_type: str) -> str:
    """The weight group's backend for a learner on `device_type`: NCCL between GPUs, gloo from a CPU learner."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_broadcast_group(master_addr: str, master_port: int, world_size: int, rank: int, group_name: str,
                         backend: str = "nccl", timeout_s: float = 600.0):
    """A process group outside the default one, as SGLang's `init_custom_process_group`
    (sglang 0.5.23 srt/utils/common.py): a TCP store at master_addr:master_port (hosted by rank 0),
    `PrefixStore(group_name, store)`, then torch's `_new_process_group_helper`.

    The learner's rank 0 is rank 0 of this group; SGLang engines join with `/init_weights_update_group`
    (master_address, master_port, rank_offset, world_size, group_name, backend), which builds the same
    group. Returns once all `world_size` members joined; a missing member fails it after `timeout_s`
    (torch: "Timed out ... waiting for clients"). Tested over gloo against the SGLang stand-in
    (tests/sglang_standin_group.py); NCCL itself needs GPUs.
    """
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(rendezvous(f"tcp://{master_addr}:{master_port}", rank, world_size,
                                              timeout=timedelta(seconds=timeout_s)))
    store.set_timeout(timedelta(seconds=timeout_s))
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timedelta(seconds=timeout_s))
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_broadcast_group(pg) -> None:
    """This member's half of the group, as SGLang's /destroy_weights_update_group does its own
    (`torch.distributed.destroy_process_group(pg)`: pg.shutdown() and the name freed, local to this
    process, distributed_c10d.py), so a group of the same name can be formed again."""
    import torch.distributed as dist

    dist.destroy_process_group(pg)


def receive_broadcast(plan: list[list[TensorSpec]], group, device: str = "cuda") -> Iterator[WeightBucket]:
    """Engine side of the nccl transport for torch-based engines: yield each bucket as it arrives."""
    import torch.distributed as dist

    for bucket in plan:
        out = {}
        for spec in bucket:
            t = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=device)
            dist.broadcast(t, src=0, group=group)
            out[spec.name] = t
        yield out


# ------------------------------------------------------------------------ driver
