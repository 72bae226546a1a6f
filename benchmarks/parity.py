"""Parity mode vs default on the tiny task, side by side in one run: step time and the lag-0 mismatch.

Runs configs/tiny_cpu.yaml with the sync preset (every token lag 0) twice in this process (embedded
Ray), `model.parity=false` then `true`, same steps and seed, and reports per setting the mean of
timing_s/rollout (generation: the wait for a batch), timing_s/train (the learner step) and
timing_s/step, step 1 left out (it also waits for the engine's first batch), and mismatch/k3_lag0
(exactly 0.0 with parity: docs/algorithms.md, "Parity mode").
Launch (2 CPU cores; about 2 minutes, longer on a busy machine):
    OMP_NUM_THREADS=1 python benchmarks/parity.py [--steps 8] [--out parity.json]
Writes benchmarks/results/<out> and prints a table. Other agents share these cores: figures are contended.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import mode_config, run, write_json

KEYS = ("timing_s/rollout", "timing_s/train", "timing_s/step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="parity.json")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for parity in (False, True):
            cfg = mode_config("sync", Path(tmp), [f"run.steps={args.steps}", f"model.parity={str(parity).lower()}",
                                                  "checkpoint.every=0", "run.seed=1"])
            rows = run(cfg)[1:]
            results["parity" if parity else "default"] = {
                **{k: statistics.mean(r[k] for r in rows) for k in KEYS},
                "mismatch_k3_lag0_max": max(r["mismatch/k3_lag0"] for r in rows),
                "mismatch_k3_lag0_mean": statistics.mean(r["mismatch/k3_lag0"] for r in rows),
            }
    print(f"{'setting':<8} {'generation s':>12} {'learner s':>10} {'step s':>8} {'k3_lag0 max':>12}")
    for name, r in results.items():
        print(f"{name:<8} {r['timing_s/rollout']:>12.3f} {r['timing_s/train']:>10.3f} {r['timing_s/step']:>8.3f} "
              f"{r['mismatch_k3_lag0_max']:>12.3g}")
    d, p = results["default"], results["parity"]
    ratios = {k: p[k] / d[k] for k in KEYS}
    print("parity / default: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(write_json(args.out, {"steps": args.steps, "results": results, "ratios": ratios, "contended": True}))


if __name__ == "__main__":
    main()
