"""Wall time to a target reward for the sync, APRIL and async modes, and the correction ablation.

Full training runs of the tiny CPU task, per mode and seed, one after the
other in this process (the same machine state for each). Reported per mode:
median over seeds of the wall time until the trailing 10-step mean reward
reaches the target, the final reward (mean of the last 20% of steps), and the
ratio of each median to sync's. A PNG plots reward against wall time.

    python benchmarks/time_to_reward.py                         # 3 modes x 2 seeds
    python benchmarks/time_to_reward.py --seeds 1234 7 --steps 200 --target 0.55
    python benchmarks/time_to_reward.py --modes sync async --seeds 1234 7 42
    python benchmarks/time_to_reward.py --ablation --seeds 1234 7 42 --steps 160
        # sync and async at eta 4: correction direct / decoupled / decoupled with 4 mini-batches / none
    python benchmarks/time_to_reward.py --ablation --with-modes ...   # the async preset too (one run)
    python benchmarks/time_to_reward.py --policies --seeds 1234 7 42   # async, on_weight_update interrupt vs continue
    python benchmarks/time_to_reward.py --corrections --seeds 1234 7 42 --steps 160
        # async at eta 4: direct, decoupled, CISPO, rejection by k3 (sequence max), TRL's off-policy mask,
        # the product sequence weight (issue 29)
    python benchmarks/time_to_reward.py --auto-eta --seeds 1234 7 42   # fixed eta 0, 1, 2, 4 vs async.max_staleness: auto
    python benchmarks/time_to_reward.py --ablation ... --resume   # keep the finished runs of a cut-short benchmark

Writes benchmarks/results/time_to_reward.json (or correction_ablation.json, in_flight_ttr.json,
correction_family.json, auto_eta.json) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import MODES, RESULTS, final_reward, mode_config, reward_curve, run, time_to_target, write_json

from async_april.run.plot import plot_curves
from async_april.run.tracking import progress


ETA4 = ["async.max_staleness=4", "rollout.over_provision=5"]
CORRECTIONS = [
    ("eta4 direct", ["algorithm.correction=direct"]),
    ("eta4 decoupled", ["algorithm.correction=decoupled"]),
    ("eta4 cispo", ["algorithm.loss=cispo"]),
    ("eta4 decoupled cispo", ["algorithm.correction=decoupled", "algorithm.loss=cispo"]),
    ("eta4 reject k3 seq max", ["algorithm.correction=decoupled", "algorithm.rejection.divergence=k3",
                                "algorithm.rejection.level=sequence_max", "algorithm.rejection.high=0.5"]),
    ("eta4 trl off-policy mask", ["algorithm.rejection.divergence=k1", "algorithm.rejection.level=sequence_mean",
                                  "algorithm.rejection.high=0.05", "algorithm.rejection.against=current",
                                  "algorithm.rejection.negative_advantages_only=true"]),
    ("eta4 decoupled seq product", ["algorithm.correction=decoupled", "algorithm.weight_level=sequence_product"]),
]
"""issue 29's correction family beside direct and decoupled; thresholds are starting points, not tuned."""


