"""The evaluation driver: one `EvalActor`, at most one evaluation in flight, never waited for.

What is evaluated, when, and the numbers reported: async_april/evaluation.py (its docstring draws the
flow); the actor that samples and scores: actors/evaluation.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from async_april.config import Config
from async_april.evaluation import EvalSchedule, EvalSet, summarize

log = logging.getLogger(__name__)


@dataclass
class Evaluator:
    """Driver side: one `EvalActor` (none when the run will not evaluate, e.g. one shorter than
    `eval.every`), at most one evaluation in flight (see the module docstring)."""

    cfg: Config
    model_path: str
    sets: list[EvalSet]
    schedule: EvalSchedule
    actor: Any = None
    pending: Any = None
    pending_version: int = -1
    started_at: float = 0.0
    results: list[dict] = field(default_factory=list)

    @classmethod
    def create(cls, cfg: Config, model_path: str, sets: list[EvalSet], step: int,
               controller_state: dict | None) -> "Evaluator | None":
        """The evaluator of a run starting after `step` (its schedule continued from a checkpoint's
        controller state), or None when `eval.datasets` is empty. If the run will evaluate, its actor
        starts its engine now, beside the training engines, without being waited for."""
        if not sets:
            return None
        schedule = EvalSchedule(cfg.eval.every, cfg.run.steps, cfg.eval.at_end)
        if controller_state:
            schedule.restore(controller_state)
        ev = cls(cfg, model_path, sets, schedule)
        if (cfg.eval.before_first_step and step == 0) or schedule.any_due(step):
            ev._actor().start.remote()
        return ev

    def _actor(self):
        if self.actor is None:
            import ray

            from actors.evaluation import EvalActor
            from async_april.hosts.placement import actor_options

            self.actor = ray.remote(EvalActor).options(num_cpus=0, num_gpus=self.cfg.rollout.gpus_per_actor, max_concurrency=4,
                                                       **actor_options(self.cfg.placement.eval)).remote(self.cfg, self.model_path, self.sets)
        return self.actor

    def submit(self, learner) -> None:
        """Evaluate the learner's current weights, unless that version was evaluated already or the
        previous evaluation still runs (then skipped and counted: training never waits for evaluation)."""
        version = learner.version
        if version == self.schedule.last_version:
            return
        if self.pending is not None:
            self.collect()
        if self.pending is not None:
            self.schedule.skipped += 1
            return
        refs = learner.weight_buckets(self.cfg.weight_sync.bucket_mb)  # held by the task until it has loaded them
        self.pending = self._actor().evaluate.remote(refs, version)
        self.pending_version, self.started_at = version, time.perf_counter()
        self.schedule.requested += 1
        self.schedule.last_version = version

    def collect(self, wait: bool = False) -> dict[str, float]:
        """The metrics of the evaluation in flight if it has finished (or, with `wait`, once it has)."""
        import ray

        if self.pending is None:
            return {}
        ready, _ = ray.wait([self.pending], timeout=None if wait else 0)
        if not ready:
            return {}
        pending, self.pending = self.pending, None
        try:
            sets = ray.get(pending)
        except Exception as e:  # noqa: BLE001 - whatever failed (actor death, OOM kill, reward, version check) is the evaluation's
            return self._failed(e)
        self.schedule.completed += 1
        out = {"timing_s/eval": time.perf_counter() - self.started_at}
        for r in sets:
            out.update(summarize(r, self.cfg.eval.k, self.cfg.eval.correct_threshold))
        self.results.append(out)
        return out

    def _failed(self, error: BaseException) -> dict[str, float]:
        """Training never dies with evaluation: count the failure, say why in one line, and drop the actor
        (dead, or holding an engine in an unknown state); the next evaluation starts a new one."""
        import ray

        self.schedule.failed += 1
        reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        log.warning("evaluation of version %d failed (%s: %s); training goes on, the next evaluation gets a new "
                    "eval actor", self.pending_version, type(error).__name__, reason[:300])
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
            self.actor = None
        return {"timing_s/eval": time.perf_counter() - self.started_at,
                **{f"eval/{s.name}/failed": 1.0 for s in self.sets}}

    def after_step(self, step: int, learner) -> dict[str, float]:
        """Called once per step once the new weights are out; never waits: the results that have arrived,
        and a new evaluation if one is due. At the last step an evaluation still running at an older
        version is superseded by the final one (see `finish`)."""
        out = self.collect()
        if self.schedule.due(step):
            if step == self.schedule.steps and learner.version != self.schedule.last_version:
                self.cancel()
            self.submit(learner)
        return {**out, **self.schedule.state()}

    def finish(self) -> dict[str, float]:
        """After the last step: wait for the evaluation in flight (the final one, if due)."""
        return {**self.collect(wait=True), **self.schedule.state()}

    def cancel(self) -> None:
        """Drop the evaluation in flight (counted as skipped); the actor aborts its requests."""
        import ray

        if self.pending is not None:
            ray.cancel(self.pending)
            self.pending = None
            self.schedule.skipped += 1

    def stop(self) -> None:
        import ray

        self.cancel()
        if self.actor is not None:
            ray.kill(self.actor)
