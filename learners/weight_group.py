"""The nccl transport's broadcast group: which engines are in it, and re-forming it when that changes.

Every member of a torch.distributed group takes part in every collective on it: a broadcast from learner
rank 0 returns only once each member received it, and a rendezvous only once `world_size` members
joined. So a group formed for the engines of one push cannot serve another set: a replacement or an
elastic joiner was never in it (SGLang 0.5.23 answers its load "Group ... not in [...]",
model_runner_components/weight_updater.py receive_weights_from_distributed), and a member that died, or
whose actor died while its server lives on, never receives (NCCL waits for it until its timeout).

    targets(actors)   the engines of this push, asked their names (a dead one raises: the pool handles
                      the death and pushes again), plus every live member of the current group (a group
                      has no subset broadcast: a joiner's first load reaches them too, at the version they
                      already have); members that died are left out, never waited on
    ensure(learner, targets)
                      when targets is not the group's set: destroy the group on every old member
                      (/destroy_weights_update_group) and on learner rank 0, then form a new one sized for
                      the new world (/init_weights_update_group on a fresh port), and say so in one line

This is slime's rule (slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py:
`connect_rollout_engines` disconnects every engine and the trainer, then connects all engines, whenever
the rollout side reports new engines; every update goes to all of them).
"""

from __future__ import annotations

from typing import Any

from async_april.run.console import say


def nccl_group_layout(num_engines: int, tp_size: int) -> tuple[int, list[int]]:
    """(world size, rank offset of each engine) of the broadcast group: learner rank 0 is rank 0, and
    every TP rank of every engine's server is a rank of its own (SGLang's init_custom_process_group
    gives TP rank k of a server rank rank_offset + k)."""
    return 1 + num_engines * tp_size, [1 + i * tp_size for i in range(num_engines)]


def group_change_line(backend: str, old: list[str], new: list[str]) -> str:
    """`weight sync: nccl group re-formed for 3 engines (gen0, gen2, gen3): gen1 left, gen3 joined`."""
    n = f"{len(new)} engine{'s' if len(new) != 1 else ''} ({', '.join(new)})"
    if not old:
        return f"weight sync: {backend} group formed for {n}"
    left, joined = [m for m in old if m not in new], [m for m in new if m not in old]
    change = [f"{', '.join(left)} left"] * bool(left) + [f"{', '.join(joined)} joined"] * bool(joined)
    return f"weight sync: {backend} group re-formed for {n}: {', '.join(change) or 'after a failed broadcast'}"


class BroadcastGroup:
    """Driver-side membership of the learner->engines broadcast group (see the module docstring)."""

    def __init__(self, group_name: str, tp_size: int, timeout_s: float) -> None:
        self.group_name, self.tp_size, self.timeout_s = group_name, tp_size, timeout_s
        self.members: dict[str, Any] = {}
        """Engine name -> actor handle, in rank order, of the group as formed (empty: none formed)."""
        self.valid = False
        """False until formed, and after a broadcast on it failed (it is re-formed before the next)."""
        self.reforms = 0

    def targets(self, actors: list) -> dict[str, Any]:
        """Name -> handle of every engine the next broadcast must reach: the live old members first (their
        rank order), then the push's new ones. A push actor that is dead raises (RayActorError)."""
        import ray

        asked = list(actors) + [h for h in self.members.values() if h not in actors]
        if not asked:
            return {}
        refs = [h.weight_group_member.remote() for h in asked]
        ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)  # a dead actor answers at once (an error)
        names: dict[Any, str] = {}
        for i, (h, ref) in enumerate(zip(asked, refs)):
            try:
                names[h] = ray.get(ref, timeout=0)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if i < len(actors):  # one the pool asked for: its death is the pool's to handle
                    raise
        out = {n: h for n, h in self.members.items() if h in names}  # members still alive, in rank order
        out.update((names[h], h) for h in actors if names[h] not in out)
        return out

    def ensure(self, learner_group, targets: dict[str, Any]) -> bool:
        """Re-form the group for `targets` unless it is already theirs; returns whether it did."""
        import ray

        if self.valid and list(targets) == list(self.members):
            return False
        old, self.valid = list(self.members), False
        if self.members:  # every old member leaves, the learner too; a dead one's call fails at once
            refs = [h.destroy_weights_update_group.remote() for h in self.members.values()]
            learner_group.destroy_weight_broadcast()
            ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
            self.members = {}
        if not targets:  # no engine left to form a group with (a pool waiting for capacity)
            return True
        addr, port = learner_group.free_port_on_rank0()  # a fresh TCP store: nothing of the old group's
        world, offsets = nccl_group_layout(len(targets), self.tp_size)
        backend = learner_group.broadcast_backend
        joins = [h.init_weights_update_group.remote(addr, port, off, world, self.group_name, backend)
                 for h, off in zip(targets.values(), offsets)]
        learner_group.init_weight_broadcast(addr, port, world, self.group_name, self.timeout_s, joins)
        self.members, self.valid = dict(targets), True
        self.reforms += bool(old)
        say(group_change_line(backend, old, list(targets)))
        return True
