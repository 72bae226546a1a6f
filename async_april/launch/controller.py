"""The controller: wires store, generation actors and learner, and runs the steps.

Just over 400 lines: the run loop and the restart around it (run.max_restarts) are one control flow;
placement, recovery and the memory check live in launch/cluster.py, layout.py and memory_check.py.

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
SIGINT/SIGTERM (`stopping.py`), `async_april/checkpointing.py` saves learner +
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

import numpy as np

from async_april.auto_staleness import OffPolicyTuner, StepSignals, TunerState, wait_share
from async_april.config import Config, save_config
from async_april.console import say
from async_april.cpu_pinning import CpuPlan, cpu_plan, pin_process, process_cores
from async_april.launch.cluster import (PlacementRecord, RunStateLost, check_shared_storage, lost_state_errors,  # noqa: F401 - RunStateLost: what train() raises
                                       restart_or_raise, warn_if_layout_does_not_fit)
from async_april.stopping import GracefulStop, Interrupted
from async_april.tracking import Tracker

log = logging.getLogger(__name__)


def train(cfg: Config, on_step=None, learner_factory=None) -> Path:
    """Run `cfg`; `on_step(step, batch, learner)`, if given, sees each trained batch (tests, tools);
    if it takes a `pool` keyword it also gets the `ActorPool` (fault drills: `pool.kill("gen0")`).
    Bad input raises a UserError before Ray starts; a signal raises `Interrupted` once a checkpoint is saved."""
    import ray

    from async_april import rundir
    from async_april.launch.rendezvous import check_rendezvous
    from async_april.launch.resolve import check_gpu_resources, resolve

    r = resolve(cfg)
    cfg, run_dir = r.cfg, r.run_dir.path
    run_lock, state = rundir.lock(r.run_dir, cfg)  # held until the run ends: a second run here exits 2
    try:
        moved = rundir.prepare(state, cfg)
        if moved is not None:
            say(f"run.overwrite: moved the previous run to {moved}")
        save_config(cfg, run_dir)  # secrets masked (async_april/masking.py)
        for line in r.describe():
            say(line)
        started_ray, tracker, stop, restarts = init_ray(cfg), None, GracefulStop(), 0
        try:
            check_gpu_resources(cfg, ray.cluster_resources().get("GPU", 0.0))  # before any actor waits for GPUs
            say(check_rendezvous(cfg))  # interfaces per backend; a node that would hang a gloo rendezvous stops here
            if sum(1 for n in ray.nodes() if n.get("Alive")) > 1:
                say(f"ray: {check_shared_storage(cfg, r.model_path)} nodes see run.dir and the model")
                warn_if_layout_does_not_fit(cfg)
            while True:
                tracker = _tracker(cfg, r, run_dir)
                try:
                    with stop:
                        run = run_loop(cfg, r, tracker, stop, on_step, learner_factory, restarts)
                    break
                except lost_state_errors() as e:  # a learner rank or the store is gone (its node died)
                    r, restarts = restart_or_raise(cfg, e, restarts), restarts + 1
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
             restarts: int = 0) -> "RunState":
    """The steps, from the resolved run `r` (resolve.Resolved); returns the controller state at the end.
    `restarts`: times the run was rebuilt from a checkpoint after losing a learner rank or the store."""
    import ray

    from actors.pool import ActorPool
    from async_april.launch.evaluator import Evaluator
    from async_april.placement import actor_options
    from async_april.store import RolloutStoreActor
    from learners.group import LearnerGroup
    from async_april.launch.memory_check import engines_on_learner_gpu
    from learners.weight_sync import WeightSyncer

    resume, model_path = r.resume, str(r.model_path)
    # The store holds the run's state between checkpoints: on the driver's node unless placement.store says otherwise.
    store = ray.remote(RolloutStoreActor).options(num_cpus=0, **actor_options(cfg.placement.store)).remote(cfg, r.dataset)
    # First, so that its engine loads while the learner starts (it dies with this driver if that fails).
    evaluator = Evaluator.create(cfg, model_path, r.eval_sets, resume.step if resume else 0,
                                 resume.controller_state() if resume else None)
    push = lambda handles: syncer.push(learner, handles, learner.version)  # noqa: E731 - to live or new actors
    plan = plan_pinning(cfg)
    pool = ActorPool(cfg, store, model_path, load_weights=push, cpu_plan=plan)
    if engines_on_learner_gpu(cfg):
        # SGLang takes mem_fraction_static of the memory free WHEN IT STARTS (sglang 0.5.23
        # srt/mem_cache/kv_cache_configurator.py `_profile_available_bytes`, pre_model_load_memory measured in
        # srt/distributed/bootstrap.py): start it before a learner on the same GPU takes any (async_april/memory_plan.py).
        try:
            pool.start(cfg.rollout.num_actors)
        except BaseException:
            pool.stop()
            raise
    learner = (learner_factory or LearnerGroup)(cfg, model_path)
    syncer = WeightSyncer.from_config(cfg)
    run = RunState.restore(resume, store, learner, cfg, r.model_shape) if resume is not None else RunState(cfg, r.model_shape)
    run.evaluator, run.restarts = evaluator, restarts
    record = PlacementRecord(cfg)
    hook_gets_pool = on_step is not None and "pool" in inspect.signature(on_step).parameters
    tuner = OffPolicyTuner.from_config(cfg)  # None unless eta or over-provisioning is `auto`
    driver_cores = process_cores()
    try:
        if plan is not None:
            ray.get(store.pin_cpus.remote(plan.other_cores))
            pin_process(plan.other_cores)
        if not pool.actors:
            pool.start(cfg.rollout.num_actors)  # the engines load while the learner's ranks initialise
        if plan is not None and hasattr(learner, "pin_cpus"):
            learner.pin_cpus(plan.other_cores)  # waits for the learner to be ready
        if resume is not None:
            pool.push_weights(push, learner.version)  # restored weights reach every engine before any generation
        ray.get(store.call.remote("set_version", learner.version))
        pool.start_loops()
        record.update(store, learner, pool, evaluator, announce=True)  # run.dir/placement.json
        if evaluator is not None and run.step == 0 and cfg.eval.before_first_step:
            evaluator.submit(learner)
        last = pool.totals()
        stop.arm()
        tracker.start()
        for step in range(run.step + 1, cfg.run.steps + 1):
            t0 = time.perf_counter()
            groups = pool.wait_for_batch(stop=stop.requested)
            if groups is None:  # a signal while waiting: this step is abandoned, nothing of it trained
                break
            t_wait = time.perf_counter() - t0
            if cfg.rollout.early_stop:
                pool.call_all("early_stop")
            batch, metrics = make_batch(groups, cfg, learner.version)
            t1 = time.perf_counter()
            metrics.update(learner.train_step(batch))
            t_train = time.perf_counter() - t1
            if metrics["train/bad_step"]:  # skipped: no broadcast, no new version; its prompts are not trained
                run.bad_steps += 1
                ray.get(store.call.remote("mark_skipped", [g.prompt_index for g in groups]))
            else:
                metrics.update(pool.push_weights(push, learner.version))
                ray.get(store.call.remote("set_version", learner.version))
            pool.check()  # deaths; elastic rollout: actors join where a node has room (rollout.max_actors)
            ray.get(store.call.remote("check_accounting"))  # every prompt in exactly one state, or stop
            if evaluator is not None:  # results that have arrived; a new evaluation if due (never waits)
                metrics.update(evaluator.after_step(step, learner))
            now = pool.totals()
            step_s = time.perf_counter() - t0
            metrics.update(ray.get(store.call.remote("metrics")))
            metrics.update(_step_perf(last, now, step_s))
            last = now
            run.step = step
            metrics.update(run.metrics(pool, learner.version))
            record.update(store, learner, pool, evaluator)  # actors joined or lost: rewritten
            metrics.update({"timing_s/rollout": t_wait, "timing_s/train": t_train, "timing_s/step": step_s})
            if tuner is not None:  # `auto` settings: the next step's, from this one's figures
                metrics.update(run.tune(tuner, metrics, store))
            if evaluator is not None and step == cfg.run.steps:
                metrics.update(evaluator.finish())  # the final evaluation: nothing is left to train
            tracker.log(metrics)
            if on_step is not None:
                on_step(step, batch, learner, **({"pool": pool} if hook_gets_pool else {}))
            if step == cfg.run.steps or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                run.save(store, learner, pool, tracker)
            if stop.requested():
                break
        if stop.requested() and run.step > 0 and run.saved_step != run.step:
            run.save(store, learner, pool, tracker)
        if cfg.checkpoint.export_hf and not stop.requested():
            say(f"exported {learner.export_hf(str(cfg.run_dir / 'hf'))}")
    finally:
        if evaluator is not None:
            evaluator.stop()
        pool.stop()
        learner.shutdown()
        ray.kill(store)  # a restart builds a new one from the checkpoint
        if plan is not None and driver_cores:
            pin_process(driver_cores)  # the caller's process gets its cores back
    return run


class RunState:
    """The controller's own state: step, cumulative counters, where the last checkpoint is."""

    def __init__(self, cfg: Config, model_shape: dict, step: int = 0, bad_steps: int = 0, actor_restarts: int = 0,
                 checkpoint: Path | None = None, tuner: TunerState = TunerState()):
        self.cfg, self.model_shape, self.step, self.bad_steps = cfg, model_shape, step, bad_steps
        self.tuner = tuner
        """`auto` settings: what the tuner remembers (async_april/auto_staleness.py; the settings are the store's)."""
        self.actor_restarts_before = actor_restarts
        self.last_checkpoint = checkpoint
        self.saved_step = step if checkpoint is not None else -1
        self.restarts = 0
        """Times this run rebuilt itself from a checkpoint (run.max_restarts)."""
        self.evaluator = None
        """The run's Evaluator, if it evaluates: its schedule counters are saved with the controller state."""

    @classmethod
    def restore(cls, ck, store, learner, cfg: Config, model_shape: dict) -> "RunState":
        """Learner (model, optimizer, scheduler, RNG, version) and store from checkpoint `ck`."""
        import ray

        from async_april.checkpointing import config_hash

        if ck.manifest.config_hash != config_hash(cfg):
            say(f"warning: the config differs from the one {ck.path} was saved with (settings other than run.*/logging.*)")
        learner.load_checkpoint(str(ck.learner_dir))
        ray.get(store.call.remote("load_state_dict", ck.store_state()))
        c = ck.controller_state()
        return cls(cfg, model_shape, int(c["step"]), int(c["train/bad_steps"]), int(c["rollout/actor_restarts"]),
                   checkpoint=ck.path, tuner=TunerState.from_dict(c.get("async/tuner", {"window": c.get("async/raise_window", [])})))

    def metrics(self, pool, version: int) -> dict[str, float]:
        return {"train/step": self.step, "train/policy_version": version, "train/bad_steps": self.bad_steps,
                "rollout/actor_restarts": self.actor_restarts_before + pool.restarts,
                "rollout/actors_alive": len(pool.actors), "rollout/actors": len(pool.actors),
                "rollout/actors_pending": len(pool.pending), "run/restarts": self.restarts}

    def tune(self, tuner: OffPolicyTuner, metrics: dict[str, float], store) -> dict[str, float]:
        """One decision of the auto-tuner (async_april/auto_staleness.py) from this step's metrics; a
        changed setting goes to the store's admission at once. Returns `async/<knob>` (now in force)
        and `async/<knob>_change` for each tuned knob."""
        import ray

        now = {k.name: metrics[f"async/{k.name}"] for k in tuner.knobs}
        signals = StepSignals.from_metrics(metrics)
        judged = tuner.judged(self.tuner.window, signals)  # for the console line: the wait the decision saw
        new, self.tuner, decision = tuner.decide(now, self.tuner, signals)
        if (warning := tuner.warning(self.tuner)) is not None:
            say(warning)
        out = {}
        for name, value in new.items():
            if value != now[name]:
                setter = "set_max_staleness" if name == "eta" else "set_over_provision"
                ray.get(store.call.remote(setter, int(value) if name == "eta" else value))
                say(f"auto: {decision} {name} {now[name]:g} -> {value:g} (mismatch/ess {metrics.get('mismatch/ess', float('nan')):.3f}, "
                    f"mismatch/k3 {metrics.get('mismatch/k3', float('nan')):.2e}, waited {wait_share(judged):.0%} of the last {len(judged)} step(s))")
            out[f"async/{name}"], out[f"async/{name}_change"] = value, value - now[name]
        return out

    def save(self, store, learner, pool, tracker: Tracker) -> Path:
        import ray

        from async_april.checkpointing import CheckpointManager, config_hash

        t0 = time.perf_counter()
        ck = self.cfg.checkpoint
        controller = {"step": self.step, "policy_version": learner.version, "train/bad_steps": self.bad_steps,
                      "rollout/actor_restarts": self.actor_restarts_before + pool.restarts,
                      "time/elapsed_s": round(tracker.elapsed_s, 3), "async/tuner": self.tuner.to_dict(),
                      "metrics_row": tracker.last_row,  # put back on resume if the crash tore it from metrics.jsonl
                      **(self.evaluator.schedule.state() if self.evaluator is not None else {})}
        path = CheckpointManager(self.cfg.run_dir, ck.keep, ck.verify).save(
            self.step, learner.version, learner, ray.get(store.call.remote("state_dict")), controller,
            tracker.wandb_run_id, config_hash(self.cfg), self.model_shape)
        say(f"checkpoint {path.name} ({time.perf_counter() - t0:.2f}s)")
        self.last_checkpoint, self.saved_step = path, self.step
        return path


