"""Generation actors asked for but not running yet: a replacement waiting for room on the cluster
(its node is gone and the others are full), or an elastic joiner whose engine is still loading.
`ActorPool` asks for them and decides what happens once one has started (actors/pool.py)."""

from __future__ import annotations

import logging
import time
from typing import Any

from async_april.config import Config

log = logging.getLogger("actors.pool")  # the pool's lines, under the logger users filter on

PENDING_NOTE_S = 10.0
"""A pending actor not placed after this long is reported as waiting for capacity."""


class PendingActors:
    """Each pending actor: its handle, its `start()` ref and when it was asked for."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._by_id: dict[str, tuple[Any, Any, float]] = {}
        self._noted: set[str] = set()

    def add(self, actor_id: str, handle: Any) -> None:
        self._by_id[actor_id] = (handle, handle.start.remote(), time.monotonic())

    def started(self) -> list[tuple[str, Any, Any]]:
        """(id, handle, start() ref) of those whose start has returned or raised, no longer pending. One
        waiting past PENDING_NOTE_S is reported once as waiting for capacity."""
        import ray

        out = []
        for actor_id, (handle, ref, since) in list(self._by_id.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                del self._by_id[actor_id]
                out.append((actor_id, handle, ref))
            elif time.monotonic() - since > PENDING_NOTE_S and actor_id not in self._noted:
                self._noted.add(actor_id)
                gpus = self.cfg.rollout.gpus_per_actor
                log.warning("generation actor %s is waiting for capacity (no node that placement.generation=%s "
                            "allows has 1 CPU%s free); it joins once one has", actor_id, self.cfg.placement.generation,
                            f" and {gpus:g} GPU" if gpus else "")
        return out

    def handles(self) -> list[Any]:
        return [handle for handle, _, _ in self._by_id.values()]

    def clear(self) -> None:
        self._by_id.clear()

    def __len__(self) -> int:
        return len(self._by_id)
