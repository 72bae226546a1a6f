"""GPU check: rollout, learner and weight-sync throughput of a ~0.5B Qwen2, in one process, without Ray.

A randomly initialised Qwen2 shaped like Qwen2.5-0.5B (hidden 896, 24 layers,
14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings, bf16)
is built from a `Qwen2Config` (no model hub, no network) and saved to a temp
directory. Then, each phase wrapped so one failure still reports the others:

    rollout      TorchEngine on cuda: R requests x N new tokens (EOS ignored)   -> rollout tokens/s
    learner      LearnerWorker(cfg, path, rank 0, world 1) on cuda (NCCL, FSDP2),
                 a few GRPO steps on the rollout's samples, packed micro-batches
                 (learner.packing, --padded for the right-padded path) with the
                 chunked logprob head                                          -> learner tokens/s, MFU
    weight_sync  learner full_state_dict (CPU) -> bucketize -> engine.update_weights, and the
                 GPU-resident path iter_weight_buckets(device=cuda) -> update_weights   -> seconds

It needs torch, transformers, numpy, pydantic and pyyaml; never Ray, W&B or SGLang.
Results: a table on stdout and JSON at $OUT/gpu_check.json (else benchmarks/results/gpu_check.json).

Launch: `bash scripts/gpu_check.sh` (runs the gpu-marked tests first), or
`python scripts/gpu_check.py [--requests 64 --new-tokens 256 --steps 3]`;
`python scripts/gpu_check.py --cpu --tiny` is a seconds-long smoke run on CPU (tests use it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

QWEN25_05B = dict(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True,
)  # fmt: skip
"""Qwen2.5-0.5B's shape (~494M parameters)."""
TINY = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=True,
)  # fmt: skip
"""A few-hundred-thousand-parameter stand-in for --tiny (CPU smoke runs)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on CPU (gloo, fp32) instead of CUDA")
    p.add_argument("--tiny", action="store_true", help="a tiny model and workload (smoke test)")
    p.add_argument("--padded", action="store_true", help="right-padded learner micro-batches (learner.packing=false), to compare")
    p.add_argument("--requests", type=int, default=None, help="rollout requests (default 64; tiny 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (default 256; tiny 16)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 64; tiny 8)")
    p.add_argument("--steps", type=int, default=None, help="learner steps (default 3; tiny 2); the first is warm-up")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="weight-sync bucket size in MiB")
    p.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_check.json or benchmarks/results/gpu_check.json)")
    args = p.parse_args(argv)
    small = args.tiny
    args.requests = args.requests or (8 if small else 64)
    args.new_tokens = args.new_tokens or (16 if small else 256)
    args.prompt_len = args.prompt_len or (8 if small else 64)
    args.steps = args.steps or (2 if small else 3)
    return args


def out_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.json"
    return REPO / "benchmarks" / "results" / "gpu_check.json"


def phase(results: dict, name: str, fn: Callable[[], dict]) -> Any:
    """Run one phase; record its figures or its error, never raise."""
    t0 = time.perf_counter()
    try:
        figures = fn()
        results[name] = {"ok": True, **figures, "wall_s": round(time.perf_counter() - t0, 3)}
    except BaseException as e:  # noqa: BLE001 - a failed phase must not hide the others
        if isinstance(e, KeyboardInterrupt):
            raise
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:],
                         "wall_s": round(time.perf_counter() - t0, 3)}
        print(f"[gpu_check] phase {name} failed: {type(e).__name__}: {e}", flush=True)
    return results[name]


def environment(device: str) -> dict:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": device, "cuda_available": torch.cuda.is_available()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_mem_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    for mod in ("pydantic", "ray", "wandb", "sglang"):
        try:
            __import__(mod)
            info[f"has_{mod}"] = True
        except Exception:  # noqa: BLE001 - absence is the information
            info[f"has_{mod}"] = False
    # not `import flash_attn`: flash-attn-4 (from sglang) installs a bare flash_attn namespace without FA2
    from learners.parallelize import flash_attn_2_installed

    info["has_flash_attn_2"] = flash_attn_2_installed()
    return info


def build_model(tiny: bool, dtype: str, root: Path) -> tuple[str, int]:
    """Save a randomly initialised Qwen2 (no tokenizer needed) under root; returns (path, parameters)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = TINY if tiny else QWEN25_05B
    cfg = Qwen2Config(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=0, rope_theta=1e6,
                      rms_norm_eps=1e-6, use_sliding_window=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    n = sum(p.numel() for p in model.parameters())
    path = root / ("tiny-qwen2" if tiny else "qwen2-0.5b-random")
    model.save_pretrained(path)
    return str(path), n


def rollout(engine, args, vocab: int) -> tuple[dict, list]:
    """Submit every request at once; tokens/s over the whole wave (includes prefill)."""
    import numpy as np

    from actors.engine import GenerateRequest, SamplingParams

    rng = np.random.default_rng(0)
    reqs = [GenerateRequest(f"r{i}#", rng.integers(3, vocab, args.prompt_len).astype(np.int64),
                            SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=i))
            for i in range(args.requests)]  # fmt: skip

    async def wave():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    loop = asyncio.get_event_loop()
    t0 = time.perf_counter()
    results = loop.run_until_complete(wave())
    dt = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in results)
    samples = [(q.input_ids, r) for q, r in zip(reqs, results)]
    return {"requests": len(reqs), "new_tokens_each": args.new_tokens, "generated_tokens": tokens,
            "seconds": round(dt, 3), "rollout_tokens_per_s": round(tokens / dt, 1)}, samples  # fmt: skip