def make_batch(groups, cfg: Config, version: int):
    """Advantages per group, then the learner's input and the rollout metrics of this batch."""
    import torch

    from async_april.algorithms.advantages import compute_advantages
    from async_april.algorithms.metrics import staleness_metrics, trajectory_staleness
    from async_april.batch import build_train_batch

    rewards = np.stack([g.rewards for g in groups])
    adv = compute_advantages(torch.from_numpy(rewards), cfg.algorithm.advantage, cfg.algorithm.adv_eps).numpy()
    batch = build_train_batch(groups, adv, version)
    lens = batch.response_lens
    trained = batch.model_lens  # environment tokens (multi-turn) are neither trained nor stale
    lag = staleness_metrics(batch.model_versions(), version)
    samples = [s for g in groups for s in g.samples]
    multi_turn = {"rollout/turns_mean": float(np.mean([s.turns for s in samples])),
                  "rollout/env_tokens": int(lens.sum() - trained.sum())} if cfg.rollout.env else {}
    finish = [s.finish_reason for g in groups for s in g.samples]
    parts = [s.reward_parts for g in groups for s in g.samples]
    reward_means = {f"reward/{k}": float(np.mean([p.get(k, 0.0) for p in parts])) for k in (["env"] if cfg.rollout.env else cfg.reward.functions)}
    return batch, {
        **reward_means,
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()),
        "rollout/response_len_mean": float(lens.mean()),
        "rollout/response_len_max": int(lens.max()),
        "rollout/length_capped_frac": finish.count("length") / len(finish),
        "rollout/tokens": int(trained.sum()),
        **multi_turn,
        "rollout/resumed_samples": sum(s.num_resumes > 0 for g in groups for s in g.samples),
        # Per-token lag in versions; token_lag_* are the same numbers under the loss module's names.
        **lag,
        "staleness/max": int(lag["staleness/token_lag_max"]),
        "staleness/mean": lag["staleness/token_lag_mean"],
        **trajectory_staleness(batch.model_versions(), version),  # versions spanned, oldest lag, lag histograms
    }


