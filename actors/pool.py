"""ActorPool: the generation actors of a run, their `run()` loops, and what happens when one dies.

    start(n) ──> GenerationActor x n (engine started, current weights loaded) ──> run() loops
    check():  a finished run() ref means the loop died (ray.kill, process crash, engine error):
              kill what is left of the actor, store.release_actor(id) (its leases go back to the
              store as the store last saw them; partials resume first), count it, and start a
              replacement that loads the learner's current weights and version before it leases
              (up to rollout.max_actor_restarts for the whole run, rebuilds and resumes included; then
              the others carry on). A replacement that dies while starting is one more engine death
              (counted, replaced again within the budget), never the run's.
              A RewardError (reward.on_error=stop) is not an actor fault: the run stops with it.
              A replacement the cluster has no room for (its node is gone) waits as *pending*, with a
              message, and joins once Ray places it.
    elastic (rollout.max_actors): check() also starts pending actors whenever the nodes that
              placement.generation allows have room (a node joined), up to max_actors; a pending one
              joins the run once its engine started and loaded the current weights. A lost node's
              actors are replaced only where there is room, so the pool shrinks instead of failing.
    new nodes (`node_checks`, launch/node_checks.py): a node no actor of the run has used yet is probed
              (run.dir, a shared model directory, the pinned hub commit) before an actor placed there
              is used; an actor on a node that fails is retired with one line saying why, and that
              node is no longer counted as room.

The controller calls `wait_for_batch`, `call_all` and `push_weights` instead of
touching actor handles, so a death at any point of the step is handled here.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from async_april.config import Config
from async_april.hosts.cpu_pinning import CpuPlan
from async_april.errors import UserError
from actors.pool_pending import PendingActors
from actors.pool_report import engine_totals, no_room, not_at_version, pool_metrics, short as _short, startup_notes

log = logging.getLogger(__name__)


class NoGenerationActorsError(RuntimeError):
    """Every generation actor died and the restart budget is spent."""


class PlacementTimeoutError(UserError):
    """Generation actors found no room on the cluster within run.placement_timeout_s."""


class ActorPool:
    def __init__(self, cfg: Config, store, model_path: str, load_weights: Callable[[list], Any] | None = None,
                 cpu_plan: "CpuPlan | None" = None, restarts_before: int = 0, node_checks=None):
        """`load_weights(handles)` pushes the learner's current weights and version to new actors;
        with `cpu_plan` (run.pin_cpus) each actor, replacements included, gets a core of its own;
        `restarts_before`: replacements this run started before this pool (earlier rebuilds, the resumed
        checkpoint's count), which rollout.max_actor_restarts counts too; `node_checks`
        (launch/node_checks.NodeChecks) vets a node the first time an actor lands there."""
        self.cfg, self.store, self.model_path = cfg, store, model_path
        self.load_weights = load_weights
        self.cpu_plan = cpu_plan
        self.node_checks = node_checks
        self.actors: dict[str, Any] = {}
        self.loops: dict[str, Any] = {}
        self.restarts = restarts_before
        """Replacements started over the whole run (rollout/actor_restarts)."""
        self.failures = 0
        self._next = 0
        self.pending = PendingActors(cfg)
        """Actors started but not yet running (actors/pool_pending.py)."""
        self.started_elastic = 0
        self.events: list[dict[str, Any]] = []
        """Joins and losses (placement.json): {"t", "event", "actor"}."""
        self._looping = False
        self._last: dict[str, dict[str, float]] = {}
        """Latest metrics per actor ever started (a dead one keeps its final numbers, in flight 0)."""

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, n: int) -> None:
        """Create and start `n` actors; their loops start with `start_loops` (after weights are loaded).
        Actors the cluster has found no room for within run.placement_timeout_s stop the start with
        PlacementTimeoutError naming them and what each needs (rather than waiting for ever)."""
        import ray

        from async_april.run.console import stage

        from async_april.hosts.placement import is_placed

        new = [self._spawn() for _ in range(n)]
        pending = [self.actors[i].start.remote() for i in new]
        refs = list(pending)
        t0 = time.monotonic()
        with stage(f"starting {n} {self.cfg.rollout.engine} engine(s)", total=n, unit="engine") as bar:
            while pending:  # an SGLang server can take minutes: say what it is waiting for
                done, pending = ray.wait(pending, timeout=1.0)
                bar.update(len(done))
                if pending:
                    bar.set_postfix_str(startup_notes([self.actors[i] for i in new]))
                    if time.monotonic() - t0 > self.cfg.run.placement_timeout_s:
                        if unplaced := [i for i in new if not is_placed(self.actors[i])]:
                            for i in unplaced:  # never placed: nothing to stop, and a stop() call would wait on it
                                ray.kill(self.actors.pop(i), no_restart=True)
                            raise PlacementTimeoutError(no_room(self.cfg, unplaced))
        ray.get(refs)
        self._pin(new)

    def _spawn(self) -> str:
        actor_id, handle = self._new_actor()
        self.actors[actor_id] = handle
        return actor_id

    def _new_actor(self) -> tuple[str, Any]:
        import ray

        from actors.generation import GenerationActor
        from async_april.hosts.network import ifname_env
        from async_april.hosts.placement import actor_options

        actor_id = f"gen{self._next}"
        self._next += 1
        env = ifname_env(self.cfg)  # run.gloo/nccl_socket_ifname reach the actor and the server it launches
        handle = ray.remote(GenerationActor).options(
            num_cpus=1, num_gpus=self.cfg.rollout.gpus_per_actor, max_concurrency=1000,
            **actor_options(self.cfg.placement.generation), **({"runtime_env": {"env_vars": env}} if env else {}),
        ).remote(self.cfg, actor_id, self.store, self.model_path)
        return actor_id, handle

    @property
    def elastic(self) -> bool:
        return self.cfg.rollout.max_actors is not None

    def room(self) -> int:
        """Generation actors the allowed nodes have room for now."""
        from async_april.hosts.placement import room_for

        bad = self.node_checks.bad if self.node_checks is not None else frozenset()
        return room_for(self.cfg.placement.generation, 1.0, self.cfg.rollout.gpus_per_actor, exclude=bad)

    def _start_pending(self, why: str) -> str:
        actor_id, handle = self._new_actor()
        self.pending.add(actor_id, handle)
        self.events.append({"t": time.time(), "event": f"pending ({why})", "actor": actor_id})
        return actor_id

    def _poll_pending(self) -> int:
        """Pending actors whose engine started join the run (current weights first); returns how many."""
        import ray

        joined = 0
        for actor_id, handle, ref in self.pending.started():
            try:
                ray.get(ref)
                if not self._usable(actor_id, handle):
                    continue
                self.actors[actor_id] = handle
                self._pin([actor_id])
                if self.load_weights is not None:
                    self.load_weights([handle])  # current weights + version BEFORE any lease
            except Exception as e:  # noqa: BLE001 - its node went away while it started: forget it
                self.actors.pop(actor_id, None)
                ray.kill(handle, no_restart=True)
                log.warning("pending generation actor %s did not start (%s)", actor_id, _short(e))
                continue
            if self._looping:
                self.loops[actor_id] = handle.run.remote()
            self.events.append({"t": time.time(), "event": "joined", "actor": actor_id})
            log.warning("generation actor %s joined the run (%d running)", actor_id, len(self.actors))
            joined += 1
        return joined

    def grow(self) -> int:
        """Elastic rollout: start pending actors where there is room, up to rollout.max_actors; returns
        how many were asked for. One round at a time: Ray's free-resource view lags a placement."""
        if not self.elastic or self.pending:
            return 0
        for node, problem in (self.node_checks.new_problems() if self.node_checks is not None else {}).items():
            log.warning("not using node %s for generation actors: %s", node[:8], problem)  # not room from now on
        want = self.cfg.rollout.max_actors - len(self.actors)
        n = min(want, self.room()) if want > 0 else 0
        for _ in range(n):
            self._start_pending("elastic: room on the cluster")
            self.started_elastic += 1
        return n

    def _usable(self, actor_id: str, handle) -> bool:
        """Whether the node Ray placed this started actor on passes the node checks; if not, the actor
        (it has leased nothing yet) is killed with one line saying why."""
        import ray

        node, problem = self.node_checks.problem_of(handle) if self.node_checks is not None else (None, None)
        if problem is None:
            return True
        ray.kill(handle, no_restart=True)
        log.warning("generation actor %s retired before its first lease: %s", actor_id, problem)
        self.events.append({"t": time.time(), "event": f"retired (node {node[:8]} failed the storage probe)", "actor": actor_id})
        return False

    def _pin(self, actor_ids: list[str]) -> None:
        import ray

        if self.cpu_plan is not None:  # after start(): the engine's thread exists and is pinned too
            ray.get([self.actors[i].pin_cpus.remote((self.cpu_plan.engine_core(int(i.removeprefix("gen"))),)) for i in actor_ids])

    def start_loops(self) -> None:
        self._looping = True
        for i, a in self.actors.items():
            if i not in self.loops:
                self.loops[i] = a.run.remote()

    @property
    def handles(self) -> list:
        return list(self.actors.values())

    def stop(self) -> None:
        import ray

        refs = [a.stop.remote() for a in self.actors.values()]
        for r in refs:
            try:
                ray.get(r, timeout=60)
            except Exception as e:  # noqa: BLE001 - a dying actor must not block shutdown
                log.warning("generation actor did not stop cleanly: %r", e)
        for a in list(self.actors.values()) + self.pending.handles():
            ray.kill(a)
        self.actors.clear()
        self.pending.clear()
        self.loops.clear()

    def kill(self, actor_id: str) -> None:
        """Fault injection (tests, drills): kill one actor's process without warning the store."""
        import ray

        ray.kill(self.actors[actor_id], no_restart=True)

    # -- fault handling ---------------------------------------------------------------------
    def check(self) -> int:
        """Handle every actor whose loop has ended; returns how many were handled."""
        import ray

        dead = []
        if self.loops:
            done, _ = ray.wait(list(self.loops.values()), timeout=0, num_returns=len(self.loops))
            dead = [i for i, ref in self.loops.items() if ref in done]
        for actor_id in dead:
            self._handle_death(actor_id, self.loops.pop(actor_id))
        joined = self._poll_pending() if self.pending else 0
        if self._looping:
            self.grow()
        if dead:
            if not self.actors and not self.pending and not self.elastic:
                raise NoGenerationActorsError(
                    f"every generation actor has died ({self.failures} failures, {self.restarts} restarts, "
                    f"rollout.max_actor_restarts={self.cfg.rollout.max_actor_restarts}); no batch can complete. "
                    "See the errors above; raise rollout.max_actor_restarts or fix the engine")
            if not self.actors:
                log.warning("no generation actor is running; waiting for capacity (%d pending)", len(self.pending))
            self.start_loops()
        return len(dead) + joined

    def _handle_death(self, actor_id: str, loop_ref) -> None:
        import ray

        from async_april.rewards.scoring import RewardError

        try:
            ray.get(loop_ref)
            reason = "its loop returned"
        except RewardError as e:  # reward.on_error=stop: the run's decision, not an actor fault
            cause = getattr(e, "cause", None) or e
            raise RewardError(str(cause).splitlines()[0] if str(cause) else repr(cause)) from None
        except Exception as e:  # noqa: BLE001 - any failure of the loop is an actor death
            reason = _short(e)
        handle = self.actors.pop(actor_id)
        ray.kill(handle, no_restart=True)  # late pushes from its in-flight tasks are ignored by the store
        released = ray.get(self.store.call.remote("release_actor", actor_id))
        self.failures += 1
        if actor_id in self._last:
            self._last[actor_id]["rollout/inflight"] = 0.0
        log.warning("generation actor %s died (%s); %d leased samples returned to the store", actor_id, reason, released)
        self.events.append({"t": time.time(), "event": f"died ({reason})", "actor": actor_id})
        if self.elastic:  # grow() replaces it where there is room: the pool shrinks rather than waits
            return
        self._replace(actor_id)

    def _replace(self, dead_id: str) -> None:
        """Start a replacement for `dead_id` within rollout.max_actor_restarts; one that dies while starting
        (its process, or an engine error) is handled as one more engine death and replaced in turn."""
        import ray

        budget = self.cfg.rollout.max_actor_restarts
        while self.restarts < budget:
            self.restarts += 1
            if self.room() < 1:  # its node is gone and the others are full: start it when Ray can place it
                new_id = self._start_pending(f"replaces {dead_id}")
                log.warning("%s will replace %s once a node has room (restart %d of %d)", new_id, dead_id,
                            self.restarts, budget)
                return
            new_id = self._spawn()
            try:
                ray.get(self.actors[new_id].start.remote())
                if not self._usable(new_id, self.actors[new_id]):  # placed on a node first used now, which failed its probe
                    self.actors.pop(new_id)
                    return
                self._pin([new_id])
                if self.load_weights is not None:
                    self.load_weights([self.actors[new_id]])  # current weights + version BEFORE any lease
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:  # the engine's, not the learner's
                ray.kill(self.actors.pop(new_id), no_restart=True)
                ray.get(self.store.call.remote("release_actor", new_id))  # counted as a failure; it held no leases
                self.failures += 1
                self.events.append({"t": time.time(), "event": f"died while starting ({_short(e)})", "actor": new_id})
                log.warning("%s, replacing %s, died while starting (%s)", new_id, dead_id, _short(e))
                dead_id = new_id
                continue
            log.warning("started %s to replace %s (restart %d of %d)", new_id, dead_id, self.restarts, budget)
            return
        log.warning("not restarting %s: rollout.max_actor_restarts=%d reached for this run; continuing on %d actor(s)",
                    dead_id, budget, len(self.actors))

    # -- calls that tolerate a death ------------------------------------------------------------
    def wait_for_batch(self, poll_s: float = 1.0, stop: Callable[[], bool] | None = None):
        """Block on the store for a batch, handling actor deaths while waiting. When `stop()` turns
        true (a signal) the wait is cancelled and None returned -- unless the store had already
        handed the batch out, which is then returned so that it is trained, not lost."""
        import ray

        ref = self.store.get_batch.remote()
        while True:
            ready, _ = ray.wait([ref], timeout=poll_s)
            if ready:
                return ray.get(ref)
            if stop is not None and stop():
                ray.cancel(ref)  # get_batch moves groups out only in a step with no await: all or nothing
                try:
                    return ray.get(ref)
                except (ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError):
                    return None
            self.check()

    def call_all(self, method: str, *args) -> list:
        """Call `method` on every live actor; an actor that dies meanwhile is handled, not raised."""
        import ray

        refs = {i: getattr(a, method).remote(*args) for i, a in self.actors.items()}
        out = []
        for i, r in refs.items():
            try:
                out.append(ray.get(r))
            except ray.exceptions.RayActorError:
                pass
            except ray.exceptions.RayTaskError as e:
                log.warning("%s.%s failed: %s", i, method, _short(e))
        self.check()
        return out

    def push_weights(self, push: Callable[[list], dict], version: int) -> dict:
        """`push(handles)` (WeightSyncer.push) of `version` to every live actor. An actor that died,
        or whose engine failed to load (e.g. its server is gone), is retired and handled as a
        death (replacement loads the weights itself); then the push is repeated on the others."""
        import ray

        for _ in range(len(self.actors) + self.cfg.rollout.max_actor_restarts + 1):
            try:
                return push(self.handles)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                log.warning("weight push failed (%s); checking generation actors", _short(e))
                if not self.check() and not self._retire(not_at_version(self.actors, version)):
                    raise
        raise NoGenerationActorsError("weight push kept failing on dying generation actors")

    def _retire(self, actor_ids: list[str]) -> int:
        """Kill these actors and handle them as deaths (leases back, replacements)."""
        import ray

        for i in actor_ids:
            log.warning("retiring generation actor %s: its engine did not load the new weights", i)
            ray.kill(self.actors[i], no_restart=True)
        refs = [self.loops[i] for i in actor_ids if i in self.loops]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=60)
        return self.check()

    def totals(self) -> dict[str, float]:
        """Cumulative engine counters summed over every actor the run has had."""
        import ray

        refs = {i: a.metrics.remote() for i, a in self.actors.items()}
        for i, r in refs.items():
            try:
                self._last[i] = ray.get(r)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
                if i in self._last:
                    self._last[i]["rollout/inflight"] = 0.0
        return engine_totals(self._last)

    def metrics(self) -> dict[str, float]:
        return pool_metrics(self.restarts, alive=len(self.actors), pending=len(self.pending))