def make_train_batch(samples: list, seed: int = 0):
    import numpy as np

    from async_april.rollout.batch import TrainBatch

    rng = np.random.default_rng(seed)
    ids = [np.concatenate([p, np.asarray(r.output_ids, np.int64)]) for p, r in samples]
    return TrainBatch(
        input_ids=ids,
        prompt_lens=np.array([len(p) for p, _ in samples], np.int64),
        behavior_logprobs=[np.asarray(r.logprobs, np.float32) for _, r in samples],
        versions=[np.zeros(len(r.output_ids), np.int64) for _, r in samples],
        advantages=rng.normal(size=len(samples)).astype(np.float32),
        policy_version=0,
    )


def learner_config(device: str, dtype: str, args) -> Any:
    from async_april.config import config_from_dict

    return config_from_dict({
        "model": {"dtype": dtype},
        "learner": {"device": device, "world_size": 1, "lr": 1e-6, "max_tokens_per_microbatch": 16384 if not args.tiny else 256,
                    "packing": not args.padded},
        "rollout": {"max_new_tokens": args.new_tokens, "temperature": 1.0},
        "weight_sync": {"transport": "nccl" if device == "cuda" else "object_store", "bucket_mb": args.bucket_mb},
    }, "gpu_check")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(worker, batch, steps: int) -> dict:
    per_step = []
    for _ in range(steps):
        m = worker.train_step(batch)
        per_step.append(m)
    timed = per_step[1:] or per_step  # the first step pays for allocation and kernel selection
    mean = lambda k: sum(m.get(k, 0.0) for m in timed) / len(timed)  # noqa: E731
    out = {"steps": steps, "sequences": len(batch), "response_tokens": int(batch.num_response_tokens),
           "learner_tokens_per_s": round(mean("perf/learner_tokens_per_s"), 1),
           "step_s": round(mean("timing_s/train"), 3), "peak_mem_gb": round(max(m["perf/peak_mem_gb"] for m in per_step), 2),
           "loss": [round(m["loss/total"], 6) for m in per_step], "finite": all(m["train/bad_step"] == 0 for m in per_step)}  # fmt: skip
    if any("perf/mfu" in m for m in timed):
        out["mfu"] = round(mean("perf/mfu"), 4)
    return out


