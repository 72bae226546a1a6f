"""Driver-side weight push: the learner group's current weights to every engine actor, in buckets.

The bucket format and the transports' two ends (object store refs, disk directories, the NCCL
broadcast group) are async_april/weights/buckets.py, re-exported here; this module adds the push,
and learners/weight_group.py the broadcast group's membership (re-formed when the engines change).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from async_april.weights.buckets import (  # noqa: F401 - re-exported: where callers always found them
    KEEP_DISK_VERSIONS,
    MANIFEST,
    MB,
    DiskBucketWriter,
    TensorSpec,
    WeightBucket,
    bucket_nbytes,
    bucketize,
    init_broadcast_group,
    iter_buckets,
    iter_disk_buckets,
    plan_buckets,
    read_manifest,
    receive_broadcast,
    spec_of,
)

from learners.weight_group import BroadcastGroup, nccl_group_layout  # noqa: F401 - nccl_group_layout: where callers found it

if TYPE_CHECKING:
    from learners.group import LearnerGroup


class WeightSyncer:
    """Driver-side weight push from a `LearnerGroup` to engine (generation) actors.

    Engine actors must expose `update_weights(payload, version)` (object_store,
    disk) and, for nccl, `weight_group_member()` (its name), `init_weights_update_group(master_addr,
    master_port, rank_offset, world_size, group_name, backend)`, `destroy_weights_update_group()` and
    `update_weights_from_distributed(plan, version)` (actors/generation.py).
    """

    def __init__(self, transport: str = "object_store", bucket_mb: float = 256.0,
                 disk_dir: str | os.PathLike | None = None, group_name: str = "async_april_weights",
                 tp_size: int = 1, group_timeout_s: float = 600.0) -> None:
        if transport not in ("object_store", "disk", "nccl"):
            raise ValueError(f"weight_sync.transport={transport!r}: expected object_store, disk or nccl")
        if transport == "disk" and disk_dir is None:
            raise ValueError("the disk transport needs a directory (disk_dir) visible to learner rank 0 and every engine")
        self.transport, self.bucket_mb = transport, bucket_mb
        self.disk_dir = Path(disk_dir) if disk_dir is not None else None
        self.group_name, self.tp_size, self.group_timeout_s = group_name, tp_size, group_timeout_s
        self.group = BroadcastGroup(group_name, tp_size, group_timeout_s)

    @classmethod
    def from_config(cls, cfg, disk_dir: str | os.PathLike | None = None) -> "WeightSyncer":
        ws = cfg.weight_sync
        if ws.transport == "disk" and disk_dir is None:  # weight_sync.disk_dir if given (was ignored before)
            disk_dir = Path(ws.disk_dir).expanduser().absolute() if ws.disk_dir else cfg.run_dir / "weights"
        tp = cfg.rollout.sglang.tp_size if cfg.rollout.engine == "sglang" else 1
        return cls(ws.transport, ws.bucket_mb, disk_dir, tp_size=tp, group_timeout_s=ws.group_timeout_s)

    def push(self, learner_group: "LearnerGroup", engine_actors: list, version: int) -> dict[str, float]:
        """Send the learner's current weights to every engine as `version`; blocks until all loaded.
        nccl: the broadcast also reaches every live engine of the group that is not in `engine_actors`
        (a joiner's first load: they get their version again), and the group is re-formed first when
        the set changed (learners/weight_group.py)."""
        import ray

        t0 = time.perf_counter()
        try:
            nbytes, n_buckets = self._send(learner_group, engine_actors, version)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            # Engines fail too when a learner rank dies under them (rank 0 owns the object-store buckets
            # they fetch; the NCCL broadcast's sender): blame the rank, so that no engine is retired for it.
            learner_group.raise_if_lost()
            raise
        dt = time.perf_counter() - t0
        out = {
            "timing_s/weight_sync": dt,
            "perf/weight_sync_mb_per_s": nbytes / MB / dt if dt > 0 else 0.0,
            "weight_sync/mb": nbytes / MB,
            "weight_sync/buckets": float(n_buckets),
        }
        if self.transport == "nccl":
            out["weight_sync/group_reforms"] = float(self.group.reforms)
        return out

    def _send(self, learner_group: "LearnerGroup", engine_actors: list, version: int) -> tuple[int, int]:
        """The transport's own path; returns (bytes, buckets) sent."""
        import ray

        if self.transport == "object_store":
            refs = learner_group.weight_buckets(self.bucket_mb)
            ray.get([a.update_weights.remote(refs, version) for a in engine_actors])
            nbytes = learner_group.last_export_bytes
            n_buckets = len(refs)
            del refs  # the learner owns the objects; dropping the refs frees the store
        elif self.transport == "disk":
            path = learner_group.write_weights(str(self.disk_dir), self.bucket_mb, version)
            ray.get([a.update_weights.remote(path, version) for a in engine_actors])
            manifest = read_manifest(path)
            nbytes, n_buckets = manifest["bytes"], len(manifest["buckets"])
        else:
            targets = self.group.targets(engine_actors)
            self.group.ensure(learner_group, targets)
            plan = learner_group.weight_plan(self.bucket_mb) if targets else []
            futs = [a.update_weights_from_distributed.remote(plan, version) for a in targets.values()]
            try:
                if targets:
                    learner_group.broadcast_weights(self.bucket_mb)
                ray.get(futs)
            except BaseException:
                self.group.valid = False  # a member failed part way: the next push forms the group again
                raise
            nbytes, n_buckets = sum(s.nbytes for b in plan for s in b), len(plan)
        return nbytes, n_buckets
