"""LoRA vs full fine-tuning on the tiny task, side by side in one run: reward rise and weight sync.

Runs configs/tiny_cpu.yaml (full fine-tuning) and configs/tiny_cpu_lora.yaml (LoRA, adapters synced to
the torch engine, which merges them itself) for the same steps and seeds, one after the other in this
process (embedded Ray), plus LoRA with merged weights synced (`learner.lora.sync=merged`, the SGLang
path) for the weight-sync comparison. No held-out evaluation. Per setting it reports the reward of
the first 5 steps and of the last 20% of steps (their difference is the rise), the seed spread, and
the weight sync per step: MB sent and seconds (timing_s/weight_sync, learner export to every engine
loaded).

Launch (2 CPU cores; about 3 minutes per run, longer on a busy machine):
    OMP_NUM_THREADS=1 python benchmarks/lora_vs_full.py [--steps 40] [--seeds 1 2] [--merged-seeds 1]
Writes benchmarks/results/lora_vs_full.json and prints a table.

The tiny model's sync is mostly fixed cost (4 MB in all), so `--sync-only` compares the three
settings' weight sync alone on a 50M-parameter Qwen2 (same LoRA rank as tiny_cpu_lora.yaml, one
learner rank, object store, a real TorchEngine receiving; ~3 minutes):
    OMP_NUM_THREADS=1 python benchmarks/lora_vs_full.py --sync-only [--sync-repeats 5]
Writes benchmarks/results/lora_weight_sync.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from common import REPO, final_reward, read_rows, write_json  # noqa: E402

from async_april.config import load_config  # noqa: E402

SETTINGS = {
    "full": ("configs/tiny_cpu.yaml", []),
    "lora_adapter": ("configs/tiny_cpu_lora.yaml", ["learner.lora.sync=adapter"]),
    "lora_merged": ("configs/tiny_cpu_lora.yaml", ["learner.lora.sync=merged"]),
}


def one_run(name: str, seed: int, steps: int, tmp: Path) -> dict:
    from async_april.launch.controller import train

    path, extra = SETTINGS[name]
    cfg = load_config(REPO / path, [f"run.dir={tmp}/{name}-{seed}-{time.time_ns()}", f"run.steps={steps}",
                                    f"run.seed={seed}", "eval.datasets=[]", "logging.console_every=1000000", *extra])
    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    rows = read_rows(cfg.run_dir)
    rewards = [r["rollout/reward_mean"] for r in rows]
    sync = [r for r in rows if "timing_s/weight_sync" in r]
    return {
        "setting": name, "seed": seed, "steps": len(rows), "wall_s": wall,
        "reward_first5": statistics.mean(rewards[:5]), "reward_last20pct": final_reward(rewards),
        "rise": final_reward(rewards) - statistics.mean(rewards[:5]),
        "sync_mb_per_step": statistics.mean(r["weight_sync/mb"] for r in sync),
        "sync_s_per_step_median": statistics.median(r["timing_s/weight_sync"] for r in sync),
        "sync_s_per_step_mean": statistics.mean(r["timing_s/weight_sync"] for r in sync),
        "train_s_per_step_median": statistics.median(r["timing_s/train"] for r in rows),
        "rewards": rewards,
    }


def sync_side_by_side(repeats: int, rank: int) -> list[dict]:
    """Weight sync alone on benchmarks/weight_sync.py's 50M-parameter Qwen2, where the bytes matter: a
    learner group (world size 1, one step trained so the adapters are not zero) pushes through the
    object store to a real TorchEngine in a Ray actor (which, for adapters, merges them into its kept
    base), `repeats` times per setting after a first push that also starts the engine; median seconds
    and MB per push."""
    import ray

    from async_april.config import config_from_dict
    from learners.group import LearnerGroup
    from learners.weight_sync import WeightSyncer, iter_buckets
    from weight_sync import build_model, make_batch

    @ray.remote(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    class EngineActor:
        def __init__(self, path: str) -> None:
            from actors.engines.torch_engine import TorchEngine

            self.engine = TorchEngine(path, num_threads=1)

        async def update_weights(self, payload, version: int) -> int:
            await self.engine.start()
            await self.engine.update_weights(iter_buckets(payload), version)
            return self.engine.version

    tmp = Path(tempfile.mkdtemp(prefix="aa-lora-sync-"))
    params = build_model(tmp / "model")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    out = []
    try:
        for name, lora in (("full", None), ("lora_adapter", "adapter"), ("lora_merged", "merged")):
            learner = {"device": "cpu", "lr": 1e-3}
            if lora:
                learner["lora"] = {"enabled": True, "rank": rank, "alpha": 2.0 * rank, "sync": lora}
            group = LearnerGroup(config_from_dict({"learner": learner}), str(tmp / "model"))
            group.train_step(make_batch(rows=4, prompt=16, response=16))
            engine = EngineActor.remote(str(tmp / "model"))
            syncer = WeightSyncer("object_store", 64.0)
            first = syncer.push(group, [engine], version=1)  # starts the engine (loads the model): not counted
            pushes = [syncer.push(group, [engine], version=v) for v in range(2, repeats + 2)]
            out.append({"setting": name, "params_m": params / 1e6, "lora_rank": rank if lora else None,
                        "mb": pushes[-1]["weight_sync/mb"], "first_push_s_with_engine_start": first["timing_s/weight_sync"],
                        "median_s": statistics.median(p["timing_s/weight_sync"] for p in pushes),
                        "all_s": [p["timing_s/weight_sync"] for p in pushes]})
            ray.kill(engine)
            group.shutdown()
    finally:
        ray.shutdown()
    return out


def summary(runs: list[dict]) -> dict[str, dict]:
    out = {}
    for name in SETTINGS:
        rs = [r for r in runs if r["setting"] == name]
        if not rs:
            continue
        rises = [r["rise"] for r in rs]
        out[name] = {
            "seeds": [r["seed"] for r in rs],
            "rise_mean": statistics.mean(rises), "rise_min": min(rises), "rise_max": max(rises),
            "reward_first5": statistics.mean(r["reward_first5"] for r in rs),
            "reward_last20pct": statistics.mean(r["reward_last20pct"] for r in rs),
            "sync_mb_per_step": statistics.mean(r["sync_mb_per_step"] for r in rs),
            "sync_s_per_step_median": statistics.median(r["sync_s_per_step_median"] for r in rs),
            "train_s_per_step_median": statistics.median(r["train_s_per_step_median"] for r in rs),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--merged-seeds", type=int, nargs="*", default=[1])
    ap.add_argument("--sync-only", action="store_true", help="only the 50M-parameter weight-sync comparison")
    ap.add_argument("--sync-repeats", type=int, default=5)
    a = ap.parse_args()
    if a.sync_only:
        rank = load_config(REPO / "configs/tiny_cpu_lora.yaml").learner.lora.rank
        rows = sync_side_by_side(a.sync_repeats, rank)
        out = write_json("lora_weight_sync.json", {"note": "2 shared CPU cores, other jobs running: timings contended",
                                                   "object_store": True, "bucket_mb": 64.0, "results": rows})
        print(f"{'setting':14} {'params M':>8} {'MB/push':>9} {'median s/push':>13}  all s")
        for r in rows:
            print(f"{r['setting']:14} {r['params_m']:>8.1f} {r['mb']:>9.2f} {r['median_s']:>13.3f}  "
                  + " ".join(f"{x:.3f}" for x in r["all_s"]))
        print(f"wrote {out}")
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in a.seeds:  # interleaved, so machine load drifts over both settings alike
            for name in ("full", "lora_adapter"):
                runs.append(one_run(name, seed, a.steps, Path(tmp)))
        for seed in a.merged_seeds:
            runs.append(one_run("lora_merged", seed, a.steps, Path(tmp)))
    table = summary(runs)
    lora_cfg = load_config(REPO / "configs/tiny_cpu_lora.yaml").learner
    out = write_json("lora_vs_full.json", {
        "steps": a.steps, "lora": lora_cfg.lora.model_dump(), "lora_lr": lora_cfg.lr,
        "full_lr": load_config(REPO / "configs/tiny_cpu.yaml").learner.lr,
        "note": "2 shared CPU cores, other jobs running: timings contended", "summary": table, "runs": runs})
    print(f"{'setting':14} {'seeds':>6} {'reward 1-5':>10} {'last 20%':>9} {'rise':>7} {'rise min..max':>14} "
          f"{'sync MB/step':>12} {'sync s/step':>11} {'train s/step':>12}")
    for name, s in table.items():
        print(f"{name:14} {len(s['seeds']):>6} {s['reward_first5']:>10.3f} {s['reward_last20pct']:>9.3f} "
              f"{s['rise_mean']:>+7.3f} {s['rise_min']:>+6.3f}..{s['rise_max']:<+6.3f} {s['sync_mb_per_step']:>12.3f} "
              f"{s['sync_s_per_step_median']:>11.4f} {s['train_s_per_step_median']:>12.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