def _step_perf(last: dict, now: dict, step_s: float) -> dict[str, float]:
    busy = now["perf/engine_busy_s"] - last["perf/engine_busy_s"]
    idle = now["perf/engine_idle_s"] - last["perf/engine_idle_s"]
    tokens = now["perf/engine_generated_tokens"] - last["perf/engine_generated_tokens"]
    capacity = now["perf/engine_batch_capacity"] - last["perf/engine_batch_capacity"]
    return {
        "perf/rollout_tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "perf/engine_idle_frac": idle / (busy + idle) if busy + idle > 0 else 0.0,
        # How full the decode batch was while busy (engines that report it: torch, simulated).
        "perf/engine_batch_occupancy": (now["perf/engine_batch_rows"] - last["perf/engine_batch_rows"]) / capacity
        if capacity > 0 else 0.0,
        # Of the KV positions the decode steps attended, the padding (torch engine: one left-padded cache).
        "perf/engine_kv_pad_frac": (now["perf/engine_kv_pad_slots"] - last["perf/engine_kv_pad_slots"]) / slots
        if (slots := now["perf/engine_kv_slots"] - last["perf/engine_kv_slots"]) > 0 else 0.0,
        "rollout/generated_tokens": tokens,
        "rollout/inflight": now["rollout/inflight"],
        "rollout/reward_errors": now["rollout/reward_errors"],
        "rollout/reprefill_tokens": now["rollout/reprefill_tokens"],
        # Multi-turn: environment steps, timeouts and failures, cumulative over the run.
        **{k: v for k, v in now.items() if k.startswith("agent/")},
    }


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
        from async_april.rundir import in_ray_job

        probe_ray_address(cfg)  # a clear error in seconds, not ray.init's minutes of retries
        ray.init(address=address, runtime_env={"env_vars": {k: v for k, v in env.items() if k != "PYTHONPATH"}})
        say(f"ray: joined the cluster at {address}" + (" as a `ray job submit` driver" if in_ray_job() else ""))
        return False
    needed = cfg.rollout.num_actors + cfg.learner.world_size + 1
    ray.init(address="local", num_cpus=max(needed, os.cpu_count() or 1), include_dashboard=False,
             runtime_env={"env_vars": env}, logging_level="WARNING")
    return True
