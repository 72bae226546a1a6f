"""Weight-sync throughput and learner memory for a ~50M-parameter Qwen2 on CPU.

What it measures:
  1. per-rank peak memory (max RSS) and step time of one training step at learner
     world size 1 and 2 (FSDP2 over gloo, one thread per rank);
  2. the time to push the full weights from the learner through the Ray object
     store into one receiving actor (which loads each bucket into its own copy of
     the model), at two bucket sizes, with the MB/s and the receiver's peak private-memory
     (USS) growth while loading.

Launch (2+ CPU cores, ~2-3 minutes):
    OMP_NUM_THREADS=1 python benchmarks/weight_sync.py [--buckets 16 256] [--repeats 3]
Writes benchmarks/results/weight_sync.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from async_april.rollout.batch import TrainBatch  # noqa: E402
from async_april.config import config_from_dict  # noqa: E402
from learners.group import LearnerGroup  # noqa: E402
from learners.weight_sync import WeightSyncer, iter_buckets  # noqa: E402

MODEL = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, intermediate_size=2048,
             num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=True)


def build_model(out: Path) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**MODEL)).float()
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def make_batch(rows: int, prompt: int, response: int) -> TrainBatch:
    rng = np.random.default_rng(0)
    ids = [rng.integers(1, MODEL["vocab_size"], prompt + response).astype(np.int64) for _ in range(rows)]
    blp = [np.full(response, -10.0, np.float32) for _ in range(rows)]
    return TrainBatch(ids, np.full(rows, prompt), blp, [np.zeros(response, np.int64)] * rows,
                      rng.normal(size=rows).astype(np.float32), 0)


@ray.remote(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
class Receiver:
    """Stands in for an engine: loads each received bucket into its own model copy."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for p in self.model.parameters():  # from_pretrained may mmap the file: make the pages private now
            p.data = p.data.clone()
        self.params = dict(self.model.named_parameters(remove_duplicate=False))

        self.peak_uss_growth = 0

    def uss_growth_gb(self) -> float:
        """Peak growth of private memory (USS) during updates. Ray's zero-copy buffers live in shared
        memory and count in RSS (max RSS grows by everything read), so USS is what the update costs."""
        return self.peak_uss_growth / 1e9

    def update_weights(self, payload, version: int) -> int:
        import psutil

        proc = psutil.Process()
        base = proc.memory_full_info().uss
        n = 0
        with torch.no_grad():
            for bucket in iter_buckets(payload):
                for name, t in bucket.items():
                    self.params[name].copy_(t)
                    n += 1
                self.peak_uss_growth = max(self.peak_uss_growth, proc.memory_full_info().uss - base)
                del bucket
        return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=float, nargs="+", default=[16.0, 256.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "weight_sync.json"))
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="aa-bench-"))
    n_params = build_model(tmp / "model")
    ray.init(address="local", num_cpus=max(4, max(args.world_sizes) + 2), include_dashboard=False, log_to_driver=False)
    batch = make_batch(rows=8, prompt=32, response=32)
    results: dict = {"params_m": n_params / 1e6, "model": MODEL, "learner": [], "sync": [],
                     "batch": {"rows": 8, "tokens_per_row": 64}, "threads_per_rank": 1}
    try:
        for ws in args.world_sizes:
            cfg = config_from_dict({"learner": {"world_size": ws, "device": "cpu"}})
            group = LearnerGroup(cfg, str(tmp / "model"))
            before = group.peak_mem_gb()
            m = group.train_step(batch)
            m2 = group.train_step(batch)
            after = group.peak_mem_gb()
            results["learner"].append({
                "world_size": ws, "peak_rss_gb_before_step": before, "peak_rss_gb_after_step": after,
                "step_s_first": m["timing_s/train"], "step_s": m2["timing_s/train"],
                "tokens_per_s": m2["perf/learner_tokens_per_s"],
            })  # fmt: skip
            for mb in args.buckets:
                receiver = Receiver.remote(str(tmp / "model"))
                ray.get(receiver.uss_growth_gb.remote())  # wait until it has loaded its model
                syncer = WeightSyncer("object_store", mb)
                times, rates = [], []
                for r in range(args.repeats):
                    out = syncer.push(group, [receiver], version=100 + r)
                    times.append(out["timing_s/weight_sync"])
                    rates.append(out["perf/weight_sync_mb_per_s"])
                uss = ray.get(receiver.uss_growth_gb.remote())
                results["sync"].append({
                    "learner_world_size": ws, "bucket_mb": mb, "buckets": out["weight_sync/buckets"],
                    "total_mb": out["weight_sync/mb"], "median_s": statistics.median(times),
                    "median_mb_per_s": statistics.median(rates), "all_s": times,
                    "receiver_peak_uss_growth_gb": uss,
                })  # fmt: skip
                ray.kill(receiver)
            group.shutdown()
    finally:
        ray.shutdown()

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\nQwen2 {results['params_m']:.1f}M params, fp32, CPU, 1 thread per process")
    print(f"{'world':>5} {'peak RSS/rank GB (after step)':>32} {'step s':>8} {'tok/s':>8}")
    for r in results["learner"]:
        rss = ", ".join(f"{x:.2f}" for x in r["peak_rss_gb_after_step"])
        print(f"{r['world_size']:>5} {rss:>32} {r['step_s']:>8.2f} {r['tokens_per_s']:>8.0f}")
    print(f"\n{'world':>5} {'bucket MB':>9} {'buckets':>7} {'MB':>7} {'median s':>9} {'MB/s':>8} {'recv +USS GB':>12}")
    for s in results["sync"]:
        print(f"{s['learner_world_size']:>5} {s['bucket_mb']:>9.0f} {s['buckets']:>7.0f} {s['total_mb']:>7.1f} "
              f"{s['median_s']:>9.3f} {s['median_mb_per_s']:>8.0f} {s['receiver_peak_uss_growth_gb']:>12.3f}")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
