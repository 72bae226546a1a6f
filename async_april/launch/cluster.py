"""A run on a multi-node Ray cluster: shared storage, the placement record, losing run state.

    probe_nodes(spec, fn, nodes)           one tiny task per live node (or per node given); what each
                                           node must see is asked by launch/node_checks.py (run.dir, a
                                           shared model directory, the pinned hub commit in its cache)
    PlacementRecord.update(...)            asks every actor which node it is on (Ray's own answer) and
                                           writes run.dir/placement.json (docs/cluster.md)
    lost_state_errors() / restart_or_raise the errors that mean a learner rank or the store is gone: the
                                           controller rebuilds the run from its last checkpoint
                                           (run.max_restarts) once the layout fits the live nodes again
                                           (wait_for_layout), or ends with the command that resumes it
    who_died(error, ...)                   a RayActorError as the death of the actor it names
    layout (check): async_april/launch/layout.py
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from typing import Any

from async_april.config import Config
from async_april.run.console import say
from async_april.errors import UserError

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 60.0
"""Longest a node may take to answer the storage probe (it may be busy starting workers)."""


class SharedStorageError(UserError, OSError):
    """A node of the cluster cannot see run.dir or a shared model directory, or lacks the pinned hub commit."""


def _probe(paths: dict[str, str]) -> dict[str, Any]:
    import os

    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
            "missing": [key for key, p in paths.items() if not os.path.exists(p)]}


NODE_DEATH_WAIT_S = 30.0
"""How long a node the probe could not reach may take to be marked dead (Ray's default health checks
declare a node dead after ~15 s of silence) before the probe's failure counts as an error."""


def probe_nodes(paths: dict[str, Any], fn=_probe, what: str = "storage probe", nodes: list[str] | None = None) -> list[dict[str, Any]]:
    """Run `fn(paths)` (`_probe`, or another probe of a dict) once on every live node, or on each of
    `nodes` (hard node affinity); one answer per node that is still there."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(fn)
    if nodes is None:
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(paths) for nid in nodes]
    answers, deadline = [], time.monotonic() + PROBE_TIMEOUT_S  # one timeout for all, as a single ray.get had
    for nid, ref in zip(nodes, refs):
        try:
            answers.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
        except ray.exceptions.TaskUnschedulableError:
            # The GCS still listed the node alive, but it is gone (its death is seen ~1.5-15 s late):
            # a node that left cannot hold any of the run's actors, so it has nothing to see.
            if not node_seen_dead(nid, within_s=NODE_DEATH_WAIT_S):
                raise
            say(f"node {nid[:8]} left the cluster during the {what}; not checked")
    return answers


def node_seen_dead(node_id: str, within_s: float) -> bool:
    """Whether the GCS marks the node dead within `within_s` seconds (polled every 0.2 s)."""
    import ray

    deadline = time.monotonic() + within_s
    while any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def warn_if_layout_does_not_fit(cfg: Config) -> None:
    """`check`'s layout fit (async_april/launch/layout.py) on the live nodes: a warning here, since Ray
    may still find room (nodes joining; a sketch of its scheduler can be wrong), and actors then wait."""
    from async_april.launch.layout import fit_layout, live_nodes
    from async_april.hosts.placement import driver_node_id

    layout = fit_layout(cfg, live_nodes(), driver_node_id())
    if layout.problems:
        say("warning: the layout may not fit the cluster as it is now (actors will wait for room): " + "; ".join(layout.problems))


class StoreLostError(RuntimeError):
    """The rollout store's actor died (its node, or its process): the run rebuilds from its checkpoint."""