def weight_sync(worker, engine, bucket_mb: float, device: str) -> dict:
    import torch

    from learners.weight_sync import bucket_nbytes, bucketize

    loop = asyncio.get_event_loop()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    version = engine.version + 1
    t0 = time.perf_counter()
    sd = worker.full_state_dict()
    t1 = time.perf_counter()
    specs = {s.name: s for s in worker.weight_specs()}
    sd = {k: v.to(getattr(torch, specs[k].dtype)) for k, v in sd.items() if k in specs}
    buckets = bucketize(sd, bucket_mb)
    t2 = time.perf_counter()
    loop.run_until_complete(engine.update_weights(buckets, version))
    sync()
    t3 = time.perf_counter()
    out = {"bytes": sum(bucket_nbytes(b) for b in buckets), "buckets": len(buckets),
           "cpu_path_s": round(t3 - t0, 3), "export_full_state_dict_s": round(t1 - t0, 3),
           "bucketize_s": round(t2 - t1, 3), "engine_load_s": round(t3 - t2, 3)}  # fmt: skip
    # GPU-resident path (what the NCCL transport does on the learner side, minus the broadcast):
    # (buckets are gathered here, not lazily inside the engine's thread: the export is collective)
    t4 = time.perf_counter()
    dev_buckets = list(worker.iter_weight_buckets(bucket_mb, device=device))
    sync()
    t5 = time.perf_counter()
    loop.run_until_complete(engine.update_weights(dev_buckets, version + 1))
    sync()
    t6 = time.perf_counter()
    out.update(device_path_s=round(t6 - t4, 3), device_export_s=round(t5 - t4, 3), device_load_s=round(t6 - t5, 3))
    out["engine_version"] = engine.version
    named = dict(engine.model.named_parameters())
    probe = [n for n in sd if n in named]
    probe = [probe[0], probe[len(probe) // 2], probe[-1]]
    out["weights_match"] = all(torch.equal(named[n].detach().cpu(), sd[n].to(named[n].dtype)) for n in probe)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("[gpu_check] no CUDA device; use --cpu for a CPU smoke run", file=sys.stderr)
        return 2
    if device == "cpu":
        torch.set_num_threads(1)
    dtype = "bfloat16" if device == "cuda" else "float32"
    results: dict[str, Any] = {"args": vars(args), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    phase(results, "environment", lambda: environment(device))
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    state: dict[str, Any] = {}

    def do_build():
        t0 = time.perf_counter()
        state["path"], n = build_model(args.tiny, dtype, tmp)
        return {"parameters": n, "build_s": round(time.perf_counter() - t0, 2), "path": state["path"]}

    def do_rollout():
        from actors.engines.torch_engine import TorchEngine

        engine = TorchEngine(state["path"], device=device, dtype=dtype, max_running=args.requests,
                             max_batch_tokens=args.requests * (args.prompt_len + args.new_tokens) + 1, eos_token_ids=(),
                             num_threads=1 if device == "cpu" else None)  # fmt: skip
        asyncio.get_event_loop().run_until_complete(engine.start())
        state["engine"] = engine
        vocab = engine.model.config.vocab_size
        figures, state["samples"] = rollout(engine, args, vocab)
        return figures

    def do_learner():
        from learners.worker import LearnerWorker

        cfg = learner_config(device, dtype, args)
        worker = LearnerWorker(cfg, state["path"], 0, 1, "127.0.0.1", free_port())
        state["worker"] = worker
        batch = make_train_batch(state["samples"])
        return {"parameters": worker.num_params, "packing": cfg.learner.packing, **train(worker, batch, args.steps)}

    def do_sync():
        return weight_sync(state["worker"], state["engine"], args.bucket_mb, device)

    asyncio.set_event_loop(asyncio.new_event_loop())
    phase(results, "build", do_build)
    if results["build"]["ok"]:
        phase(results, "rollout", do_rollout)
    if results.get("rollout", {}).get("ok"):
        phase(results, "learner", do_learner)
    if results.get("learner", {}).get("ok"):
        phase(results, "weight_sync", do_sync)
    if "engine" in state:
        try:
            asyncio.get_event_loop().run_until_complete(state["engine"].shutdown())
        except Exception:  # noqa: BLE001
            pass
    if "worker" in state:
        try:
            state["worker"].shutdown()
        except Exception:  # noqa: BLE001
            pass
    results["ok"] = all(v.get("ok", True) for v in results.values() if isinstance(v, dict) and "ok" in v)
    path = out_path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str))
    print_table(results)
    print(f"[gpu_check] wrote {path}")
    return 0 if results["ok"] else 1


def print_table(r: dict) -> None:
    env = r.get("environment", {})
    rows = [
        ("device", env.get("gpu", env.get("device", "?"))),
        ("parameters", r.get("build", {}).get("parameters")),
        ("rollout tokens/s", r.get("rollout", {}).get("rollout_tokens_per_s")),
        ("rollout seconds", r.get("rollout", {}).get("seconds")),
        ("learner tokens/s", r.get("learner", {}).get("learner_tokens_per_s")),
        ("learner step s", r.get("learner", {}).get("step_s")),
        ("learner MFU", r.get("learner", {}).get("mfu")),
        ("learner peak mem GB", r.get("learner", {}).get("peak_mem_gb")),
        ("weight sync (CPU path) s", r.get("weight_sync", {}).get("cpu_path_s")),
        ("weight sync (device path) s", r.get("weight_sync", {}).get("device_path_s")),
    ]
    for name in ("environment", "build", "rollout", "learner", "weight_sync"):
        if name in r and not r[name].get("ok", True):
            rows.append((f"{name} FAILED", r[name]["error"][:100]))
    width = max(len(k) for k, _ in rows)
    print("-" * (width + 30))
    for k, v in rows:
        print(f"{k:<{width}}  {v if v is not None else '-'}")
    print("-" * (width + 30))


if __name__ == "__main__":
    sys.exit(main())
