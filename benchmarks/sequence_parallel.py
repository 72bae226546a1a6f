"""Longest response that trains at a fixed per-rank memory: sequence_parallel=2 vs 1, side by side.

Every probe is one real learner step (`LearnerWorker.train_step`: forward, backward, optimizer, FSDP2 over
2 gloo ranks on CPU) on a small random Qwen2, in 2 fresh processes; its memory is the larger of the two
ranks' peak RSS (whole process: torch, the model shards, the optimizer, activations, logits). Both layouts
use 2 ranks, so parameters, gradients and optimizer state cost the same per rank:

    sp=1: 2 data-parallel ranks, one row of length L each
    sp=2: 1 sp group of 2 ranks, one row of length L split over them

A binary search (in steps of --step tokens) finds the longest L whose probe stays within --budget-gb.

    nice -n 10 python benchmarks/sequence_parallel.py            # table + benchmarks/results/sequence_parallel.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 16384, "max_position_embeddings": 1 << 17}
"""Small Qwen2 whose memory at long lengths is activations and logits, as at the papers' lengths."""
PROMPT = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, model_path: str, length: int, sp: int, out_dir: str) -> None:
    import numpy as np
    import torch

    from async_april.rollout.batch import TrainBatch
    from async_april.config import config_from_dict
    from learners.worker import LearnerWorker

    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = config_from_dict({"learner": {"world_size": 2, "sequence_parallel": sp, "device": "cpu", "lr": 1e-4,
                                        "max_tokens_per_microbatch": 2 * length}})
    w = LearnerWorker(cfg, model_path, rank, 2, "127.0.0.1", port)
    rows = 2 // sp  # one row per data-parallel group
    rng = np.random.default_rng(0)
    ids = [rng.integers(1, MODEL["vocab_size"], length).astype(np.int64) for _ in range(rows)]
    resp = length - PROMPT
    batch = TrainBatch(ids, np.full(rows, PROMPT, np.int64), [np.full(resp, -9.0, np.float32)] * rows,
                       [np.zeros(resp, np.int64)] * rows, np.ones(rows, np.float32), policy_version=0)
    t0 = time.perf_counter()
    metrics = w.train_step(batch)
    seconds = time.perf_counter() - t0
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
    assert np.isfinite(metrics["loss/total"])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak_gb": peak_gb, "seconds": seconds}))
    w.shutdown()
    del torch


def probe(model_path: str, length: int, sp: int) -> dict:
    """Peak RSS (max over the 2 ranks) and step time of one learner step at `length`."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(_free_port(), model_path, length, sp, out), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    return {"length": length, "peak_gb": max(r["peak_gb"] for r in ranks), "seconds": max(r["seconds"] for r in ranks)}


def longest(model_path: str, sp: int, budget_gb: float, step: int, lo: int, hi: int) -> tuple[int, list[dict]]:
    """Largest multiple of `step` whose probe fits `budget_gb`, and every probe. The bracket [lo, hi] (a guess
    that saves probes: each is a fresh pair of processes) is checked first and widened until lo fits and hi
    does not."""
    probes: list[dict] = []

    def fits(length: int) -> bool:
        p = probe(model_path, length, sp)
        p["fits"] = p["peak_gb"] <= budget_gb
        probes.append(p)
        print(f"  sp={sp} L={length:6d}  peak {p['peak_gb']:.3f} GB  {p['seconds']:.1f} s  "
              f"{'fits' if p['fits'] else 'over'}", flush=True)
        return p["fits"]

    lo, hi = lo // step, hi // step  # in units of `step`
    while not fits(lo * step):
        lo, hi = max(lo // 2, 1), lo
        if lo == 1 and not fits(step):
            return 0, probes
    while fits(hi * step):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid)
    return lo * step, probes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-gb", type=float, default=1.5, help="per-rank peak RSS budget")
    ap.add_argument("--step", type=int, default=256, help="search resolution in tokens (even: sp=2 splits it)")
    ap.add_argument("--sp1-bracket", type=int, nargs=2, default=(2048, 4096), help="first guess for sp=1 (checked)")
    ap.add_argument("--sp2-bracket", type=int, nargs=2, default=(4096, 8192), help="first guess for sp=2 (checked)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sequence_parallel.json"))
    args = ap.parse_args()
    from async_april.models import build_random_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_path = str(build_random_tiny_model(Path(tmp) / "model", seed=0, **MODEL))
        # The two searches run concurrently (each probe is its own pair of processes, so peak RSS is
        # per process and unaffected; only the step times are, and they are not the figure).
        def search(sp: int) -> dict:
            bracket = args.sp1_bracket if sp == 1 else args.sp2_bracket
            best, probes = longest(model_path, sp, args.budget_gb, args.step, *bracket)
            return {"longest": best, "probes": probes}

        with ThreadPoolExecutor(2) as pool:
            results = dict(zip((1, 2), pool.map(search, (1, 2))))
    ratio = results[2]["longest"] / max(results[1]["longest"], 1)
    print(f"\nper-rank budget {args.budget_gb} GB peak RSS, 2 gloo ranks on CPU, Qwen2 {MODEL}")
    print(f"{'layout':28s} {'longest row that trains':>24s} {'of which response':>18s}")
    for sp, name in ((1, "sequence_parallel=1 (2 dp)"), (2, "sequence_parallel=2 (1 sp)")):
        print(f"{name:28s} {results[sp]['longest']:>24d} {results[sp]['longest'] - PROMPT:>18d}")
    print(f"ratio sp=2 / sp=1: {ratio:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "budget_gb": args.budget_gb, "step": args.step, "model": MODEL, "prompt_tokens": PROMPT,
        "sp1": results[1], "sp2": results[2], "ratio": ratio,
        "note": "peak RSS does not depend on other load on the machine; step times do (the two searches run side by side)",
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
