"""Multi-turn digit reversal: the built-in CPU task for environments (rollout.env=builtin:reverse_turns).

The environment reveals a digit string in chunks; the model reverses each chunk
in its own turn. One episode of three chunks, as token ids appended in order:

    prompt   <s> 3 1 4 =          (the dataset row's prompt: the first chunk)
    model        4 1 3 </s>       turn 1 (loss mask 1)
    env          1 5 9 2 =        the next chunk (loss mask 0)
    model        2 9 5 1 </s>     turn 2
    env          6 5 =
    model        5 6 </s>         turn 3; the environment says done

A turn ends at the model's stop token (EOS); the observation is the next chunk
and `=`, tokenised on its own and appended as ids. The reward of turn i is
`reverse_match(turn text, reversed chunk i) / chunks`, so the response's
reward (their sum) is the mean match over all chunks, in [0, 1]; a chunk the
model never reached scores 0. Rows are deterministic from the seed.
"""

from __future__ import annotations

import numpy as np

from async_april.environment import EnvRow, Environment, Reset, Step
from async_april.rewards.reverse import reverse_match

CHUNKS = (2, 4)
"""Inclusive range of the number of chunks (model turns) per episode."""
CHUNK_LEN = (3, 8)
"""Inclusive range of a chunk's length in digits."""
SEP = ","
"""Joins the chunks in a row's `answer`, e.g. "314,1592,65"."""
PROMPT_SUFFIX = "="


def sample_turn_rows(rng: np.random.Generator, n: int) -> list[dict]:
    """`n` rows `{"prompt": first chunk + "=", "answer": chunks joined by SEP}`."""
    rows = []
    for _ in range(n):
        k = int(rng.integers(CHUNKS[0], CHUNKS[1] + 1))
        chunks = ["".join(map(str, rng.integers(0, 10, size=int(rng.integers(CHUNK_LEN[0], CHUNK_LEN[1] + 1)))))
                  for _ in range(k)]
        rows.append({"prompt": chunks[0] + PROMPT_SUFFIX, "answer": SEP.join(chunks)})
    return rows


def make_turn_rows(num_prompts: int, seed: int) -> list[dict]:
    """`num_prompts` rows, deterministic from `seed`."""
    if not isinstance(num_prompts, (int, np.integer)) or num_prompts < 0:
        raise ValueError(f"num_prompts must be a non-negative integer, got {num_prompts!r}")
    return sample_turn_rows(np.random.default_rng([seed, 18]), int(num_prompts))


class ReverseTurnsEnv(Environment):
    """Reveals the chunks of `row.answer` one per turn and scores each reversal (see the module docstring)."""

    def __init__(self, tokenizer=None) -> None:
        if tokenizer is None:
            raise ValueError("ReverseTurnsEnv needs the model's tokenizer to tokenise its observations")
        super().__init__(tokenizer)

    def reset(self, row: EnvRow) -> Reset:
        chunks = row.answer.split(SEP)
        if not all(c.isdigit() for c in chunks):
            raise ValueError(f"reverse_turns row answer {row.answer!r}: expected digit chunks joined by {SEP!r}")
        return Reset(state={"chunks": chunks, "turn": 0})

    def step(self, state: dict, turn_ids: np.ndarray) -> Step:
        chunks, i = state["chunks"], int(state["turn"])
        text = self.tokenizer.decode(np.asarray(turn_ids).tolist(), skip_special_tokens=True)
        reward = reverse_match("", text, chunks[i][::-1]) / len(chunks)
        nxt = {"chunks": chunks, "turn": i + 1}
        if i + 1 == len(chunks):
            return Step(np.zeros(0, np.int64), reward, True, nxt)
        obs = self.tokenizer(chunks[i + 1] + PROMPT_SUFFIX, add_special_tokens=False)["input_ids"]
        return Step(np.asarray(obs, np.int64), reward, False, nxt)
