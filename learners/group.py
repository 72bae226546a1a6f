"""Driver side of the learner: one Ray actor per FSDP2 rank, in one placement group.

    LearnerGroup(cfg, model_path)   returns once the ranks are spawned; they initialise in the background
      placement group: world_size bundles ({"CPU": 1} or {"GPU": 1, "CPU": 1}), placed by
      placement.learner (PACK by default; SPREAD splits the ranks over nodes)
      a task on bundle 0 picks (rank 0's node ip, free port) -> every rank's MASTER_ADDR/PORT
      LearnerWorker actor per rank (num_cpus=1, OMP_NUM_THREADS=1)
    train_step(batch) -> every rank gets the same batch ref and takes its shard; rank 0's metrics
    weight_buckets(bucket_mb) -> ObjectRefs put by rank 0 (all ranks gather collectively)

Every method calls all ranks at once (the work is collective) and returns rank 0's answer. A rank
whose actor died (its node was lost) raises LearnerLostError at once, without waiting for the
others (they would wait in a collective for a peer that is gone); the controller decides what next.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from async_april.errors import UserError
from async_april.hosts.network import ifname_env
from async_april.weights.buckets import TensorSpec, broadcast_backend, plan_buckets
from learners.worker import INJECT_NAN_ENV, LearnerWorker

if TYPE_CHECKING:
    from async_april.rollout.batch import TrainBatch
    from async_april.config import Config


class LearnerLostError(RuntimeError):
    """A learner rank's actor died (process or node lost): the group must be rebuilt from a checkpoint."""


class LearnerPlacementError(UserError):
    """The learner's placement group found no room within run.placement_timeout_s."""


def _node_ip_and_free_port() -> tuple[str, int]:
    ip = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return ip, s.getsockname()[1]


