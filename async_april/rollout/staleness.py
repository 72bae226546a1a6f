"""Admission control that bounds how stale a trained token can be (AReaL).

Pure logic, no Ray. With learner version v, batch size B groups and maximum
staleness eta, at most (eta + v + 1) * B groups may have been started (minus
those filtered or dropped, which free their slot). A group admitted under
that limit is among the first (eta + v + 1) batches, so it is trained by
version v + eta at the latest; generation runs ahead of the learner by at most
eta versions and never has to throw work away to respect the bound.

eta = 0 with no over-provisioning reproduces synchronous training: the
(v + 1)-th batch's prompts can only start once weights v are loaded.

A second, independent cap bounds the groups launched and not yet trained
(running, partial, or complete and waiting) to ceil(over_provision * B):
APRIL's over-provisioning. Each step launches over_provision * B groups,
leftovers included, and nothing refills the pool until a batch is taken, so
the early stop cuts the round when B of them are complete.

Admission alone does not bound staleness: batches are made of COMPLETE groups,
so a long group admitted early can be overtaken by newer short ones until its
oldest token is past eta. Batches are therefore chosen earliest deadline first
(`is_due`): the store waits for a started group whose deadline is the current
version rather than fill the batch with newer groups, and regenerates at once a
started group already past it (async_april/rollout/store.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessController:
    batch_groups: int
    max_staleness: int
    over_provision: float = 1.0

    def __post_init__(self) -> None:
        if self.batch_groups < 1 or self.max_staleness < 0 or self.over_provision < 1.0:
            raise ValueError(f"invalid staleness controller settings: {self}")

    @property
    def max_groups_in_flight(self) -> int:
        return math.ceil(self.over_provision * self.batch_groups)

    def capacity(self, version: int, admitted: int, untrained: int) -> int:
        """How many new groups may start now.

        version: learner policy version v (steps trained so far).
        admitted: groups started so far that still count (started - filtered - dropped).
        untrained: groups started and not yet handed to the learner (running, partial or waiting).
        """
        by_staleness = (self.max_staleness + version + 1) * self.batch_groups - admitted
        by_over_provision = self.max_groups_in_flight - untrained
        return max(0, min(by_staleness, by_over_provision))

    def is_due(self, oldest_token_version: int, version: int, eta: int | None = None) -> bool:
        """Whether a group whose oldest token is that version is due exactly at `version` (its deadline,
        oldest + eta, is now): trained at this version or never, since one batch later it exceeds eta.
        A group past its deadline is stale (`is_stale`), not due: waiting for it gains nothing.
        `eta`: the group's own bound when eta changed since it was admitted (default: this one's)."""
        eta = self.max_staleness if eta is None else eta
        return oldest_token_version >= 0 and oldest_token_version + eta == version

    def is_stale(self, oldest_token_version: int, version: int, eta: int | None = None) -> bool:
        """Whether a group whose oldest token is that version exceeds eta if trained at `version`."""
        eta = self.max_staleness if eta is None else eta
        return oldest_token_version >= 0 and version - oldest_token_version > eta
