"""LoRA vs full fine-tuning on the tiny task, side by side in one run: speed, reward rise and weight sync.

Runs configs/tiny_cpu.yaml (full fine-tuning) and configs/tiny_cpu_lora.yaml (LoRA, adapters synced to
the torch engine, which merges them itself) for the same steps and seeds, interleaved, in this process
(embedded Ray), plus LoRA with merged weights synced (`learner.lora.sync=merged`, the SGLang path). No
held-out evaluation. Per setting:
  speed     trained tokens/s (the run summary's figure: trained tokens over step time, step 1 left out:
            it also waits for the engine's first batch) and the mean step split into generation (the
            wait for a batch, timing_s/rollout), learner (timing_s/train), weight sync
            (timing_s/weight_sync: export to every engine loaded) and the rest; the learner's median
            step and tokens/s
  learning  the reward of the first 5 steps and of the last 20% of steps (their difference is the rise)
  sync      MB per step
Launch (2 CPU cores; about 3 minutes per run, longer on a busy machine):
    OMP_NUM_THREADS=1 python benchmarks/lora_vs_full.py [--steps 40] [--seeds 1 2] [--merged-seeds 1] [--out lora_vs_full.json]
Writes benchmarks/results/<out> and prints two tables (speed, learning).

`--learner-only` times the learner step alone, full vs LoRA, on random Qwen2 models of the tiny model's
shape at several widths (hidden H, intermediate 4H, 4 layers, LoRA rank 16 on every linear layer as in
tiny_cpu_lora.yaml), one in-process learner rank, the same 128-row batch (tiny task lengths, packed,
512-token micro-batches): where LoRA's per-module cost stops mattering (~3 minutes; --with-peft-forward
adds LoRA on peft's own forward, what the learner ran before `lora.lean_forward`):
    OMP_NUM_THREADS=1 python benchmarks/lora_vs_full.py --learner-only [--hidden 128 256 512] [--learner-steps 3] \
        [--with-peft-forward]
Writes benchmarks/results/lora_learner_width.json and prints a table.

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
        "setting": name, "seed": seed, "steps": len(rows), "wall_s": wall, **speed(rows),
        "reward_first5": statistics.mean(rewards[:5]), "reward_last20pct": final_reward(rewards),
        "rise": final_reward(rewards) - statistics.mean(rewards[:5]),
        "sync_mb_per_step": statistics.mean(r["weight_sync/mb"] for r in sync),
        "sync_s_per_step_median": statistics.median(r["timing_s/weight_sync"] for r in sync),
        "sync_s_per_step_mean": statistics.mean(r["timing_s/weight_sync"] for r in sync),
        "train_s_per_step_median": statistics.median(r["timing_s/train"] for r in rows),
        "rewards": rewards,
    }


PHASES = {"generation": "timing_s/rollout", "learner": "timing_s/train", "sync": "timing_s/weight_sync"}
"""The step's parts: the wait for a batch, the learner step, the push to every engine (controller.py)."""


def speed(rows: list[dict]) -> dict:
    """Trained tokens/s over steps 2.. and the mean seconds of a step and of each of its parts (module
    docstring): means, so that the parts add up to the step and tokens / step time is the tokens/s."""
    later = rows[1:] or rows
    out = {"trained_tokens_per_s": sum(r["rollout/tokens"] for r in later) / sum(r["timing_s/step"] for r in later),
           "learner_tokens_per_s_median": statistics.median(r["perf/learner_tokens_per_s"] for r in later),
           "step_s_mean": statistics.mean(r["timing_s/step"] for r in later),
           "learner_s_median": statistics.median(r["timing_s/train"] for r in later)}
    for part, key in PHASES.items():
        out[f"{part}_s_mean"] = statistics.mean(r.get(key, 0.0) for r in later)
    out["other_s_mean"] = out["step_s_mean"] - sum(out[f"{p}_s_mean"] for p in PHASES)
    return out


