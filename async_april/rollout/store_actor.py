"""The rollout store as an async Ray actor: methods run one at a time on its event loop, and
`get_batch` waits for a batch without blocking the pushes that complete it."""

from __future__ import annotations

import asyncio

from async_april.config import Config
from async_april.data import PromptDataset
from async_april.rollout.store import RolloutStore
from async_april.rollout.trajectory import Group, Sample


class RolloutStoreActor(RolloutStore):
    """Async Ray actor face of the store: methods run one at a time on its event loop."""

    def __init__(self, cfg: Config, dataset: PromptDataset):
        super().__init__(cfg, dataset)
        self._changed = asyncio.Event()
        """Set by every push and control call: `get_batch` looks again only then."""

    async def get_batch(self, recheck_s: float = 1.0) -> list[Group]:
        # Re-examined only when a push or a control call changed something: polling would re-check
        # every waiting group's staleness hundreds of times a second, on the learner's CPU share.
        while (batch := self.try_get_batch()) is None:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), recheck_s)
            except asyncio.TimeoutError:
                pass
        return batch

    async def lease_async(self, actor_id: str, max_items: int, engine_version: int) -> list[Sample]:
        return self.lease(actor_id, max_items, engine_version)

    async def push_async(self, actor_id: str, samples: list[Sample], early_stop: bool = False) -> None:
        self.push(actor_id, samples, early_stop)
        self._changed.set()

    async def call(self, method: str, *args, **kwargs):
        out = getattr(self, method)(*args, **kwargs)
        self._changed.set()
        return out

    def pin_cpus(self, cores: tuple[int, ...]) -> None:
        """Pin the store's process to `cores` (run.pin_cpus)."""
        from async_april.hosts.cpu_pinning import pin_process

        pin_process(cores)
