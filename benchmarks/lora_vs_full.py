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
    a = ap.parse_args()
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