class LearnerGroup:
    """`world_size` LearnerWorker actors sharing one FSDP2 process group."""

    def __init__(self, cfg: "Config", model_path: str, *, node_check=None) -> None:
        """`node_check(node_ids)`, if given, sees the nodes the placement group reserved before any rank
        starts there (launch/node_checks.py: a node that cannot see run.dir raises, nothing written)."""
        self.cfg = cfg
        lc = cfg.learner
        self.world_size = lc.world_size
        use_gpu = lc.device == "cuda" or (lc.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
        bundle = {"GPU": lc.gpus_per_rank, "CPU": 1} if use_gpu else {"CPU": 1}
        from async_april.hosts.placement import group_options

        self.pg = placement_group(**group_options(cfg.placement.learner, [dict(bundle) for _ in range(self.world_size)]))
        timeout_s = cfg.run.placement_timeout_s
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            from async_april.hosts.placement import free_resources_line

            remove_placement_group(self.pg)
            raise LearnerPlacementError(
                f"the learner's {self.world_size} rank(s) ({', '.join(f'{k} {v:g}' for k, v in bundle.items())} each, "
                f"placement.learner={cfg.placement.learner}) found no room on the cluster in run.placement_timeout_s="
                f"{timeout_s:g} s ({free_resources_line()}); free or add nodes, or change placement.learner") from None
        if node_check is not None:
            try:
                node_check(list(dict.fromkeys(ray.util.placement_group_table(self.pg)["bundles_to_node_id"].values())))
            except BaseException:
                remove_placement_group(self.pg)
                raise

        def on(i: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)

        addr, port = ray.get(
            ray.remote(num_cpus=0)(_node_ip_and_free_port).options(scheduling_strategy=on(0)).remote()
        )
        actor_cls = ray.remote(LearnerWorker)
        env_vars = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env_vars.update(ifname_env(cfg))  # run.gloo/nccl_socket_ifname over the node's own (async_april/hosts/network.py)
        if os.environ.get(INJECT_NAN_ENV):  # test hook only; see docs/reliability.md
            env_vars[INJECT_NAN_ENV] = os.environ[INJECT_NAN_ENV]
        env = {"env_vars": env_vars}
        self.workers = [
            actor_cls.options(
                num_cpus=1, num_gpus=lc.gpus_per_rank if use_gpu else 0, scheduling_strategy=on(r), runtime_env=env,
                name=None, max_concurrency=1,
            ).remote(cfg, str(model_path), r, self.world_size, addr, port)
            for r in range(self.world_size)
        ]  # fmt: skip
        # The ranks initialise in the background (imports, process group, model load: ~10 s on 2 CPU cores),
        # so the caller can start the engines meanwhile; the first call that needs them waits.
        self._ready = [w.get_version.remote() for w in self.workers]
        self._version: int | None = None
        self._specs: list[TensorSpec] | None = None
        self.last_export_bytes = 0
        self.broadcast_backend = broadcast_backend("cuda" if use_gpu else "cpu")
        """The weight group's backend (weight_sync.transport=nccl): NCCL between GPUs, gloo from CPU ranks."""
        self.lost = False
        """A rank died: the group is unusable (LearnerLostError was raised)."""

    def wait_ready(self) -> None:
        """Block until every rank has initialised; raises the first rank's init error."""
        if self._version is None:
            self._check_alive(self._ready)
            self._version = int(ray.get(self._ready)[0])

    def _all(self, method: str, *args: Any) -> list[Any]:
        self.wait_ready()
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        self._check_alive(refs)
        return ray.get(refs)

    def _check_alive(self, refs: list) -> None:
        try:
            _raise_first_death(refs)
        except LearnerLostError:
            self.lost = True
            raise

    def raise_if_lost(self, timeout_s: float = 10.0) -> None:
        """LearnerLostError naming the first rank whose actor is dead; returns if every rank answers. Asked
        when a call on other actors failed in a way a rank's death also causes (engines fetching buckets
        that rank 0 owns), so that the death is blamed on the actor that died."""
        refs = [w.__ray_call__.remote(lambda self: None) for w in self.workers]
        try:
            self._check_alive(refs)
            ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            return  # busy, not dead: the caller's own error stands
    @property
    def version(self) -> int:
        self.wait_ready()
        return self._version

    def pin_cpus(self, cores: tuple[int, ...]) -> None:
        self._all("pin_cpus", cores)

    def train_step(self, batch: "TrainBatch") -> dict[str, float]:
        ref = ray.put(batch)
        try:
            metrics = self._all("train_step", ref)[0]
        except ray.exceptions.RayTaskError as e:
            # The rank's own error (e.g. learner.max_bad_steps reached), not a wrapped Ray traceback.
            if isinstance(e.cause, (RuntimeError, ValueError)):
                raise type(e.cause)(str(e.cause)) from None
            raise
        self._version = int(metrics["train/policy_version"])
        return metrics

    def weight_plan(self, bucket_mb: float) -> list[list[TensorSpec]]:
        if self._specs is None:
            self._specs = ray.get(self.workers[0].weight_specs.remote())
        return plan_buckets(self._specs, bucket_mb)

    def weight_buckets(self, bucket_mb: float) -> list[ray.ObjectRef]:
        """Full weights as bucket ObjectRefs (owned by rank 0), in order."""
        self.last_export_bytes = sum(s.nbytes for b in self.weight_plan(bucket_mb) for s in b)
        return self._all("weight_buckets", bucket_mb)[0]

    def write_weights(self, root: str, bucket_mb: float, version: int) -> str:
        return self._all("write_weights", root, bucket_mb, version)[0]

    def free_port_on_rank0(self) -> tuple[str, int]:
        strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=0)
        return ray.get(ray.remote(num_cpus=0)(_node_ip_and_free_port).options(scheduling_strategy=strategy).remote())

    def init_weight_broadcast(self, master_addr: str, master_port: int, world_size: int, group_name: str,
                              timeout_s: float = 600.0, joins: list | None = None) -> None:
        """Rank 0 joins the engines' broadcast group while they do (`joins`: their calls' refs); returns once
        all joined. Rank 0 dead is LearnerLostError, as for every call here."""
        ref = self.workers[0].init_weight_broadcast.remote(master_addr, master_port, world_size, group_name,
                                                           self.broadcast_backend, timeout_s)
        ray.wait([ref, *(joins or [])], num_returns=1 + len(joins or []))
        self._check_alive([ref])
        ray.get([ref, *(joins or [])])

    def destroy_weight_broadcast(self) -> None:
        ref = self.workers[0].destroy_weight_broadcast.remote()
        self._check_alive([ref])
        ray.get(ref)

    def broadcast_weights(self, bucket_mb: float) -> None:
        self._all("broadcast_weights", bucket_mb)

    def full_state_dict(self) -> dict:
        return self._all("full_state_dict")[0]

    def full_optimizer_state_dict(self) -> dict:
        return self._all("full_optimizer_state_dict")[0]

    def peak_mem_gb(self) -> list[float]:
        return self._all("peak_mem_gb")

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", str(path))

    def load_checkpoint(self, path: str) -> dict[str, int]:
        state = self._all("load_checkpoint", str(path))[0]
        self._version = state["version"]
        return state

    def export_hf(self, path: str) -> str:
        return self._all("export_hf", str(path))[0]

    def shutdown(self) -> None:
        try:  # not when a rank is lost: the others may be stuck in a collective with it (killed below)
            if not self.lost:
                self._all("shutdown")
        except Exception:  # noqa: BLE001 - a dead rank must not prevent cleanup
            pass
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
        self.workers = []


def _raise_first_death(refs: list) -> None:
    """Wait for `refs` (one per rank, in rank order) in completion order; the first from a dead rank
    raises LearnerLostError naming that rank."""
    rank_of = {r: i for i, r in enumerate(refs)}
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done)
        except ray.exceptions.RayActorError as e:
            text = str(e).strip().splitlines()
            raise LearnerLostError(f"learner rank {rank_of[done[0]]} died ({type(e).__name__}: {text[-1] if text else ''})"[:400]) from None
        except Exception:  # noqa: BLE001 - a rank's own error is raised by the caller's ray.get, in rank order
            return
