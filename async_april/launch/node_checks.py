"""What every node of a run must see, checked on each node before anything of the run is written there.

    NodeChecks(cfg, model_path)   what must be checked, from the resolved run:
        run.dir                   shared: learner ranks write their checkpoint shards there and read them on resume
                                  (a marker file the driver has just written, looked for on the node)
        a local model.path        shared: every engine and learner rank loads that directory
        a hub ID                  per node: the commit the driver resolved (`org/name[@rev]` -> snapshots/<commit>),
                                  in the node's OWN Hugging Face cache, read offline (async_april/models/hub.py)
        builtin:*                 nothing: each node builds it (async_april/models/tiny.py)
    .start()                      every live node, once Ray is up (several nodes, or one that is not the driver's)
    .problems(node_ids)           the nodes not seen before are probed (an elastic joiner, the node a learner is
                                  rebuilt onto); a node's verdict is kept for the run
    .new_problems()               probes the live nodes not seen before (an elastic pool's grow(): not room if bad)
    .problem_of(actor)            the verdict on the node a started actor runs on (actors/pool.py retires it if bad)
    .require(node_ids, who)       SharedStorageError (a UserError) naming each bad node and its fix

The probe is one zero-CPU task per node with hard node affinity (launch/cluster.py probe_nodes).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from async_april.config import Config
from async_april.launch.cluster import SharedStorageError, probe_nodes


def _probe_node(spec: dict[str, Any]) -> dict[str, Any]:
    """On the node: which of spec["paths"] it cannot see, and whether its own hub cache has spec["hub"]."""
    import os

    import ray

    from async_april.models.hub import cached_snapshot, hub_cache_dir, offline

    answer = {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
              "missing": [key for key, p in spec["paths"].items() if not os.path.exists(p)]}
    if spec.get("hub"):
        repo, commit = spec["hub"]
        answer["hub"] = {"cache": str(hub_cache_dir()), "cached": cached_snapshot(repo, commit) is not None, "offline": offline()}
    return answer


class NodeChecks:
    """The run's verdict per node: None (sees everything it must) or the line saying what it lacks."""

    def __init__(self, cfg: Config, model_path: str | Path):
        from async_april.models.paths import hub_pin, model_source

        self.cfg = cfg
        self.model_dir = Path(model_path) if model_source(cfg.model.path) == "local" else None
        self.hub = hub_pin(cfg.model.path, model_path)
        """(repo, commit) every node must load, when model.path is a hub ID."""
        self.verdicts: dict[str, str | None] = {}

    @property
    def bad(self) -> set[str]:
        return {n for n, v in self.verdicts.items() if v is not None}

    def start(self) -> int:
        """Probe every live node (skipped when the only one is the driver's own: it wrote run.dir and
        resolved the model); returns the nodes checked. SharedStorageError if any lacks something."""
        import ray

        from async_april.hosts.placement import driver_node_id

        alive = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        if alive == [driver_node_id()]:
            self.verdicts[alive[0]] = None
            return 0
        self.require(alive, "the run")
        return len(alive)

    def problems(self, node_ids: list[str] | None = None) -> dict[str, str]:
        """Node id -> what it lacks, for `node_ids` (default: every live node); unseen ones are probed now."""
        import ray

        if node_ids is None:
            node_ids = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        todo = [n for n in dict.fromkeys(node_ids) if n not in self.verdicts]
        if todo:
            for answer in self._probe(todo):
                self.verdicts[answer["node_id"]] = self._verdict(answer)
        return {n: self.verdicts[n] for n in node_ids if self.verdicts.get(n)}

    def new_problems(self) -> dict[str, str]:
        """Probe the live nodes not seen before (they joined); the failing ones among them."""
        seen = set(self.verdicts)
        return {n: p for n, p in self.problems().items() if n not in seen}

    def problem_of(self, handle) -> tuple[str, str | None]:
        """(node id, what it lacks or None) for the node a live actor runs on, probed if not seen before."""
        from async_april.hosts.placement import node_of

        node = node_of(handle)["node_id"]
        return node, self.problems([node]).get(node)

    def require(self, node_ids: list[str], who: str) -> None:
        """SharedStorageError naming every node of `node_ids` that lacks something `who` needs there."""
        bad = self.problems(node_ids)
        if bad:
            raise SharedStorageError(f"{'; '.join(bad.values())} ({who} cannot run there)")

    def _probe(self, node_ids: list[str]) -> list[dict[str, Any]]:
        # A fresh marker per probe: a node must see what the driver writes NOW, not a stale file.
        marker = self.cfg.run_dir / f".node-probe-{uuid.uuid4().hex[:12]}"
        marker.write_text("written by the driver; every node must see it\n")
        paths = {"run.dir": str(marker)}
        if self.model_dir is not None:
            paths["model.path"] = str(self.model_dir / "config.json")
        try:
            return probe_nodes({"paths": paths, "hub": self.hub}, fn=_probe_node, nodes=node_ids)
        finally:
            marker.unlink(missing_ok=True)

    def _verdict(self, answer: dict[str, Any]) -> str | None:
        from async_april.models.hub import missing_commit

        where = f"node {answer['node_id'][:8]} ({answer['ip']})"
        lines = []
        if answer["missing"]:
            what = " or ".join(f"run.dir={self.cfg.run_dir}" if k == "run.dir" else f"the model directory {self.model_dir}"
                               for k in answer["missing"])
            lines.append(f"{where} cannot see {what}, which must be on storage every node of the Ray cluster sees "
                         "at the same path (NFS, a cluster file system); move it there or leave that node out of the cluster")
        hub = answer.get("hub")
        may_download = self.cfg.model.download_on_nodes
        if hub and not hub["cached"] and not (may_download and not hub["offline"]):
            lines.append(missing_commit(where, *self.hub, hub["cache"], may_download))
        return "; ".join(lines) or None
