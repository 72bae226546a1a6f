"""The tiny model's supervised warm start and its quick evaluation (async_april/models/tiny.py builds).

Teacher-forced cross-entropy on the reversed digits + EOS (or, for the multi-turn task, on the model's
replies of whole episodes), and the reward of sampled / greedy generations on held-out rows.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from async_april.run.console import stage
from async_april.rewards.reverse import reverse_match
from async_april.tasks.reverse import sample_reverse_rows

SFT_STREAM = 1
"""Seed stream of the warm start's rows, derived from the build seed (the RL prompts use
`make_reverse_rows(n, run.seed)`; the build's evaluation rows stream 2)."""


def sft_sequence(tok, row: dict) -> tuple[list[int], list[int]]:
    """(ids, labels) of one row: `<s> digits = reversed </s>`, or for a multi-turn row (`chunks`)
    `<s> c1 = r1 </s> c2 = r2 </s> ...`; labels only on the model's tokens (replies and EOS)."""
    ids = tok(row["prompt"])["input_ids"]
    labels = [-100] * len(ids)
    turns = row.get("chunks") or [row["answer"][::-1]]  # single-turn: the answer is the reversal
    for i, chunk in enumerate(turns):
        if i:  # the environment's observation: the next chunk and `=`
            obs = tok(chunk + "=", add_special_tokens=False)["input_ids"]
            ids, labels = ids + obs, labels + [-100] * len(obs)
        reply = tok(chunk[::-1], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids, labels = ids + reply, labels + reply
    return ids, labels


def sft_rows(rng: np.random.Generator, n: int, task: str) -> list[dict]:
    if task == "reverse":
        return sample_reverse_rows(rng, n)
    from async_april.tasks.reverse_turns import SEP, sample_turn_rows

    return [{**r, "chunks": r["answer"].split(SEP)} for r in sample_turn_rows(rng, n)]


def _sft_batch(tok, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows (`sft_sequence`) with labels only on the response tokens."""
    seqs, labels = [], []
    for row in rows:
        ids, lab = sft_sequence(tok, row)
        seqs.append(ids)
        labels.append(lab)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
        mask[i, : len(s)] = 1
    return ids, mask, lab


def _sft_step(model, tok, rows: list[dict], micro_batches: int) -> torch.Tensor:
    """Accumulate the token-mean response cross-entropy of `rows`; returns the loss.

    The rows are sorted by length and cut into `micro_batches` pieces so that
    short rows are not padded to the longest one; the gradient is that of the
    whole batch, since every piece is divided by the batch's token count.
    """
    rows = sorted(rows, key=lambda r: len(r["answer"]))
    size = -(-len(rows) // micro_batches)
    pieces = [_sft_batch(tok, rows[i : i + size]) for i in range(0, len(rows), size)]
    num_tokens = sum(int((lab != -100).sum()) for _, _, lab in pieces)
    total = torch.zeros(())
    for ids, mask, lab in pieces:
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # position t predicts token t+1
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1),
                               ignore_index=-100, reduction="sum") / num_tokens
        loss.backward()
        total += loss.detach()
    return total


def warm_start(model, tok, settings, seed: int, task: str = "reverse") -> float:
    """Teacher-forced SFT on reversal rows from the build's own seed stream; returns the last loss.
    `settings`: the build's `TinyBuildSettings` (sft_steps, sft_batch_size, sft_lr, sft_micro_batches)."""
    rng = np.random.default_rng([seed, SFT_STREAM])
    opt = torch.optim.AdamW(model.parameters(), lr=settings.sft_lr)
    model.train()
    loss = torch.tensor(float("nan"))
    with stage("building the tiny model: SFT warm start", total=settings.sft_steps, unit="step") as bar:
        for _ in range(settings.sft_steps):
            opt.zero_grad(set_to_none=True)
            rows = sft_rows(rng, settings.sft_batch_size, task)
            loss = _sft_step(model, tok, rows, settings.sft_micro_batches)
            opt.step()
            bar.update(1)
            bar.set_postfix_str(f"loss {loss.item():.4f}")
    model.eval()
    return float(loss.item())


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], sample: bool, seed: int = 0, max_new_tokens: int = 48,
             batch_size: int = 128) -> float:
    """Mean `reverse_match` reward of generations (temperature-1 sampling or greedy) on `rows`."""
    torch.manual_seed(seed)
    model.eval()
    tok.padding_side = "left"
    rewards = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_k=0 if sample else None,
            top_p=1.0 if sample else None,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        rewards += [reverse_match(r["prompt"], t, r["answer"]) for r, t in zip(chunk, texts)]
    return float(np.mean(rewards))


@torch.no_grad()
def evaluate_turns(model, tok, rows: list[dict], sample: bool, seed: int = 0, max_turn_tokens: int = 12) -> float:
    """Mean episode reward of the multi-turn task (async_april/tasks/reverse_turns.py), one episode
    at a time, turns appended as token ids exactly as the environment runner does."""
    from async_april.environment import EnvRow
    from async_april.tasks.reverse_turns import ReverseTurnsEnv

    torch.manual_seed(seed)
    model.eval()
    env = ReverseTurnsEnv(tokenizer=tok)
    rewards = []
    for row in rows:
        ids = tok(row["prompt"])["input_ids"]
        state = env.reset(EnvRow(row["prompt"], np.asarray(ids), row["answer"], {}, 0)).state
        total, done = 0.0, False
        while not done:
            x = torch.tensor([ids])
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_turn_tokens,
                                 do_sample=sample, temperature=1.0 if sample else None, top_k=0 if sample else None,
                                 top_p=1.0 if sample else None, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
            turn = out[0, len(ids):].tolist()
            step = env.step(state, np.asarray(turn))
            total, done, state = total + step.reward, step.done, step.state
            ids = ids + turn + step.observation_ids.tolist()
        rewards.append(total)
    return float(np.mean(rewards))
