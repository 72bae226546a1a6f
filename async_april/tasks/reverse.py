"""Synthetic digit-reversal task: the built-in CPU task.

A prompt is a digit string followed by `=` ("3141="); the answer is the same
digits reversed ("1413"). Lengths are drawn from a heavy-tailed mix so that
response lengths have a long tail (the p90 answer length is over 4x the
median), which is what makes partial rollouts matter: most samples finish
quickly while a few run long.

Rows are deterministic from the seed (numpy Generator).
"""

from __future__ import annotations

import numpy as np

LENGTH_BUCKETS: tuple[tuple[int, int], ...] = ((2, 5), (6, 10), (12, 40))
"""Inclusive ranges of the digit-string length L; L is uniform within a bucket."""
LENGTH_PROBS: tuple[float, ...] = (0.6, 0.2, 0.2)
"""Probability of each bucket in `LENGTH_BUCKETS`."""
PROMPT_SUFFIX = "="
"""Separator after the digits; the model answers right after it."""
MAX_LENGTH = max(hi for _, hi in LENGTH_BUCKETS)
"""Longest digit string (the answer is this long, plus EOS)."""


def sample_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """Draw `n` digit-string lengths from the bucket mix."""
    bucket = rng.choice(len(LENGTH_BUCKETS), size=n, p=np.asarray(LENGTH_PROBS))
    lo = np.array([b[0] for b in LENGTH_BUCKETS])[bucket]
    hi = np.array([b[1] for b in LENGTH_BUCKETS])[bucket]
    return rng.integers(lo, hi + 1)


def answer_tokens(rng: np.random.Generator) -> int:
    """Response tokens of a model that answers right: the reversed digits and EOS (the planner's lengths)."""
    return int(sample_lengths(rng, 1)[0]) + 1


MEAN_PROMPT_TOKENS = 2 + sum(p * (lo + hi) / 2 for (lo, hi), p in zip(LENGTH_BUCKETS, LENGTH_PROBS))
"""BOS, the digits and `=`, on average over the bucket mix (10.9 tokens)."""


def sample_reverse_rows(rng: np.random.Generator, n: int) -> list[dict]:
    """Draw `n` rows `{"prompt": digits + "=", "answer": reversed digits}` from `rng`."""
    rows = []
    for length in sample_lengths(rng, n):
        digits = "".join(map(str, rng.integers(0, 10, size=int(length))))
        rows.append({"prompt": digits + PROMPT_SUFFIX, "answer": digits[::-1]})
    return rows


def make_reverse_rows(num_prompts: int, seed: int) -> list[dict]:
    """`num_prompts` reversal rows, deterministic from `seed`."""
    if not isinstance(num_prompts, (int, np.integer)) or num_prompts < 0:
        raise ValueError(f"num_prompts must be a non-negative integer, got {num_prompts!r}")
    return sample_reverse_rows(np.random.default_rng(seed), int(num_prompts))
