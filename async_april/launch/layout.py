"""Does a config's layout fit a cluster? `async-april check` against a live cluster, before anything starts.

    fit_layout(cfg, nodes, driver_node_id) -> Layout
      nodes: [{"node_id", "ip", "resources": {"CPU": 8, "GPU": 4, "NAME": 1, ...}}] (declared totals)
      places, as Ray would under placement.*, on a copy of the nodes' resources:
        learner   learner.world_size bundles of {CPU: 1, GPU: gpus_per_rank (CUDA)}: pack fills one node
                  before the next, spread deals them round-robin, driver / resource:NAME only on such nodes
        store     0 CPUs: the driver's node, or any node declaring NAME
        generation rollout.num_actors x {CPU: 1, GPU: gpus_per_actor}, spread round-robin or packed
      Layout.problems: what does not fit, each naming the role, the need and the nodes; empty when it fits.
      Layout.lines(): one line per role saying which node gets how many.

A sketch of Ray's scheduler, not Ray itself: it answers "can this ever be placed", which is what an
operator wants to know before the run waits on a placement group that will never be ready.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from async_april.config import Config
from async_april.hosts.placement import RESOURCE_SHARE, custom_resource


@dataclass
class Layout:
    nodes: list[dict[str, Any]]
    placed: dict[str, list[str]] = field(default_factory=dict)
    """role -> node id per actor/rank."""
    problems: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"cluster: {len(self.nodes)} node(s): " + "; ".join(
            f"{n['node_id'][:8]} " + ", ".join(f"{k} {v:g}" for k, v in sorted(n["resources"].items())) for n in self.nodes)]
        for role, where in self.placed.items():
            counts = {nid: where.count(nid) for nid in dict.fromkeys(where)}
            out.append(f"layout {role}: " + (", ".join(f"{c} on {nid[:8]}" for nid, c in counts.items()) or "none"))
        return out


def _allowed(spec: str, nodes: list[dict], driver: str | None) -> list[dict]:
    name = custom_resource(spec)
    if spec == "driver":
        return [n for n in nodes if n["node_id"] == driver]
    if name is not None:
        return [n for n in nodes if n["free"].get(name, 0.0) >= RESOURCE_SHARE]
    return nodes


def _take(node: dict, need: dict[str, float]) -> bool:
    if all(node["free"].get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0):
        for k, v in need.items():
            node["free"][k] = node["free"].get(k, 0.0) - v
        return True
    return False


def _place(role: str, spec: str, count: int, need: dict[str, float], nodes: list[dict], driver: str | None,
           layout: Layout) -> None:
    allowed = _allowed(spec, nodes, driver)
    where: list[str] = []
    if spec == "spread":
        while len(where) < count:
            progress = False
            for n in allowed:
                if len(where) < count and _take(n, need):
                    where.append(n["node_id"])
                    progress = True
            if not progress:
                break
    else:
        for n in allowed:
            while len(where) < count and _take(n, need):
                where.append(n["node_id"])
    layout.placed[role] = where
    if len(where) < count:
        what = ", ".join(f"{k} {v:g}" for k, v in need.items() if v > 0) or "nothing"
        scope = f"on nodes allowed by placement.{role}={spec} ({len(allowed)} of {len(nodes)})" if spec not in ("pack", "spread") else \
            f"on the cluster's {len(nodes)} node(s)"
        layout.problems.append(f"{role}: {count} x ({what}) needed, only {len(where)} fit {scope}")


def fit_layout(cfg: Config, nodes: list[dict[str, Any]], driver_node_id: str | None = None) -> Layout:
    work = [{**n, "free": dict(n["resources"])} for n in nodes]
    layout = Layout(nodes)
    r, lc, p = cfg.rollout, cfg.learner, cfg.placement
    cuda = lc.device == "cuda" or (lc.device == "auto" and any(n["resources"].get("GPU", 0) >= 1 for n in nodes))
    _place("learner", p.learner, lc.world_size, {"CPU": 1.0, "GPU": lc.gpus_per_rank if cuda else 0.0}, work,
           driver_node_id, layout)
    _place("store", p.store if p.store != "spread" else "pack", 1, {}, work, driver_node_id, layout)
    _place("generation", p.generation, r.num_actors, {"CPU": 1.0, "GPU": r.gpus_per_actor}, work, driver_node_id, layout)
    return layout


def live_nodes() -> list[dict[str, Any]]:
    """The connected cluster's live nodes with their declared (total) resources."""
    from async_april.hosts.placement import nodes_summary

    return nodes_summary()
