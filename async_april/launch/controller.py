"""The controller: wires store, generation actors and learner, and runs the steps.

`train` is the restart around the step loop (run.max_restarts); `run_loop` is the step loop and reads
as the algorithm: lease a batch, train, push weights, log, checkpoint. The parts it drives and their
lifetimes live in launch/run_parts.py, the controller's saved state in run_state.py, a step's batch and
figures in step_metrics.py; placement, recovery and the memory check in cluster.py, layout.py and
memory_check.py.

    dataset ─> RolloutStore ──lease──> GenerationActor x N ──push samples──┐
                  │  ^                    (engine, C requests in flight)   │
                  │  └─────────────────────────────────────────────────────┘
                  │ get_batch: blocks until B complete groups within eta
                  v
              advantages ─> LearnerGroup.train_step (FSDP2 ranks) ─> version v+1
                                  │ weight buckets (object store / NCCL / disk)
                                  └──> GenerationActor.update_weights (interrupt | drain | continue)
                                       then store.set_version(v+1) reopens admission

What blocks on what: only `get_batch` waits for generation; generation waits
for the learner only when admission control (async.max_staleness) says so.
With the sync preset that happens every step, which is synchronous training.

Faults (docs/reliability.md): a dead generation actor is handled by
`actors/pool.py` (leases back to the store, replacement loads the current
weights); a skipped learner step (non-finite loss) is not broadcast and does
not bump the version; every `checkpoint.every` steps, at the end and on
SIGINT/SIGTERM (`stopping.py`), `async_april/run/checkpoints.py` saves learner +
store + `RunState` atomically; `run.resume` restores them and pushes the
restored weights before generating. A learner rank or the store lost with its node (LearnerLostError,
RayActorError) rebuilds the run from its last checkpoint, up to run.max_restarts, else ends with
the resume command (launch/cluster.py; docs/cluster.md, Multi-node). Bad input never gets this far:
`launch/resolve.py` checks the config against the world before Ray starts.

Run: `async-april train CONFIG [k=v ...]` or `python -m async_april.train CONFIG [k=v ...]`.
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from pathlib import Path

from async_april.config import Config, save_config
from async_april.launch.cluster import (RunStateLost, lost_state_errors, restart_or_raise,  # noqa: F401 - RunStateLost: what train() raises
                                       warn_if_layout_does_not_fit, who_died)
from async_april.launch.node_checks import NodeChecks
from async_april.launch.run_parts import AcrossRebuilds, RunParts
from async_april.launch.run_state import RunState
from async_april.launch.step_metrics import make_batch, step_perf
from async_april.run.console import say
from async_april.run.stopping import GracefulStop, Interrupted
from async_april.run.tracking import Tracker

log = logging.getLogger(__name__)


def train(cfg: Config, on_step=None, learner_factory=None) -> Path:
    """Run `cfg`; `on_step(step, batch, learner)`, if given, sees each trained batch (tests, tools);
    if it takes a `pool` keyword it also gets the `ActorPool` (fault drills: `pool.kill("gen0")`).
    Bad input raises a UserError before Ray starts; a signal raises `Interrupted` once a checkpoint is saved."""
    import ray

    from async_april.run import directory as rundir
    from async_april.launch.rendezvous import check_rendezvous
    from async_april.launch.resolve import check_gpu_resources, resolve

    r = resolve(cfg)
    cfg, run_dir = r.cfg, r.run_dir.path
    run_lock, state = rundir.lock(r.run_dir, cfg)  # held until the run ends: a second run here exits 2
    try:
        moved = rundir.prepare(state, cfg)
        if moved is not None:
            say(f"run.overwrite: moved the previous run to {moved}")
        save_config(cfg, run_dir)  # secrets masked (async_april/run/masking.py)
        for line in r.describe():
            say(line)
        started_ray, tracker, stop, carry = init_ray(cfg), None, GracefulStop(), AcrossRebuilds()
        try:
            check_gpu_resources(cfg, ray.cluster_resources().get("GPU", 0.0))  # before any actor waits for GPUs
            say(check_rendezvous(cfg))  # interfaces per backend; a node that would hang a gloo rendezvous stops here
            # What every node must see (run.dir, a shared model directory, the hub commit the driver pinned);
            # a node first used later (an elastic joiner, a learner rebuilt elsewhere) is probed then.
            checks = NodeChecks(cfg, r.model_path)
            if checked := checks.start():
                say(f"ray: {checked} nodes see run.dir and the model")
                warn_if_layout_does_not_fit(cfg)
            while True:
                tracker = _tracker(cfg, r, run_dir)
                try:
                    with stop:
                        run = run_loop(cfg, r, tracker, stop, on_step, learner_factory, carry, checks)
                    break
                except lost_state_errors() as e:  # a learner rank or the store is gone (its node died)
                    r, carry.restarts = restart_or_raise(cfg, e, carry.restarts), carry.restarts + 1
                    cfg = r.cfg
                    tracker.close()
                    tracker = None
        finally:
            if tracker is not None:
                tracker.close()
            if started_ray:
                ray.shutdown()
    finally:
        run_lock.release()
    say(tracker.summary(run.last_checkpoint))
    if stop.signum is not None and run.step < cfg.run.steps:
        raise Interrupted(stop.signum, run.step, run.last_checkpoint)
    return run_dir


def _tracker(cfg: Config, r, run_dir: Path) -> Tracker:
    resume = r.resume
    same_run = resume is not None and resume.path.parent.parent == run_dir  # W&B rewinds only this run's own
    controller = resume.controller_state() if resume else {}
    return Tracker(cfg, run_dir, resume_step=(resume.step if resume else 0) if cfg.run.resume else None,
                   elapsed_s=controller.get("time/elapsed_s", 0.0),
                   wandb_run_id=resume.manifest.wandb_run_id if same_run else None,
                   checkpoint_row=controller.get("metrics_row"))


def run_loop(cfg: Config, r, tracker: Tracker, stop: GracefulStop, on_step=None, learner_factory=None,
             carry: AcrossRebuilds | None = None, checks: NodeChecks | None = None) -> RunState:
    """The steps, from the resolved run `r` (resolve.Resolved); returns the controller state at the end.
    `carry`: what earlier rebuilds of this run counted; `checks`: the nodes' storage verdicts (a node first
    used now is probed before the actor is used there)."""
    import ray

    carry = carry or AcrossRebuilds()
    parts = RunParts(cfg, r, carry, checks, learner_factory)
    run, store, pool, learner, evaluator = parts.run, parts.store, parts.pool, parts.learner, parts.evaluator
    hook_gets_pool = on_step is not None and "pool" in inspect.signature(on_step).parameters
    try:
        parts.start()
        last = pool.totals()
        stop.arm()
        tracker.start()
        for step in range(run.step + 1, cfg.run.steps + 1):
            t0 = time.perf_counter()
            groups = pool.wait_for_batch(stop=stop.requested)  # lease: B complete groups within eta
            if groups is None:  # a signal while waiting: this step is abandoned, nothing of it trained
                break
            t_wait = time.perf_counter() - t0
            if cfg.rollout.early_stop:
                pool.call_all("early_stop")  # APRIL: the rest abort; their partials resume first, next step
            batch, metrics = make_batch(groups, cfg, learner.version)
            t1 = time.perf_counter()
            metrics.update(learner.train_step(batch))
            t_train = time.perf_counter() - t1
            metrics.update(parts.publish(groups, bad_step=bool(metrics["train/bad_step"])))  # push weights, or skip
            metrics.update(parts.after_step(step))
            now = pool.totals()
            step_s = time.perf_counter() - t0
            metrics.update(ray.get(store.call.remote("metrics")))
            metrics.update(step_perf(last, now, step_s))
            last = now
            run.step = step
            metrics.update(run.metrics(pool, learner.version))
            parts.record.update(store, learner, pool, evaluator)  # actors joined or lost: rewritten
            metrics.update({"timing_s/rollout": t_wait, "timing_s/train": t_train, "timing_s/step": step_s})
            if parts.tuner is not None:  # `auto` settings: the next step's, from this one's figures
                metrics.update(run.tune(parts.tuner, metrics, store))
            if evaluator is not None and step == cfg.run.steps:
                metrics.update(evaluator.finish())  # the final evaluation: nothing is left to train
            tracker.log(metrics)
            if on_step is not None:
                on_step(step, batch, learner, **({"pool": pool} if hook_gets_pool else {}))
            if step == cfg.run.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                run.save(store, learner, pool, tracker)
            if stop.requested():
                break
        parts.finish(stop.requested(), tracker)
    except ray.exceptions.RayActorError as e:  # which actor: the rebuild's message names it
        raise who_died(e, store, learner, pool, evaluator) from e
    finally:
        carry.actor_restarts = pool.restarts
        parts.stop()
    return run


def init_ray(cfg: Config) -> bool:
    """Join the given or surrounding cluster (`ray job submit` sets RAY_ADDRESS), else start an
    embedded one on this machine with its dashboard off (Ray's own ports listen on every interface,
    guarded by its token auth: docs/reliability.md). Returns whether this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    repo_root = str(Path(__file__).resolve().parents[2])
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))}
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        from async_april.launch.resolve import probe_ray_address
        from async_april.run.directory import in_ray_job

        probe_ray_address(cfg)  # a clear error in seconds, not ray.init's minutes of retries
        ray.init(address=address, runtime_env={"env_vars": {k: v for k, v in env.items() if k != "PYTHONPATH"}})
        say(f"ray: joined the cluster at {address}" + (" as a `ray job submit` driver" if in_ray_job() else ""))
        return False
    needed = cfg.rollout.num_actors + cfg.learner.world_size + 1
    ray.init(address="local", num_cpus=max(needed, os.cpu_count() or 1), include_dashboard=False,
             runtime_env={"env_vars": env}, logging_level="WARNING")
    return True
