"""A step's batch and figures: advantages and the learner's input from the groups, the rollout
metrics of the batch, and the engines' throughput and occupancy between two steps."""

from __future__ import annotations

import numpy as np

from async_april.config import Config


def make_batch(groups, cfg: Config, version: int):
    """Advantages per group, then the learner's input and the rollout metrics of this batch."""
    import torch

    from async_april.algorithms.advantages import compute_advantages
    from async_april.algorithms.metrics import staleness_metrics, trajectory_staleness
    from async_april.rollout.batch import build_train_batch

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


def step_perf(last: dict, now: dict, step_s: float) -> dict[str, float]:
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