def lost_state_errors() -> tuple[type[BaseException], ...]:
    """What escapes the step loop when a learner rank or the rollout store is gone (generation actors'
    deaths are handled inside actors/pool.py and never get here; `who_died` names the actor)."""
    import ray

    from learners.group import LearnerLostError

    return (LearnerLostError, StoreLostError, ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


def who_died(error: BaseException, store, learner, pool, evaluator=None) -> BaseException:
    """A RayActorError that reached the step loop, as the death of the actor it names (Ray's
    `RayActorError.actor_id`, ray/exceptions.py): StoreLostError or LearnerLostError (rebuild), or
    the error itself, its message saying which actor it was."""
    from learners.group import LearnerLostError

    dead = getattr(error, "actor_id", None)
    text = str(error).strip().splitlines()
    why = f"{type(error).__name__}: {text[-1] if text else ''}"[:300]

    def hex_id(handle) -> str | None:
        return handle._actor_id.hex() if handle is not None and hasattr(handle, "_actor_id") else None

    if dead is not None and dead == hex_id(store):
        return StoreLostError(f"the rollout store died ({why})")
    for rank, w in enumerate(getattr(learner, "workers", [])):
        if dead is not None and dead == hex_id(w):
            return LearnerLostError(f"learner rank {rank} died ({why})")
    names = {hex_id(h): i for i, h in getattr(pool, "actors", {}).items()}
    if evaluator is not None and getattr(evaluator, "actor", None) is not None:
        names[hex_id(evaluator.actor)] = "the evaluation actor"
    if dead in names:
        error.args = (f"{names[dead]} died ({why})",)
    return error


def resume_command(cfg: Config) -> str:
    """The command that continues this run from its latest checkpoint."""
    argv = [a for a in sys.argv[1:] if not a.startswith(("run.resume=", "run.overwrite="))]
    head = "async-april " + " ".join(shlex.quote(a) for a in argv) if argv and argv[0] == "train" else "async-april train CONFIG"
    return f"{head} run.dir={shlex.quote(str(cfg.run_dir))} run.resume=auto"


LAYOUT_POLL_S = 2.0
"""How often a rebuild waiting for the cluster to hold its layout again looks at the live nodes."""


def wait_for_layout(cfg: Config) -> tuple[list[str], float]:
    """After a lost node: the layout fitted again on the live nodes (`check`'s fit, launch/layout.py),
    waiting up to run.placement_timeout_s for nodes to join. Returns what still does not fit (empty: it
    fits) and the seconds waited. A rebuild that started without this would place the learner first and
    take GPUs the engines then wait for for ever (a 2 x 4-GPU layout that lost its learner's node)."""
    from async_april.launch.layout import fit_layout, live_nodes
    from async_april.hosts.placement import driver_node_id

    t0 = time.monotonic()
    problems = fit_layout(cfg, live_nodes(), driver_node_id()).problems
    if problems:
        say(f"the cluster cannot hold the run's layout now ({'; '.join(problems)}); waiting up to "
            f"run.placement_timeout_s={cfg.run.placement_timeout_s:g} s for nodes to join")
    while problems and time.monotonic() - t0 < cfg.run.placement_timeout_s:
        time.sleep(LAYOUT_POLL_S)
        problems = fit_layout(cfg, live_nodes(), driver_node_id()).problems
    return problems, time.monotonic() - t0


def restart_or_raise(cfg: Config, error: BaseException, restarts: int):
    """The run resolved again from its latest checkpoint (run.max_restarts), or RunStateLost (LayoutLost
    when the cluster cannot hold the layout any more)."""
    from async_april.run.checkpoints import CheckpointManager
    from async_april.launch.resolve import resolve

    latest = CheckpointManager(cfg.run_dir).latest_valid()
    why = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
    if latest is None or restarts >= cfg.run.max_restarts:
        reason = "no checkpoint to restart from (set checkpoint.every)" if latest is None else \
            f"run.max_restarts={cfg.run.max_restarts} reached"
        say(f"run state lost ({why}); {reason}. " + (f"Resume from {latest.path} with: {resume_command(cfg)}"
                                                    if latest is not None else "Nothing to resume from."))
        raise RunStateLost(f"{why}; {reason}") from error
    missing, waited = wait_for_layout(cfg)
    if missing:
        raise LayoutLost(f"run state lost ({why}) and the cluster cannot hold the run's layout any more: {'; '.join(missing)} "
                         f"(waited {waited:.0f} s, run.placement_timeout_s); the checkpoint {latest.path} is kept: once "
                         f"the cluster has room again, resume with: {resume_command(cfg)}") from error
    say(f"run state lost ({why}): restarting from {latest.path} (restart {restarts + 1} of {cfg.run.max_restarts}); "
        f"steps after {latest.step} are trained again")
    return resolve(cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": str(latest.path), "overwrite": False})}))


class RunStateLost(RuntimeError):
    """A learner rank or the rollout store was lost and the run could not rebuild itself."""


class LayoutLost(RunStateLost, UserError):
    """The run lost a node and the cluster left cannot hold its layout: one error line, checkpoints kept."""


class PlacementRecord:
    """run.dir/placement.json, kept current: rewritten whenever the set of actors changes."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.specs = {"learner": cfg.placement.learner, "store": cfg.placement.store,
                      "generation": cfg.placement.generation, "eval": cfg.placement.eval}
        self.actors: dict[str, dict[str, Any]] = {}
        self._seen: frozenset[str] = frozenset()

    def update(self, store, learner, pool, evaluator=None, announce: bool = False) -> bool:
        """Ask each actor not yet recorded where it runs; drop the ones gone. Returns whether it changed."""
        from async_april.hosts.placement import describe, node_of, write_record

        live = {"store": ("store", store)}
        for r, w in enumerate(getattr(learner, "workers", [])):
            live[f"learner{r}"] = ("learner", w)
        for i, h in pool.actors.items():
            live[i] = ("generation", h)
        if evaluator is not None and evaluator.actor is not None:
            live["eval"] = ("eval", evaluator.actor)
        if frozenset(live) == self._seen:
            return False
        for name in set(self.actors) - set(live):
            self.actors.pop(name)
        for name, (role, handle) in live.items():
            if name not in self.actors:
                try:
                    self.actors[name] = {"role": role, **node_of(handle)}
                except Exception as e:  # noqa: BLE001 - an actor that died meanwhile is handled by its owner
                    log.warning("placement: could not ask %s where it runs (%r)", name, e)
        self._seen = frozenset(live)
        write_record(self.cfg.run_dir, self.specs, self.actors, list(getattr(pool, "events", [])))
        if announce:
            for line in describe(self.specs, self.actors):
                say(line)
        return True
