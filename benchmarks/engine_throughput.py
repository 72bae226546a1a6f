"""Torch engine (continuous batching) vs padded `model.generate` in fixed batches, on a long-tail length mix.

What it does: builds a random tiny Qwen2 (async_april.models.tiny), draws N
response lengths from a heavy-tailed distribution (lognormal, clipped), and
forces each request to exactly that length by ignoring EOS (per-request
max_new_tokens). The torch engine runs all N with at most `--max-batch`
requests in flight; the baseline runs `model.generate` on fixed batches of
`--max-batch` prompts, where each batch decodes until its longest member is
done. Useful tokens/s = sum of requested lengths / wall time. Prints a table
and writes benchmarks/results/engine_throughput.json.

Launch:  OMP_NUM_THREADS=1 python benchmarks/engine_throughput.py [--n 64 --max-batch 16 --median 24 --max-len 256]

--admission: the torch engine alone, the same requests admitted two ways: in
batches (the next `--max-batch` start when the last of the previous ones is done,
as when an engine drains for every weight update) and continuously (a new request
whenever one finishes, as with `on_weight_update: continue` or between updates).
Reports tokens per busy second, batch occupancy and the padded share of the
KV positions attended; writes benchmarks/results/engine_admission.json.

    OMP_NUM_THREADS=1 python benchmarks/engine_throughput.py --admission --n 512 --max-batch 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from actors.engine import GenerateRequest, SamplingParams
from actors.engines.torch_engine import TorchEngine


def lengths_and_prompts(n: int, median: float, sigma: float, max_len: int, seed: int):
    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), 1, max_len).astype(int)
    prompts = [np.concatenate([[1], rng.integers(4, 14, size=int(rng.integers(3, 20)))]).astype(np.int64) for _ in range(n)]
    return lens, prompts


async def run_engine(model_dir: str, prompts, lens, max_batch: int) -> tuple[float, int]:
    eng = TorchEngine(model_dir, max_running=max_batch, eos_token_ids=())
    await eng.start()
    warm = GenerateRequest("warm#", prompts[0], SamplingParams(max_new_tokens=4, seed=0))
    await eng.generate(warm)
    t = time.perf_counter()
    res = await asyncio.gather(*(
        eng.generate(GenerateRequest(f"b{i:05d}#", p, SamplingParams(max_new_tokens=int(n), seed=i)))
        for i, (p, n) in enumerate(zip(prompts, lens))))
    dt = time.perf_counter() - t
    await eng.shutdown()
    return dt, sum(len(r.output_ids) for r in res)


async def run_admission(model_dir: str, prompts, lens, max_batch: int, continuous: bool) -> dict:
    """The engine alone; requests admitted continuously or in batches of `max_batch` (see the docstring)."""
    eng = TorchEngine(model_dir, max_running=max_batch, max_batch_tokens=10**9, eos_token_ids=())
    await eng.start()
    reqs = [GenerateRequest(f"a{i:05d}#", p, SamplingParams(max_new_tokens=int(n), seed=i)) for i, (p, n) in enumerate(zip(prompts, lens))]
    t = time.perf_counter()
    if continuous:
        slots = asyncio.Semaphore(max_batch)

        async def one(r):
            async with slots:
                return await eng.generate(r)

        await asyncio.gather(*(one(r) for r in reqs))
    else:
        for s in range(0, len(reqs), max_batch):
            await asyncio.gather(*(eng.generate(r) for r in reqs[s : s + max_batch]))
    wall = time.perf_counter() - t
    st = eng.stats()
    await eng.shutdown()
    return {"wall_s": wall, "tokens": st.generated_tokens, "tokens_per_busy_s": st.generated_tokens / st.busy_s,
            "occupancy": st.batch_rows / st.batch_capacity, "kv_pad_frac": st.kv_pad_slots / st.kv_slots}


def admission(model_dir: str, prompts, lens, args) -> None:
    rows = {mode: asyncio.run(run_admission(model_dir, prompts, lens, args.max_batch, mode == "continuous"))
            for mode in ("batches", "continuous")}
    ratio = rows["continuous"]["tokens_per_busy_s"] / rows["batches"]["tokens_per_busy_s"]
    print(f"{args.n} requests, max batch {args.max_batch}, lengths mean {lens.mean():.1f} max {lens.max()}")
    print(f"{'admission':<12}{'wall s':>8}{'tokens':>9}{'tok/busy s':>12}{'occupancy':>11}{'KV pad':>8}")
    for mode, r in rows.items():
        print(f"{mode:<12}{r['wall_s']:>8.2f}{r['tokens']:>9}{r['tokens_per_busy_s']:>12.0f}{r['occupancy']:>11.2f}{r['kv_pad_frac']:>8.2f}")
    print(f"continuous / batches, tokens per busy second: {ratio:.2f}x")
    out = Path(args.out).parent / "engine_admission.json"
    out.write_text(json.dumps({"config": vars(args), "results": rows, "continuous_vs_batches": ratio,
                               "torch": torch.__version__}, indent=2))
    print("wrote", out)


def run_padded_generate(model_dir: str, prompts, lens, max_batch: int) -> tuple[float, int, int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generate(torch.tensor([prompts[0].tolist()]), max_new_tokens=4, do_sample=True, pad_token_id=0)
    t = time.perf_counter()
    decoded = 0
    for s in range(0, len(prompts), max_batch):
        batch, blens = prompts[s : s + max_batch], lens[s : s + max_batch]
        T = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        mask = torch.zeros(len(batch), T, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, T - len(p) :] = torch.as_tensor(p)
            mask[i, T - len(p) :] = 1
        longest = int(max(blens))  # the batch waits for its longest member (EOS ignored to force lengths)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=True, temperature=1.0, top_k=0, pad_token_id=0)
        decoded += longest * len(batch)
    return time.perf_counter() - t, int(sum(lens)), decoded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--median", type=float, default=24)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_throughput.json"))
    ap.add_argument("--admission", action="store_true", help="continuous vs batch admission on the torch engine alone")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from async_april.models.tiny import build_random_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_random_tiny_model(Path(tmp) / "tiny", seed=0, max_position_embeddings=4096))
        lens, prompts = lengths_and_prompts(args.n, args.median, args.sigma, args.max_len, args.seed)
        if args.admission:
            return admission(model_dir, prompts, lens, args)
        eng_s, eng_tok = asyncio.run(run_engine(model_dir, prompts, lens, args.max_batch))
        gen_s, gen_tok, gen_decoded = run_padded_generate(model_dir, prompts, lens, args.max_batch)
    rows = {
        "torch_engine": {"wall_s": eng_s, "useful_tokens": eng_tok, "useful_tok_per_s": eng_tok / eng_s},
        "padded_generate": {"wall_s": gen_s, "useful_tokens": gen_tok, "decoded_tokens": gen_decoded,
                            "useful_tok_per_s": gen_tok / gen_s},
    }
    speedup = rows["torch_engine"]["useful_tok_per_s"] / rows["padded_generate"]["useful_tok_per_s"]
    result = {"config": vars(args), "lengths": {"mean": float(lens.mean()), "median": float(np.median(lens)),
                                                 "max": int(lens.max()), "p90": float(np.percentile(lens, 90))},
              "results": rows, "speedup": speedup, "torch": torch.__version__}
    print(f"{args.n} requests, max batch {args.max_batch}, lengths mean {lens.mean():.1f} median "
          f"{np.median(lens):.0f} p90 {np.percentile(lens, 90):.0f} max {lens.max()}")
    print(f"{'backend':<18}{'wall s':>9}{'useful tok':>12}{'useful tok/s':>14}")
    for name, r in rows.items():
        print(f"{name:<18}{r['wall_s']:>9.2f}{r['useful_tokens']:>12}{r['useful_tok_per_s']:>14.0f}")
    print(f"speedup (torch engine / padded generate): {speedup:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
