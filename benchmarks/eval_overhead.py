"""What evaluation during training costs, and whether held-out reward rises: the tiny CPU config
(default settings: async preset, 200 steps, 256 held-out prompts x (2 samples + greedy) every 20
steps and at the end) run once with evaluation off and once with it on, one after the other in this
process (the same machine state for each).

Reported: the median training step time (`timing_s/step`, which includes the weight export of a due
step) of each run and their ratio; the evaluations requested, completed and skipped (one falls due
while the previous still runs on the cores training leaves idle); each evaluation's held-out mean and
greedy reward by policy version; the training reward of both runs (evaluation must not change it).

    python benchmarks/eval_overhead.py                      # 200 steps each
    python benchmarks/eval_overhead.py --steps 100 --first  # shorter; also evaluate the initial policy
    python benchmarks/eval_overhead.py --first --on-first   # the other order (run-to-run spread)

Writes benchmarks/results/eval_overhead.json and eval_overhead.png (eval reward by version);
with --on-first, eval_overhead_on_first.*.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import RESULTS, REPO, final_reward, read_rows, write_json

from async_april.config import load_config
from async_april.run.plot import eval_curves, plot_curves
from async_april.run.tracking import progress


def run_one(label: str, tmp: Path, overrides: list[str]) -> list[dict]:
    from async_april.launch.controller import train

    cfg = load_config(REPO / "configs/tiny_cpu.yaml",
                      [f"run.dir={tmp}/{label}", "logging.console_every=1000000", *overrides])
    progress(f"{label}: {cfg.run.steps} steps, eval sets {[d.name for d in cfg.eval.datasets]}")
    train(cfg)
    return read_rows(cfg.run_dir)


def describe(rows: list[dict]) -> dict:
    steps = [r["timing_s/step"] for r in rows]
    rewards = [r["rollout/reward_mean"] for r in rows]
    return {
        "steps": len(rows),
        "step_s_median": statistics.median(steps),
        "step_s_mean": statistics.mean(steps),
        "wall_s": rows[-1]["time/elapsed_s"],
        "train_reward_first_10pct": final_reward(rewards[: max(1, len(rows) // 10)], frac=1.0),
        "train_reward_last_20pct": final_reward(rewards),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--first", action="store_true", help="also evaluate the initial policy (eval.before_first_step)")
    ap.add_argument("--on-first", action="store_true",
                    help="run eval-on before eval-off (the other order; writes eval_overhead_on_first.json/png)")
    a = ap.parse_args()
    base = [f"run.steps={a.steps}"]
    name = "eval_overhead_on_first" if a.on_first else "eval_overhead"
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        runs = {"eval-off": [*base, "eval.datasets=[]"], "eval-on": [*base, f"eval.before_first_step={str(a.first).lower()}"]}
        order = ["eval-on", "eval-off"] if a.on_first else ["eval-off", "eval-on"]
        done = {label: run_one(label, tmp, runs[label]) for label in order}
        off, on = done["eval-off"], done["eval-on"]
    last = on[-1]
    evals = [{k.split("/")[-1]: r[k] for k in r if k.startswith("eval/reverse/")} | {"step": r["train/step"],
             "eval_s": r.get("timing_s/eval")} for r in on if "eval/reverse/version" in r]
    result = {
        "config": "configs/tiny_cpu.yaml", "overrides": base, "eval_before_first_step": a.first, "order": order,
        "eval_off": describe(off), "eval_on": describe(on),
        "step_time_ratio_on_over_off": describe(on)["step_s_median"] / describe(off)["step_s_median"],
        "evaluations": {"requested": last["eval/requested"], "completed": last["eval/completed"],
                        "skipped": last["eval/skipped"]},
        "eval_s_median": statistics.median(e["eval_s"] for e in evals) if evals else None,
        "eval_by_version": evals,
    }
    out = write_json(f"{name}.json", result)
    curves = eval_curves(on)
    plot_curves(curves, RESULTS / f"{name}.png", "policy version (step)", "held-out reward (256 prompts)")

    print(f"\n{'run':<10} {'steps':>6} {'median step s':>14} {'mean step s':>12} {'wall s':>8} {'train reward':>20}")
    for label, rows in (("eval off", off), ("eval on", on)):
        s = describe(rows)
        print(f"{label:<10} {s['steps']:>6} {s['step_s_median']:>14.3f} {s['step_s_mean']:>12.3f} {s['wall_s']:>8.1f} "
              f"{s['train_reward_first_10pct']:>9.3f} -> {s['train_reward_last_20pct']:.3f}")
    print(f"\nmedian step time, eval on / off: {result['step_time_ratio_on_over_off']:.3f}x")
    print(f"evaluations: {result['evaluations']}  (median {result['eval_s_median'] or 0:.1f} s each, beside training)")
    print(f"\n{'version':>8} {'mean reward':>12} {'greedy':>8} {'pass@1':>8} {'pass@k':>8} {'length':>8} {'eval s':>7}")
    for e in evals:
        print(f"{int(e['version']):>8} {e['mean_reward']:>12.3f} {e.get('greedy_reward', float('nan')):>8.3f} "
              f"{e['pass@1']:>8.3f} {e['pass@k']:>8.3f} {e['mean_length']:>8.1f} {e['eval_s'] or 0:>7.1f}")
    print(f"\nwrote {out} and {RESULTS / (name + '.png')}")


if __name__ == "__main__":
    main()
