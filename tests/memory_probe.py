"""Peak memory of one real learner step on CPU, for tests/test_memory_plan.py (run in a subprocess).

    python tests/memory_probe.py MODEL_DIR TOKENS ROW_LEN CHECKPOINTING OFFLOAD
    python tests/memory_probe.py head VOCAB HIDDEN POSITIONS CHUNK DTYPE

The second form measures the chunked logprob head's backward alone (learners/chunked_logprobs.py):
the peak RSS (the kernel's VmHWM, reset after the forward) over the RSS before the backward, with
the [vocab, hidden] weight in DTYPE (float32 or bfloat16). Prints one JSON line.

Builds a 1-rank LearnerWorker (gloo) on the model, trains one warm-up step (AdamW allocates its
state lazily), then samples this process's RSS every millisecond through a second step of full
micro-batches (TOKENS tokens of ROW_LEN-token rows). Prints one JSON line: the RSS before the worker
was built and the peak during the measured step, in bytes: what the plan counts (weights, grads,
AdamW, activations, logits) sits between them.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import numpy as np

os.environ["OMP_NUM_THREADS"] = "1"

import torch


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """The process's high-water RSS (VmHWM) since the last `reset_peak_rss`."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS to the current one (proc(5))
        f.write("5")


def head(vocab: int, hidden: int, positions: int, chunk: int, dtype: str) -> dict:
    from learners.chunked_logprobs import chunked_logprobs

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(positions, hidden, generator=g).to(dt).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, generator=g)).to(dt).requires_grad_()
    lp = chunked_logprobs(h, w, torch.randint(0, vocab, (positions,), generator=g), chunk=chunk)
    loss = lp.sum()
    before = rss()
    reset_peak_rss()
    loss.backward()
    return {"before": before, "peak": peak_rss(), "vh": vocab * hidden, "grad_dtype": str(w.grad.dtype)}


def main() -> None:
    if sys.argv[1] == "head":
        torch.set_num_threads(1)
        print(json.dumps(head(*map(int, sys.argv[2:6]), sys.argv[6])))
        return
    model, tokens, row_len, ckpt, offload = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
    from async_april.rollout.batch import TrainBatch
    from async_april.config import config_from_dict
    from learners.worker import LearnerWorker

    torch.set_num_threads(1)
    rows = tokens // row_len
    rng = np.random.default_rng(0)
    prompt = 4
    ids = [rng.integers(4, 14, row_len).astype(np.int64) for _ in range(rows)]
    resp = row_len - prompt
    batch = TrainBatch(ids, np.full(rows, prompt, np.int64), [np.full(resp, -2.0, np.float32)] * rows,
                       [np.zeros(resp, np.int64)] * rows, rng.normal(size=rows).astype(np.float32), policy_version=0)
    cfg = config_from_dict({"learner": {"device": "cpu", "max_tokens_per_microbatch": tokens, "lr": 1e-4,
                                        "activation_checkpointing": ckpt, "offload_optimizer": offload},
                            "rollout": {"max_new_tokens": resp}, "data": {"max_prompt_len": prompt}})
    torch.zeros(1).sum()
    base = rss()
    w = LearnerWorker(cfg, model, master_port=int(sys.argv[6]) if len(sys.argv) > 6 else 29517)
    init = rss()
    w.train_step(batch)
    idle = rss()
    peak, done = [rss()], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            done.wait(0.001)

    t = threading.Thread(target=sample)
    t.start()
    w.train_step(batch)
    done.set()
    t.join()
    print(json.dumps({"base": base, "init": init, "idle": idle, "peak": peak[0], "params": w.num_params}))


if __name__ == "__main__":
    main()
