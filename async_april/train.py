"""The controller: wires store, generation actors and learner, and runs the steps.

    dataset ─> RolloutStore ──lease──> GenerationActor x N ──push samples──┐
                  │  ^                    (engine, C requests in flight)   │
                  │  └─────────────────────────────────────────────────────┘
                  │ get_batch: blocks until B complete groups within eta
                  v
              advantages ─> LearnerGroup.train_step (FSDP2 ranks) ─> version v+1
                                  │ weight buckets (object store / NCCL / disk)
                                  └──> GenerationActor.update_weights (interrupt | drain)
                                       then store.set_version(v+1) reopens admission

What blocks on what: only `get_batch` waits for generation; generation waits
for the learner only when admission control (async.max_staleness) says so.
With the sync preset that happens every step, which is synchronous training.

Run: `async-april train CONFIG [k=v ...]` or `python -m async_april.train CONFIG [k=v ...]`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np

from async_april.config import Config, ConfigError, load_config, save_config
from async_april.tracking import Tracker, progress


def train(cfg: Config, on_step=None) -> Path:
    """Run `cfg`; `on_step(step, batch, learner)`, if given, sees each trained batch (tests, tools)."""
    import ray

    from async_april.data import load_prompts
    from async_april.models.tiny import resolve_model_path
    from transformers import AutoTokenizer

    run_dir = cfg.run_dir
    save_config(cfg, run_dir)
    try:
        model_path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    dataset = load_prompts(cfg, AutoTokenizer.from_pretrained(model_path))
    progress(f"run dir {run_dir}; model {model_path}; {len(dataset)} prompts")
    started_ray = init_ray(cfg)
    tracker = Tracker(cfg, run_dir)
    try:
        run_loop(cfg, model_path, dataset, tracker, on_step)
    finally:
        tracker.close()
        if started_ray:
            ray.shutdown()
    return run_dir


def run_loop(cfg: Config, model_path: str, dataset, tracker: Tracker, on_step=None) -> None:
    import ray

    from actors.generation import GenerationActor
    from async_april.store import RolloutStoreActor
    from learners.group import LearnerGroup
    from learners.weight_sync import WeightSyncer

    store = ray.remote(RolloutStoreActor).options(num_cpus=0).remote(cfg, dataset)
    learner = LearnerGroup(cfg, model_path)
    syncer = WeightSyncer.from_config(cfg)
    actors = [
        ray.remote(GenerationActor).options(num_cpus=1, max_concurrency=1000).remote(cfg, f"gen{i}", store, model_path)
        for i in range(cfg.rollout.num_actors)
    ]
    ray.get([a.start.remote() for a in actors])
    loops = [a.run.remote() for a in actors]
    last = _actor_totals(actors)
    try:
        for step in range(1, cfg.run.steps + 1):
            t0 = time.perf_counter()
            groups = _wait_for_batch(store, loops)
            t_wait = time.perf_counter() - t0
            if cfg.rollout.early_stop:
                ray.get([a.early_stop.remote() for a in actors])
            batch, metrics = make_batch(groups, cfg, learner.version)
            t1 = time.perf_counter()
            metrics.update(learner.train_step(batch))
            t_train = time.perf_counter() - t1
            metrics.update(syncer.push(learner, actors, learner.version))
            ray.get(store.call.remote("set_version", learner.version))
            ray.get(store.call.remote("check_accounting"))  # every prompt in exactly one state, or stop
            now = _actor_totals(actors)
            step_s = time.perf_counter() - t0
            metrics.update(ray.get(store.call.remote("metrics")))
            metrics.update(_step_perf(last, now, step_s))
            last = now
            metrics.update({"train/step": step, "train/policy_version": learner.version,
                            "timing_s/wait_data": t_wait, "timing_s/train": t_train, "timing_s/step": step_s})
            tracker.log(metrics)
            if on_step is not None:
                on_step(step, batch, learner)
    finally:
        ray.get([a.stop.remote() for a in actors])
        learner.shutdown()


def _wait_for_batch(store, loops):
    """Block on the store, but fail fast if a generation loop died."""
    import ray

    ref = store.get_batch.remote()
    while True:
        ready, _ = ray.wait([ref], timeout=1.0)
        if ready:
            return ray.get(ref)
        finished, _ = ray.wait(loops, timeout=0, num_returns=len(loops))
        for f in finished:
            ray.get(f)  # raises the actor's error
        if len(finished) == len(loops):
            raise RuntimeError("every generation actor has stopped; no batch can complete")


def make_batch(groups, cfg: Config, version: int):
    """Advantages per group, then the learner's input and the rollout metrics of this batch."""
    import torch

    from async_april.algorithms.advantages import compute_advantages
    from async_april.batch import build_train_batch

    rewards = np.stack([g.rewards for g in groups])
    adv = compute_advantages(torch.from_numpy(rewards), cfg.algorithm.advantage, cfg.algorithm.adv_eps).numpy()
    batch = build_train_batch(groups, adv, version)
    lens = batch.response_lens
    lag = batch.staleness()
    finish = [s.finish_reason for g in groups for s in g.samples]
    parts = [s.reward_parts for g in groups for s in g.samples]
    reward_means = {f"reward/{k}": float(np.mean([p.get(k, 0.0) for p in parts])) for k in cfg.reward.functions}
    return batch, {
        **reward_means,
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()),
        "rollout/response_len_mean": float(lens.mean()),
        "rollout/response_len_max": int(lens.max()),
        "rollout/length_capped_frac": finish.count("length") / len(finish),
        "rollout/tokens": int(lens.sum()),
        "rollout/resumed_samples": sum(s.num_resumes > 0 for g in groups for s in g.samples),
        "staleness/max": int(lag.max()) if lag.size else 0,
        "staleness/mean": float(lag.mean()) if lag.size else 0.0,
    }


def _actor_totals(actors) -> dict[str, float]:
    import ray

    per_actor = ray.get([a.metrics.remote() for a in actors])
    keys = ("perf/engine_busy_s", "perf/engine_idle_s", "perf/engine_generated_tokens", "rollout/inflight", "rollout/reward_errors")
    return {k: float(sum(m[k] for m in per_actor)) for k in keys}


def _step_perf(last: dict, now: dict, step_s: float) -> dict[str, float]:
    busy = now["perf/engine_busy_s"] - last["perf/engine_busy_s"]
    idle = now["perf/engine_idle_s"] - last["perf/engine_idle_s"]
    tokens = now["perf/engine_generated_tokens"] - last["perf/engine_generated_tokens"]
    return {
        "perf/rollout_tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
        "perf/engine_idle_frac": idle / (busy + idle) if busy + idle > 0 else 0.0,
        "rollout/generated_tokens": tokens,
        "rollout/inflight": now["rollout/inflight"],
        "rollout/reward_errors": now["rollout/reward_errors"],
    }


def init_ray(cfg: Config) -> bool:
    """Join the given or surrounding cluster (`ray job submit` sets RAY_ADDRESS), else start an
    embedded one bound to loopback. Returns whether this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    repo_root = str(Path(__file__).resolve().parent.parent)
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [repo_root, os.environ.get("PYTHONPATH")]))}
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env={"env_vars": {k: v for k, v in env.items() if k != "PYTHONPATH"}})
        return False
    needed = cfg.rollout.num_actors + cfg.learner.world_size + 1
    ray.init(address="local", num_cpus=max(needed, os.cpu_count() or 1), include_dashboard=False,
             runtime_env={"env_vars": env}, logging_level="WARNING")
    return True


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    try:
        train(load_config(argv[0], argv[1:]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