def run_one(label: str, mode: str, seed: int, steps: int, target: float, tmp: Path, extra: list[str]) -> dict:
    cfg = mode_config(mode, tmp, [f"run.seed={seed}", f"run.steps={steps}", *extra])
    progress(f"{label} seed {seed}: {steps} steps")
    rows = run(cfg)
    curve = reward_curve(rows)
    return {
        "label": label, "mode": mode, "seed": seed, "steps": steps, "overrides": extra,
        "time_to_target_s": time_to_target(curve, target),
        "final_reward": final_reward([r["rollout/reward_mean"] for r in rows]),
        "first_reward": final_reward([r["rollout/reward_mean"] for r in rows[: max(1, len(rows) // 10)]], frac=1.0),
        "wall_s": curve[-1][0],
        "step_s_median": statistics.median(r["timing_s/step"] for r in rows),
        "staleness_max": max(r["staleness/max"] for r in rows),
        "wasted_frac": rows[-1]["rollout/wasted_tokens"] / sum(r["rollout/generated_tokens"] for r in rows),
        "clip_frac_mean": statistics.mean(r.get("loss/clip_frac", 0.0) for r in rows),
        # steps trained at each eta (a fixed eta: all of them; `auto`: where the tuner held it)
        "steps_at_eta": {str(e): sum(1 for r in rows if r.get("async/eta") == e) for e in sorted({r.get("async/eta") for r in rows} - {None})},
        "curve": curve,
    }


def summarize(runs: list[dict], baseline: str) -> list[dict]:
    out = []
    labels = list(dict.fromkeys(r["label"] for r in runs))
    for label in labels:
        rs = [r for r in runs if r["label"] == label]
        ttt = [r["time_to_target_s"] for r in rs]
        reached = [t for t in ttt if t is not None]
        out.append({
            "label": label,
            "time_to_target_s_median": statistics.median(reached) if len(reached) == len(rs) else None,
            "reached": f"{len(reached)}/{len(rs)}",
            "final_reward_median": statistics.median(r["final_reward"] for r in rs),
            "final_reward_per_seed": {r["seed"]: round(r["final_reward"], 4) for r in rs},
            "time_to_target_per_seed": {r["seed"]: r["time_to_target_s"] for r in rs},
            "wasted_frac_max": max(r["wasted_frac"] for r in rs),
            "clip_frac_mean": statistics.mean(r["clip_frac_mean"] for r in rs),
            "step_s_median": statistics.median(r["step_s_median"] for r in rs),
        })
    base = next((s for s in out if s["label"] == baseline), None)
    for s in out:
        if base and base["time_to_target_s_median"] and s["time_to_target_s_median"]:
            s["time_vs_baseline"] = s["time_to_target_s_median"] / base["time_to_target_s_median"]
    return out


def table(summary: list[dict], target: float, baseline: str) -> str:
    head = (f"{'run':<26}{'time to ' + str(target):>14}{'reached':>9}{'x ' + baseline:>9}{'final reward':>14}"
            f"{'per seed':>24}{'step s':>8}{'clip':>7}{'wasted':>8}")
    lines = [head, "-" * len(head)]
    for s in summary:
        t = f"{s['time_to_target_s_median']:.0f}s" if s["time_to_target_s_median"] else "-"
        ratio = f"{s['time_vs_baseline']:.2f}" if "time_vs_baseline" in s else "-"
        per_seed = " / ".join(f"{v:.3f}" for v in s["final_reward_per_seed"].values())
        lines.append(f"{s['label']:<26}{t:>14}{s['reached']:>9}{ratio:>9}{s['final_reward_median']:>14.3f}{per_seed:>24}"
                     f"{s['step_s_median']:>8.2f}{s['clip_frac_mean']:>7.3f}{s['wasted_frac_max']:>8.1%}")
    return "\n".join(lines)


def finished_runs(path: Path, steps: int) -> list[dict]:
    """The runs of an earlier, cut-short invocation that used the same step count."""
    if not path.exists():
        return []
    runs = [r for r in json.loads(path.read_text())["runs"] if r["steps"] == steps]
    progress(f"resuming: {len(runs)} finished runs kept from {path.name}")
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 7])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--target", type=float, default=0.55)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run (sync is the baseline)")
    ap.add_argument("--ablation", action="store_true",
                    help="sync and async at eta 4: correction direct, decoupled (1 and 4 mini-batches), none")
    ap.add_argument("--with-modes", action="store_true", help="with --ablation: also the async preset (time to reward)")
    ap.add_argument("--policies", action="store_true", help="async with on_weight_update interrupt vs continue")
    ap.add_argument("--corrections", action="store_true", help="async at eta 4: the correction family of issue 29")
    ap.add_argument("--auto-eta", action="store_true", help="async at fixed eta 0, 1, 2, 4 vs max_staleness: auto")
    ap.add_argument("--labels", nargs="+", default=None,
                    help="run only the plans with these labels (e.g. 'eta4 direct' 'eta4 cispo'), for a machine without time for all")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in the results JSON (same label, seed and steps) and run only the rest")
    a = ap.parse_args(argv)
    plans = [(mode, mode, []) for mode in MODES if mode in a.modes]
    baseline, name = "sync", "time_to_reward"
    if a.policies:
        plans = [(f"async {p}", "async", [f"rollout.on_weight_update={p}"]) for p in ("interrupt", "continue")]
        baseline, name = "async interrupt", "in_flight_ttr"
    elif a.corrections:
        plans, baseline, name = [(label, "async", ETA4 + extra) for label, extra in CORRECTIONS], "eta4 direct", "correction_family"
    elif a.auto_eta:
        fixed = [(f"eta {e}", "async", [f"async.max_staleness={e}", "rollout.over_provision=5"]) for e in (0, 1, 2, 4)]
        auto = ("eta auto", "async", ["async.max_staleness=auto", "async.auto.max=4", "rollout.over_provision=5"])
        plans, baseline, name = fixed + [auto], "eta 0", "auto_eta"
    elif a.ablation:
        eta4 = ETA4
        plans = [("sync", "sync", [])] + [
            (label, "async", eta4 + extra) for label, extra in [
                ("async eta4 direct", ["algorithm.correction=direct"]),
                ("async eta4 decoupled", ["algorithm.correction=decoupled"]),
                ("async eta4 decoupled 4mb", ["algorithm.correction=decoupled", "learner.mini_batches=4"]),
                ("async eta4 none", ["algorithm.correction=none"]),
            ]
        ]
        name = "correction_ablation"
        if a.with_modes:  # the time-to-reward runs too, sharing the sync runs
            plans.insert(1, ("async", "async", []))
    if a.labels:
        unknown = set(a.labels) - {label for label, _, _ in plans}
        if unknown:
            ap.error(f"--labels {sorted(unknown)}: not among {[label for label, _, _ in plans]}")
        plans = [p for p in plans if p[0] in a.labels]
    runs = finished_runs(RESULTS / f"{name}.json", a.steps) if a.resume else []
    done = {(r["label"], r["seed"]) for r in runs}
    with tempfile.TemporaryDirectory(prefix="aa-ttr-") as tmp:
        for seed in a.seeds:
            for label, mode, extra in plans:
                if (label, seed) in done:
                    continue
                runs.append(run_one(label, mode, seed, a.steps, a.target, Path(tmp), extra))
                # after every run, so that a long benchmark cut short still leaves what it measured
                write_json(name + ".json", {"target": a.target, "partial": True, "summary": summarize(runs, baseline), "runs": runs})
    summary = summarize(runs, baseline)
    print(table(summary, a.target, baseline))
    png = plot_curves({f"{r['label']} s{r['seed']}": r["curve"] for r in runs}, RESULTS / f"{name}.png",
                      xlabel="wall time (s)", ylabel="reward (trailing 10-step mean)", hline=a.target)
    print(f"wrote {write_json(name + '.json', {'target': a.target, 'summary': summary, 'runs': runs})} and {png}")


if __name__ == "__main__":
    main()
