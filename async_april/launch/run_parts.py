"""The parts one run is built from and how long each lives: the rollout store, the evaluator, the
generation actors' pool, the learner and its weight syncer, the placement record and the auto-tuner.
`RunParts` builds them in the order their resources need (an engine that shares the learner's GPU
first), starts them, does the two things a step asks of them besides leasing and training (publish
the new weights, or skip the step; look at the actors and the store afterwards), and stops them all.
A rebuild from a checkpoint builds a new set; `AcrossRebuilds` is what the sets pass on."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from async_april.config import Config
from async_april.hosts.cpu_pinning import CpuPlan, cpu_plan, pin_process, process_cores
from async_april.launch.cluster import PlacementRecord, SharedStorageError, resume_command
from async_april.launch.node_checks import NodeChecks
from async_april.launch.run_state import RunState
from async_april.rollout.auto_staleness import OffPolicyTuner
from async_april.run.console import say
from async_april.run.tracking import Tracker

if TYPE_CHECKING:
    from async_april.launch.resolve import Resolved

log = logging.getLogger(__name__)


class AcrossRebuilds:
    """What a rebuild from a checkpoint must not forget: it happened after the checkpoint was saved."""

    def __init__(self) -> None:
        self.restarts = 0
        """Times the run was rebuilt from a checkpoint after losing a learner rank or the store (run.max_restarts)."""
        self.actor_restarts = 0
        """Generation actor replacements so far (rollout.max_actor_restarts is for the whole run)."""


class RunParts:
    """Store, evaluator, pool, learner, syncer, placement record and tuner of one run (or one rebuild)."""

    def __init__(self, cfg: Config, r: "Resolved", carry: AcrossRebuilds, checks: NodeChecks | None = None,
                 learner_factory=None) -> None:
        """Build the parts from the resolved run `r`; `checks`: the nodes' storage verdicts (a node first
        used now is probed before an actor is used there); `learner_factory(cfg, model_path)` stands in
        for the LearnerGroup (benchmarks' simulated learner)."""
        import ray

        from actors.pool import ActorPool
        from async_april.hosts.placement import actor_options
        from async_april.launch.evaluator import Evaluator
        from async_april.launch.memory_check import engines_on_learner_gpu
        from async_april.rollout.store_actor import RolloutStoreActor
        from learners.group import LearnerGroup
        from learners.weight_sync import WeightSyncer

        self.cfg = cfg
        resume, model_path = r.resume, str(r.model_path)
        self.resume = resume
        # The store holds the run's state between checkpoints: on the driver's node unless placement.store says otherwise.
        self.store = ray.remote(RolloutStoreActor).options(num_cpus=0, **actor_options(cfg.placement.store)).remote(cfg, r.dataset)
        # First, so that its engine loads while the learner starts (it dies with this driver if that fails).
        self.evaluator = Evaluator.create(cfg, model_path, r.eval_sets, resume.step if resume else 0,
                                          resume.controller_state() if resume else None)
        self.plan = plan_pinning(cfg)
        resumed = int(resume.controller_state().get("rollout/actor_restarts", 0)) if resume is not None else 0
        self.pool = ActorPool(cfg, self.store, model_path, load_weights=self.push, cpu_plan=self.plan,
                              restarts_before=max(carry.actor_restarts, resumed), node_checks=checks)
        if engines_on_learner_gpu(cfg):
            # SGLang takes mem_fraction_static of the memory free WHEN IT STARTS (sglang 0.5.23
            # srt/mem_cache/kv_cache_configurator.py `_profile_available_bytes`, pre_model_load_memory measured in
            # srt/distributed/bootstrap.py): start it before a learner on the same GPU takes any (async_april/planning/memory.py).
            try:
                self.pool.start(cfg.rollout.num_actors)
            except BaseException:
                self.pool.stop()
                raise
        try:
            self.learner = learner_factory(cfg, model_path) if learner_factory is not None else \
                LearnerGroup(cfg, model_path, node_check=None if checks is None else lambda nodes: checks.require(nodes, "the learner"))
        except BaseException as e:  # what was built is stopped here, not left to the garbage collector
            if self.evaluator is not None:
                self.evaluator.stop()
            self.pool.stop()
            ray.kill(self.store)
            if not isinstance(e, SharedStorageError) or carry.restarts == 0:
                raise
            # A rebuild placed onto a node that cannot see the run: stop, keeping every checkpoint.
            raise SharedStorageError(f"{e}; the run stopped, its checkpoints are kept: once that node has what it lacks "
                                     f"(or is left out of the cluster), resume with: {resume_command(cfg)}") from None
        self.syncer = WeightSyncer.from_config(cfg)
        self.run = RunState.restore(resume, self.store, self.learner, cfg, r.model_shape) if resume is not None \
            else RunState(cfg, r.model_shape)
        self.run.evaluator, self.run.restarts = self.evaluator, carry.restarts
        self.record = PlacementRecord(cfg)
        self.tuner = OffPolicyTuner.from_config(cfg)  # None unless eta or over-provisioning is `auto`
        self.driver_cores = process_cores()

    def push(self, handles):
        """The learner's current weights and version to `handles` (live engines, or new ones before their first lease)."""
        return self.syncer.push(self.learner, handles, self.learner.version)

    def start(self) -> None:
        """Engines started and holding the learner's weights, their loops running, placement recorded."""
        import ray

        store, pool, learner, plan = self.store, self.pool, self.learner, self.plan
        if plan is not None:
            ray.get(store.pin_cpus.remote(plan.other_cores))
            pin_process(plan.other_cores)
        if not pool.actors:
            pool.start(self.cfg.rollout.num_actors)  # the engines load while the learner's ranks initialise
        if plan is not None and hasattr(learner, "pin_cpus"):
            learner.pin_cpus(plan.other_cores)  # waits for the learner to be ready
        if self.resume is not None:
            pool.push_weights(self.push, learner.version)  # restored weights reach every engine before any generation
        ray.get(store.call.remote("set_version", learner.version))
        pool.start_loops()
        self.record.update(store, learner, pool, self.evaluator, announce=True)  # run.dir/placement.json
        if self.evaluator is not None and self.run.step == 0 and self.cfg.eval.before_first_step:
            self.evaluator.submit(learner)

    def publish(self, groups, bad_step: bool) -> dict[str, float]:
        """The trained weights to every engine and the store's admission reopened at the new version; a
        skipped step (non-finite loss) is not broadcast, bumps no version, and its prompts are not trained."""
        import ray

        if bad_step:
            self.run.bad_steps += 1
            ray.get(self.store.call.remote("mark_skipped", [g.prompt_index for g in groups]))
            return {}
        out = self.pool.push_weights(self.push, self.learner.version)
        ray.get(self.store.call.remote("set_version", self.learner.version))
        return out

    def after_step(self, step: int) -> dict[str, float]:
        """Deaths handled (elastic rollout: actors join where a node has room), every prompt in exactly one
        state (or stop), and the evaluations that have arrived or are due (never waited for)."""
        import ray

        self.pool.check()
        ray.get(self.store.call.remote("check_accounting"))
        return self.evaluator.after_step(step, self.learner) if self.evaluator is not None else {}

    def finish(self, stopped: bool, tracker: Tracker) -> None:
        """After the last step: a checkpoint of the step a signal stopped at, the Hugging Face export."""
        run = self.run
        if stopped and run.step > 0 and run.saved_step != run.step:
            run.save(self.store, self.learner, self.pool, tracker)
        if self.cfg.checkpoint.export_hf and not stopped:
            say(f"exported {self.learner.export_hf(str(self.cfg.run_dir / 'hf'))}")

    def stop(self) -> None:
        import ray

        if self.evaluator is not None:
            self.evaluator.stop()
        self.pool.stop()
        self.learner.shutdown()
        ray.kill(self.store)  # a restart builds a new one from the checkpoint
        if self.plan is not None and self.driver_cores:
            pin_process(self.driver_cores)  # the caller's process gets its cores back


def plan_pinning(cfg: Config) -> CpuPlan | None:
    """run.pin_cpus on a single CPU machine: the core split, or None with a warning saying why not."""
    if not cfg.run.pin_cpus:
        return None
    import ray

    gpu = cfg.rollout.engine == "sglang" or cfg.learner.device == "cuda" or ray.cluster_resources().get("GPU", 0) > 0
    multi_node = sum(1 for n in ray.nodes() if n.get("Alive")) > 1
    if gpu or multi_node:
        plan, why = None, "run.pin_cpus is for CPU runs on one machine; this run has GPUs or several Ray nodes"
    else:
        plan, why = cpu_plan(cfg.rollout.num_actors)
    if plan is None:
        log.warning("not pinning CPUs: %s", why)
    else:
        say(f"pinned CPUs: engines on cores {list(plan.engine_cores)}, learner/store/driver on {list(plan.other_cores)}")
    return plan
