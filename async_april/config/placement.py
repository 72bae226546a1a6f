"""Where each role's Ray actors go on a cluster (docs/cluster.md, multi-node)."""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from async_april.config.base import Section

PLACEMENT_HELP = ("`pack`, `spread`, `driver` (the node this run's driver is on) or `resource:NAME` "
                  "(only nodes that declare the custom resource NAME, e.g. `ray start --resources '{\"NAME\": 1}'`)")


def _check_spec(key: str, value: Any, allowed: tuple[str, ...]) -> Any:
    if isinstance(value, str) and (value in allowed or (value.startswith("resource:") and len(value) > len("resource:"))):
        return value
    words = ", ".join(f"`{a}`" for a in allowed)
    raise ValueError(f"placement.{key} must be one of {words} or `resource:NAME` (got {value!r}); {PLACEMENT_HELP}")


class PlacementConfig(Section):
    """Placement of the learner ranks, the rollout store, the generation actors and the evaluation
    actor over the Ray cluster's nodes. Printed at the start of a run and recorded, as Ray placed
    them, in `run.dir/placement.json`. On one machine every value is the same single node."""

    learner: str = "pack"
    """Learner ranks (one placement group): `pack` (as few nodes as possible; FSDP2 traffic stays inside a node), `spread` (one rank per node where possible: the rendezvous then crosses nodes), `driver`, or `resource:NAME` (every rank on nodes with that custom resource)."""
    store: str = "driver"
    """The rollout store, which holds the run's state between checkpoints: `driver` (the driver's node, hard affinity: it lives and dies with the run itself; on `ray job submit` the head), `resource:NAME`, or `spread`/`pack` (anywhere Ray likes: a worker node's loss then loses the store and the run restores it from the last checkpoint)."""
    generation: str = "spread"
    """Generation actors: `spread` (over every node with room), `pack` (fill one node first), `driver`, or `resource:NAME` (only nodes declaring it; elastic actors join such nodes only)."""
    eval: str = "spread"
    """The evaluation actor: same choices as `generation`."""

    @field_validator("learner", "generation", "eval")
    @classmethod
    def _actors(cls, value: Any, info) -> Any:
        return _check_spec(info.field_name, value, ("pack", "spread", "driver"))

    @field_validator("store")
    @classmethod
    def _store(cls, value: Any) -> Any:
        return _check_spec("store", value, ("driver", "pack", "spread"))