def learner_widths(hidden_sizes: list[int], steps: int, rank: int, peft_forward: bool) -> list[dict]:
    """The learner step alone, full vs LoRA (and with `peft_forward` LoRA on peft's own forward), per width
    (module docstring): wall and CPU seconds per step, median of 2 x `steps` (each setting runs twice, in
    A B B A order, `steps` after one warm-up step each; CPU time is this process's, less moved by other jobs)."""
    import numpy as np
    import torch

    from async_april.rollout.batch import TrainBatch
    from async_april.config import config_from_dict
    from async_april.models import build_random_tiny_model
    from learners import lora
    from learners.worker import LearnerWorker
    from tests.test_learner import free_port

    torch.set_num_threads(1)

    def batch(seed: int) -> TrainBatch:  # 128 rows as the tiny task's: prompts of 8-19 tokens, long-tailed responses
        rng = np.random.default_rng(seed)
        ids, plens, blp = [], [], []
        for _ in range(128):
            p, r = int(rng.integers(8, 20)), int(min(48, rng.geometric(0.08)))
            ids.append(rng.integers(4, 19, p + r).astype(np.int64))
            plens.append(p)
            blp.append(np.full(r, -2.5, np.float32))
        return TrainBatch(ids, np.array(plens), blp, [np.zeros(len(b), np.int64) for b in blp],
                          rng.normal(size=128).astype(np.float32), policy_version=0)

    tmp = Path(tempfile.mkdtemp(prefix="aa-lora-width-"))
    out = []
    for hidden in hidden_sizes:
        path = build_random_tiny_model(tmp / f"h{hidden}", seed=0, hidden_size=hidden, intermediate_size=4 * hidden,
                                       num_hidden_layers=4, num_attention_heads=max(1, hidden // 32),
                                       num_key_value_heads=max(1, hidden // 32))
        names = ["full", "lora", *(["lora_peft_forward"] if peft_forward else [])]
        times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names}
        for name in [*names, *reversed(names)]:  # A B B A: a drift in the machine's load hits both alike
            learner = {"device": "cpu", "max_tokens_per_microbatch": 512}
            if name != "full":
                learner["lora"] = {"enabled": True, "rank": rank, "alpha": 2.0 * rank}
            lean = lora.use_lean_forward
            if name == "lora_peft_forward":  # what the learner ran before lean_forward, for the comparison
                lora.use_lean_forward = lambda model: 0
            try:
                w = LearnerWorker(config_from_dict({"learner": learner}), str(path), 0, 1, "127.0.0.1", free_port())
            finally:
                lora.use_lean_forward = lean
            try:
                w.train_step(batch(0))
                for i in range(steps):
                    t0, c0 = time.perf_counter(), time.process_time()
                    m = w.train_step(batch(1 + i))
                    times[name][0].append(time.perf_counter() - t0)
                    times[name][1].append(time.process_time() - c0)
                trainable = sum(p.numel() for p in w.model.parameters() if p.requires_grad)
            finally:
                w.shutdown()
            if len(times[name][0]) == 2 * steps:
                wall, cpu = times[name]
                out.append({"hidden": hidden, "setting": name, "base_params_m": w.num_params / 1e6,
                            "trainable_m": trainable / 1e6, "wall_s_median": statistics.median(wall),
                            "cpu_s_median": statistics.median(cpu), "tokens_per_step": m["train/response_tokens"],
                            "wall_s": wall, "cpu_s": cpu})
    return out


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
            **{k: statistics.mean(r[k] for r in rs) for k in speed_keys()},
        }
    return out


def speed_keys() -> list[str]:
    return ["trained_tokens_per_s", "learner_tokens_per_s_median", "learner_s_median", "step_s_mean",
            *(f"{p}_s_mean" for p in PHASES), "other_s_mean"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--merged-seeds", type=int, nargs="*", default=[1])
    ap.add_argument("--sync-only", action="store_true", help="only the 50M-parameter weight-sync comparison")
    ap.add_argument("--sync-repeats", type=int, default=5)
    ap.add_argument("--out", default="lora_vs_full.json", help="results file name under benchmarks/results/")
    ap.add_argument("--learner-only", action="store_true", help="only the learner step, full vs LoRA, per width")
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--learner-steps", type=int, default=3)
    ap.add_argument("--with-peft-forward", action="store_true", help="--learner-only: also LoRA on peft's own forward")
    a = ap.parse_args()
    if a.learner_only:
        rank = load_config(REPO / "configs/tiny_cpu_lora.yaml").learner.lora.rank
        rows = learner_widths(a.hidden, a.learner_steps, rank, a.with_peft_forward)
        out = write_json("lora_learner_width.json", {"note": "2 shared CPU cores, other jobs running: timings contended",
                                                     "lora_rank": rank, "results": rows})
        print(f"{'hidden':>6} {'setting':17} {'base M':>7} {'trained M':>9} {'wall s/step':>11} {'cpu s/step':>10} "
              f"{'vs full (cpu)':>13}")
        for r in rows:
            full = next(x for x in rows if x["hidden"] == r["hidden"] and x["setting"] == "full")
            print(f"{r['hidden']:>6} {r['setting']:17} {r['base_params_m']:>7.2f} {r['trainable_m']:>9.3f} "
                  f"{r['wall_s_median']:>11.3f} "
                  f"{r['cpu_s_median']:>10.3f} {r['cpu_s_median'] / full['cpu_s_median']:>13.2f}")
        print(f"wrote {out}")
        return
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
    out = write_json(a.out, {
        "steps": a.steps, "lora": lora_cfg.lora.model_dump(), "lora_lr": lora_cfg.lr,
        "full_lr": load_config(REPO / "configs/tiny_cpu.yaml").learner.lr,
        "note": "2 shared CPU cores, other jobs running: timings contended", "summary": table, "runs": runs})
    print(f"{'setting':14} {'trained tok/s':>13} {'vs full':>7} {'step s':>7} {'generation':>10} {'learner':>8} "
          f"{'sync':>6} {'other':>6} {'learner s (median)':>18} {'learner tok/s':>13}   (steps 2..; seconds: means)")
    for name, s in table.items():
        ratio = s["trained_tokens_per_s"] / table["full"]["trained_tokens_per_s"] if "full" in table else float("nan")
        print(f"{name:14} {s['trained_tokens_per_s']:>13.0f} {ratio:>7.2f} {s['step_s_mean']:>7.3f} "
              f"{s['generation_s_mean']:>10.3f} {s['learner_s_mean']:>8.3f} {s['sync_s_mean']:>6.3f} "
              f"{s['other_s_mean']:>6.3f} {s['learner_s_median']:>18.3f} {s['learner_tokens_per_s_median']:>13.0f}")
    print(f"{'setting':14} {'seeds':>6} {'reward 1-5':>10} {'last 20%':>9} {'rise':>7} {'rise min..max':>14} "
          f"{'sync MB/step':>12} {'sync s/step':>11} {'train s/step':>12}")
    for name, s in table.items():
        print(f"{name:14} {len(s['seeds']):>6} {s['reward_first5']:>10.3f} {s['reward_last20pct']:>9.3f} "
              f"{s['rise_mean']:>+7.3f} {s['rise_min']:>+6.3f}..{s['rise_max']:<+6.3f} {s['sync_mb_per_step']:>12.3f} "
              f"{s['sync_s_per_step_median']:>11.4f} {s['train_s_per_step_median']:>12.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
