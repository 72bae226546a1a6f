"""Placement: `placement.*` specs as Ray scheduling options, and the record of where Ray put each actor.

    spec ("pack" | "spread" | "driver" | "resource:NAME")
      actor_options(spec)            -> .options(...) keywords for one actor (store, generation, eval)
      group_options(spec, bundles)   -> placement_group(...) keywords for the learner's ranks
      room_for(spec, cpus, gpus)     -> how many more such actors the cluster can place now (elastic rollout)
    node_of(handle)                  -> {node_id, ip, resources} of the node an actor runs on, asked of the actor
    write_record(run_dir, entries)   -> run.dir/placement.json

"driver" means the node of the process that called `ray.init` (`ray job submit`: the head node). It
uses node affinity (actors) or the `ray.io/node-id` label (placement groups), never the node's IP:
several nodes of one machine share an IP (tests/multinode). Ray is imported inside the functions.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RESOURCE_SHARE = 0.001
"""What an actor placed by `resource:NAME` takes of NAME: it only marks the node, so a node declaring
{"NAME": 1} takes up to 1000 such actors (their CPUs and GPUs are what limit them)."""

RECORD_FILE = "placement.json"


def driver_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def custom_resource(spec: str) -> str | None:
    return spec.removeprefix("resource:") if spec.startswith("resource:") else None


def actor_options(spec: str) -> dict[str, Any]:
    """Keywords for `ActorClass.options(...)` that put one actor where `spec` says."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if spec == "driver":
        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(driver_node_id(), soft=False)}
    if spec == "spread":
        return {"scheduling_strategy": "SPREAD"}
    if (name := custom_resource(spec)) is not None:
        return {"resources": {name: RESOURCE_SHARE}}
    return {}  # pack: Ray's default (fills a node before the next)


def group_options(spec: str, bundles: list[dict[str, float]]) -> dict[str, Any]:
    """Keywords for `placement_group(...)`: the learner's ranks, one bundle each."""
    if spec == "driver":
        return {"bundles": bundles, "strategy": "PACK",
                "bundle_label_selector": [{"ray.io/node-id": driver_node_id()} for _ in bundles]}
    if spec == "spread":
        return {"bundles": bundles, "strategy": "SPREAD"}
    if (name := custom_resource(spec)) is not None:
        return {"bundles": [{**b, name: RESOURCE_SHARE} for b in bundles], "strategy": "PACK"}
    return {"bundles": bundles, "strategy": "PACK"}


def room_for(spec: str, cpus: float, gpus: float, exclude: frozenset[str] | set[str] = frozenset()) -> int:
    """How many more actors needing `cpus`/`gpus` each fit on the live nodes `spec` allows (less the
    node ids in `exclude`), from what each node has free right now (an estimate: Ray's view lags a
    placement by a moment)."""
    import ray

    name = custom_resource(spec)
    driver = driver_node_id() if spec == "driver" else None
    free = _available_per_node()
    total = 0
    for node in ray.nodes():
        if not node.get("Alive") or (driver is not None and node["NodeID"] != driver) or node["NodeID"] in exclude:
            continue
        avail = free.get(node["NodeID"], {})
        if name is not None and avail.get(name, 0.0) < RESOURCE_SHARE:
            continue
        fits = [avail.get("CPU", 0.0) / cpus] if cpus > 0 else []
        fits += [avail.get("GPU", 0.0) / gpus] if gpus > 0 else []
        total += int(min(fits)) if fits else 0
    return total


def is_placed(handle) -> bool:
    """Whether Ray has given the actor a worker process (its constructor may still be running): until then
    the GCS's actor table lists it PENDING_CREATION with no worker address (Port 0; ray/_private/state.py
    `actor_table`, the record tests/test_multinode.py reads too)."""
    from ray._private.state import state

    try:
        entry = state.actor_table(handle._actor_id.hex())
    except Exception:  # noqa: BLE001 - no answer: never time out on a guess
        return True
    return entry.get("State") != "PENDING_CREATION" or bool((entry.get("Address") or {}).get("Port"))


def free_resources_line() -> str:
    """The live nodes' free CPUs and GPUs right now, for an error that says why something found no room."""
    free = _available_per_node()
    parts = []
    for n in nodes_summary():
        avail = free.get(n["node_id"], {})
        parts.append(f"{n['node_id'][:8]} CPU {avail.get('CPU', 0.0):g}" +
                     (f", GPU {avail.get('GPU', 0.0):g} of {n['resources']['GPU']:g}" if n["resources"].get("GPU") else ""))
    return "free now: " + ("; ".join(parts) or "no live node")


def _available_per_node() -> dict[str, dict[str, float]]:
    """Free resources per node id (Ray's own per-node view)."""
    from ray._private.state import state

    try:
        return {nid: dict(res) for nid, res in state.available_resources_per_node().items()}
    except Exception:  # noqa: BLE001 - an older/newer Ray without it: no growth rather than a crash
        return {}


def _where() -> dict[str, Any]:
    import ray

    ctx = ray.get_runtime_context()
    nid = ctx.get_node_id()
    node = next((n for n in ray.nodes() if n["NodeID"] == nid), {})
    return {"node_id": nid, "ip": node.get("NodeManagerAddress", ray.util.get_node_ip_address()),
            "node_resources": {k: v for k, v in node.get("Resources", {}).items()
                               if not k.startswith("node:") and k not in ("memory", "object_store_memory")},
            "pid": os.getpid()}


def node_of(handle, timeout_s: float = 60.0) -> dict[str, Any]:
    """Where a live actor runs, as the actor itself reads it from its runtime context."""
    import ray

    return ray.get(handle.__ray_call__.remote(lambda self: _where()), timeout=timeout_s)


def nodes_summary() -> list[dict[str, Any]]:
    """Every live node: id, ip, declared resources (for the record and `check`)."""
    import ray

    return [{"node_id": n["NodeID"], "ip": n["NodeManagerAddress"],
             "resources": {k: v for k, v in n["Resources"].items() if not k.startswith("node:")
                           and k not in ("memory", "object_store_memory")}}
            for n in ray.nodes() if n.get("Alive")]


def write_record(run_dir: Path, specs: dict[str, str], actors: dict[str, dict[str, Any]], events: list[dict] | None = None) -> Path:
    """run.dir/placement.json: the specs, the nodes, and per actor (role/name) the node Ray put it on."""
    path = Path(run_dir) / RECORD_FILE
    record = {"specs": specs, "driver_node_id": driver_node_id(), "nodes": nodes_summary(), "actors": actors,
              "events": events or []}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    tmp.replace(path)
    return path


def describe(specs: dict[str, str], actors: dict[str, dict[str, Any]]) -> list[str]:
    """One line per role: its spec and the nodes (short ids) its actors are on."""
    lines = []
    for role, spec in specs.items():
        mine = {name: a for name, a in actors.items() if a.get("role") == role}
        where = ", ".join(f"{name}@{a['node_id'][:8]}" for name, a in sorted(mine.items())) or "none"
        lines.append(f"placement {role}: {spec} -> {where}")
    return lines
