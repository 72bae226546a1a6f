"""Does the built-in multi-turn task learn in a default CPU run of at most 10 minutes, sync and async?

Trains `configs/tiny_cpu_multiturn.yaml` as it ships (150 steps) with the sync and
async presets layered on top, per seed, one run after the other in this process
(embedded Ray), and reports per run:

- wall: the whole training call (Ray start, engine start, 150 steps, checkpoint),
  and the 150 steps alone; the tiny model's one-off build (~1 min, cached) is not in it;
- reward rise: mean reward of the last 10 steps minus the first 10, and the
  console summary's own (first 10% of steps vs last 20%);
- within 10 minutes: how many steps a run had finished 600 s after the training
  call began, and the rise over those steps.

    python benchmarks/multiturn_learning.py                        # sync and async, seeds 1234 and 7
    python benchmarks/multiturn_learning.py --modes sync --seeds 42

Run it alone on the machine: the figures are wall times. Writes
benchmarks/results/multiturn_tiny_cpu.json (per-step curves included).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import mode_config, read_rows, write_json

from async_april.run.tracking import progress

CONFIG = "configs/tiny_cpu_multiturn.yaml"
BUDGET_S = 600.0
WINDOW = 10


def rise(rewards: list[float], window: int = WINDOW) -> float:
    return statistics.mean(rewards[-window:]) - statistics.mean(rewards[:window])


def summary_rise(rewards: list[float]) -> float:
    """The console's end-of-run line: mean of the first 10% of steps vs the last 20%."""
    first = rewards[: max(1, len(rewards) // 10)]
    last = rewards[-max(1, int(len(rewards) * 0.2)) :]
    return statistics.mean(last) - statistics.mean(first)


def run_one(mode: str, seed: int, tmp: Path) -> dict:
    from async_april.launch.controller import train

    cfg = mode_config(mode, tmp, [f"run.seed={seed}"], base=CONFIG)
    progress(f"{mode} seed {seed}: {cfg.run.steps} steps of {CONFIG}")
    t0 = time.time()
    train(cfg)
    wall = time.time() - t0
    rows = read_rows(cfg.run_dir)
    rewards = [r["rollout/reward_mean"] for r in rows]
    steps_s = rows[-1]["time/elapsed_s"] - (rows[0]["time/elapsed_s"] - rows[0]["timing_s/step"])
    # time/elapsed_s counts from the run's start inside the training call; the call also started Ray
    # and the engines before it, so the budget left for steps is the 600 s minus that lead.
    lead = wall - rows[-1]["time/elapsed_s"]
    in_budget = [r["rollout/reward_mean"] for r in rows if r["time/elapsed_s"] + lead <= BUDGET_S]
    return {
        "mode": mode, "seed": seed, "steps": len(rows),
        "wall_s": wall, "steps_wall_s": steps_s, "step_s_median": statistics.median(r["timing_s/step"] for r in rows),
        "first10": statistics.mean(rewards[:WINDOW]), "last10": statistics.mean(rewards[-WINDOW:]),
        "rise": rise(rewards), "summary_rise": summary_rise(rewards),
        "steps_in_10min": len(in_budget), "rise_in_10min": rise(in_budget) if len(in_budget) >= 2 * WINDOW else None,
        "turns_mean": statistics.mean(r.get("rollout/turns_mean", 0.0) for r in rows),
        "curve": [{"step": r["train/step"], "elapsed_s": r["time/elapsed_s"], "reward_mean": r["rollout/reward_mean"]} for r in rows],
    }


def table(runs: list[dict]) -> str:
    head = (f"{'mode':<7}{'seed':>6}{'wall':>9}{'steps':>8}{'s/step':>8}{'first 10':>10}{'last 10':>9}"
            f"{'rise':>8}{'10%/20%':>9}{'steps<=10min':>13}{'rise<=10min':>12}")
    lines = [head, "-" * len(head)]
    for r in runs:
        in10 = f"{r['rise_in_10min']:+.3f}" if r["rise_in_10min"] is not None else "-"
        lines.append(f"{r['mode']:<7}{r['seed']:>6}{r['wall_s'] / 60:>8.2f}m{r['steps']:>8}{r['step_s_median']:>8.2f}"
                     f"{r['first10']:>10.3f}{r['last10']:>9.3f}{r['rise']:>+8.3f}{r['summary_rise']:>+9.3f}"
                     f"{r['steps_in_10min']:>13}{in10:>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 7])
    ap.add_argument("--modes", nargs="+", choices=("sync", "async"), default=["sync", "async"])
    a = ap.parse_args(argv)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="aa-multiturn-") as tmp:
        for seed in a.seeds:
            for mode in a.modes:
                runs.append(run_one(mode, seed, Path(tmp)))
                write_json("multiturn_tiny_cpu.json", {"config": CONFIG, "budget_s": BUDGET_S, "partial": True, "runs": runs})
    print(table(runs))
    print(f"wrote {write_json('multiturn_tiny_cpu.json', {'config': CONFIG, 'budget_s': BUDGET_S, 'runs': runs})}")


if __name__ == "__main__":
    main()
