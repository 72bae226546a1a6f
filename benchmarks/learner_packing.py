"""Learner micro-batches: packed vs right-padded tokens/s, and the chunked logprob head's peak memory.

(a) throughput: a small random Qwen2 (hidden 256, 4 layers, 8k vocabulary, built here, fp32, sdpa),
    one long-tailed batch (response lengths from a clipped lognormal: mostly short, a long tail,
    APRIL's shape scaled to CPU), forward + backward of the learner's logprob path over the batch's
    micro-batches (`pack_micro_batches` at the same token budget), packed and padded repeats
    interleaved in one process. Tokens/s counts real tokens only.
(b) memory: forward + backward of the logprobs of N positions under a 152k vocabulary with a small
    hidden size, today's full-logits path (`h @ W^T` then `token_logprobs`) vs `chunked_logprobs`,
    each in its own subprocess; the figure is the growth of peak RSS over the inputs.

    nice -n 10 python benchmarks/learner_packing.py [--positions 4096 2048] [--repeats 3]

Writes benchmarks/results/learner_packing.json (merging --positions runs into what is there).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
OUT = REPO / "benchmarks" / "results" / "learner_packing.json"
VOCAB_MEM = 151_936  # Qwen2.5's vocabulary


def long_tailed_lengths(rng: np.random.Generator, rows: int, cap: int) -> np.ndarray:
    """Response lengths: lognormal (median ~cap/12), clipped to [4, cap]: most rows short, a few at the cap."""
    return np.clip(rng.lognormal(np.log(cap / 12), 1.0, rows), 4, cap).astype(np.int64)


def throughput(args) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learners import packed_attention
    from learners.logprobs import collate, response_logprobs
    from learners.update import pack_micro_batches

    torch.manual_seed(0)
    attn = packed_attention.register()  # the learner's sdpa: packed rows attend row by row, padded ones as sdpa
    cfg = Qwen2Config(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).train()
    model.set_attn_implementation(attn)
    rng = np.random.default_rng(0)
    resp = long_tailed_lengths(rng, args.rows, args.max_response)
    prompts = rng.integers(16, 64, args.rows)
    ids = [rng.integers(1, cfg.vocab_size, p + r).astype(np.int64) for p, r in zip(prompts, resp)]
    blp = [np.zeros(r, np.float32) for r in resp]
    lengths = np.array([len(x) for x in ids])
    real = int(lengths.sum())

    def step(packed: bool) -> float:
        t0 = time.perf_counter()
        for g in pack_micro_batches(lengths, args.budget, packed):
            mb = collate([ids[i] for i in g], prompts[g], [blp[i] for i in g], np.ones(len(g), np.float32), packed=packed)
            lp = response_logprobs(model, mb, 1.0)
            (lp.sum() / real).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step(True), step(False)  # warm-up
    times = {True: [], False: []}
    for _ in range(args.repeats):
        for packed in (True, False):
            times[packed].append(step(packed))
    padded_cost = sum(len(g) * lengths[g].max() for g in pack_micro_batches(lengths, args.budget))
    res = {
        "rows": args.rows, "real_tokens": real, "budget": args.budget, "max_response": args.max_response,
        "response_len_p50": float(np.median(resp)), "response_len_p90": float(np.percentile(resp, 90)),
        "response_len_max": int(resp.max()), "padded_tokens": int(padded_cost),
        "micro_batches_packed": len(pack_micro_batches(lengths, args.budget, True)),
        "micro_batches_padded": len(pack_micro_batches(lengths, args.budget)),
        "packed_s": times[True], "padded_s": times[False],
        "packed_tokens_per_s": real / float(np.median(times[True])),
        "padded_tokens_per_s": real / float(np.median(times[False])),
    }  # fmt: skip
    res["ratio"] = res["packed_tokens_per_s"] / res["padded_tokens_per_s"]
    return res


def memory_child(path: str, positions: int, hidden: int) -> None:
    """One logprob forward + backward; prints the peak-RSS growth over the inputs (bytes)."""
    import torch

    from learners.chunked_logprobs import chunked_logprobs
    from learners.logprobs import token_logprobs

    torch.manual_seed(0)
    h = torch.randn(positions, hidden, requires_grad=True)
    w = (torch.randn(VOCAB_MEM, hidden) * 0.02).requires_grad_(True)
    t = torch.randint(0, VOCAB_MEM, (positions,))
    w.grad = torch.zeros_like(w)  # the parameter's gradient exists in training either way
    # The current RSS, not the high-water mark so far (importing torch may have peaked above it).
    base = int(next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS")).split()[1]) * 1024
    t0 = time.perf_counter()
    lp = token_logprobs(h @ w.t(), t) if path == "full" else chunked_logprobs(h, w, t)
    lp.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"growth_bytes": peak - base, "seconds": time.perf_counter() - t0}))


def memory(positions: int, hidden: int) -> dict:
    out = {}
    for path in ("full", "chunked"):
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONPATH": str(REPO)}
        p = subprocess.run([sys.executable, __file__, "--child", path, str(positions), str(hidden)],
                           capture_output=True, text=True, env=env, check=True)
        out[path] = json.loads(p.stdout.strip().splitlines()[-1])
    logits_gb = positions * VOCAB_MEM * 4 / 1e9
    return {"positions": positions, "hidden": hidden, "vocab": VOCAB_MEM, "fp32_logits_gb": logits_gb,
            "full_growth_gb": out["full"]["growth_bytes"] / 1e9, "chunked_growth_gb": out["chunked"]["growth_bytes"] / 1e9,
            "full_s": out["full"]["seconds"], "chunked_s": out["chunked"]["seconds"],
            "ratio": out["chunked"]["growth_bytes"] / out["full"]["growth_bytes"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        memory_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, nargs="*", default=[4096], help="logprob positions for (b); 8192 needs ~16 GB")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size for (b)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--budget", type=int, default=1024, help="learner.max_tokens_per_microbatch for (a)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    results["note"] = "2 CPU cores; packed and padded repeats interleaved in this run: the ratio is the figure (load on the machine is not recorded)"
    if not args.skip_throughput:
        tp = throughput(args)
        results["throughput"] = tp
        print(f"(a) {tp['rows']} rows, {tp['real_tokens']} real tokens (padded to {tp['padded_tokens']}), budget "
              f"{tp['budget']}, response p50/p90/max {tp['response_len_p50']:.0f}/{tp['response_len_p90']:.0f}/"
              f"{tp['response_len_max']}")
        print(f"{'layout':8} {'micro-batches':>13} {'median s':>9} {'tokens/s':>9}")
        for name in ("packed", "padded"):
            print(f"{name:8} {tp[f'micro_batches_{name}']:>13} {np.median(tp[f'{name}_s']):>9.2f} {tp[f'{name}_tokens_per_s']:>9.0f}")
        print(f"packed / padded tokens/s: {tp['ratio']:.2f}x")
    mem = {int(k): v for k, v in results.get("memory", {}).items()}
    for n in args.positions:
        mem[n] = memory(n, args.hidden)
    results["memory"] = {str(k): mem[k] for k in sorted(mem)}
    print(f"(b) logprob forward+backward, vocab {VOCAB_MEM}, hidden {args.hidden}: peak RSS growth (GB)")
    print(f"{'positions':>9} {'fp32 logits':>11} {'full':>7} {'chunked':>8} {'ratio':>6}")
    for n in sorted(mem):
        m = mem[n]
        print(f"{n:>9} {m['fp32_logits_gb']:>11.2f} {m['full_growth_gb']:>7.2f} {m['chunked_growth_gb']:>8.2f} {m['ratio']:>6.3f}")
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
