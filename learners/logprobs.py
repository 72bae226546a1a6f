"""Per-token logprobs of given tokens, the way the engines report them.

`token_logprobs` is a pure function: log_softmax(logits / T) gathered at the
target token, computed in chunks of positions as `logit - logsumexp` so the
full [tokens, vocab] log-softmax is never held at once; the learner no longer
calls it on full logits (it is the reference the chunked head is tested
against). `response_logprobs` runs a model on a micro-batch and returns the
logprobs of the response tokens only, aligned with `behavior_logprobs`
([B, Tresp], zero on padding), computed in the model's head from the hidden
states (`learners/chunked_logprobs.py`: no [positions, vocab] logits kept).

A micro-batch is either right-padded ([B, L] with an attention mask) or packed
(`collate(..., packed=True)`): the rows concatenated into [1, sum of lengths]
with position ids restarting at 0 for each row and no attention mask, from which
transformers keeps attention within each row (`flash_attention_2`: the varlen
kernel; `sdpa`: the learner's `sdpa_packed`, one causal attention per row,
learners/packed_attention.py; `eager`: a block-diagonal causal mask, masking_utils'
`find_packed_sequence_indices`). Packed, no compute goes to padding, and only
the positions that predict a response token reach the vocabulary projection.
Either way the response-side tensors (masks, behaviour logprobs, ...) are
[B, Tresp], so the loss code does not know which layout ran.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from learners.chunked_logprobs import LogprobRequest, logprob_request
from learners.packed_attention import forward_kwargs

CHUNK_TOKENS = 2048
"""Positions per chunk in `token_logprobs`: bounds the fp32 [chunk, vocab] temporaries."""


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position, fp32, shape logits.shape[:-1]; no gradient.
    Chunked like `token_logprobs`: H = logsumexp(z) - sum(softmax(z) * z)."""
    flat = logits.detach().reshape(-1, logits.shape[-1])
    cdt = torch.promote_types(logits.dtype, torch.float32)
    out = []
    with torch.no_grad():
        for start in range(0, flat.shape[0], CHUNK_TOKENS):
            z = flat[start : start + CHUNK_TOKENS].to(cdt) / temperature
            out.append(torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1]) if out else logits.new_zeros(logits.shape[:-1], dtype=torch.float32)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature)[..., targets] in fp32 (wider logits: their dtype), shape of `targets`.

    logits: [..., V]; targets: [...] token ids. Differentiable.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    shape = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1, 1)
    cdt = torch.promote_types(logits.dtype, torch.float32)
    out = []
    for start in range(0, flat_logits.shape[0], CHUNK_TOKENS):
        chunk = flat_logits[start : start + CHUNK_TOKENS].to(cdt)
        if temperature != 1.0:
            chunk = chunk / temperature
        picked = chunk.gather(-1, flat_targets[start : start + CHUNK_TOKENS]).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    if not out:
        return logits.new_zeros(shape, dtype=torch.float32)
    return torch.cat(out).reshape(shape)


@dataclass
class MicroBatch:
    """The rows of one micro-batch, right-padded or packed, as tensors on the learner's device."""

    input_ids: torch.Tensor
    """[B, L] prompt + response, right-padded with `pad_id`; packed: [1, T] the rows concatenated."""
    attention_mask: torch.Tensor
    """[B, L] 1 on real tokens; packed: [1, T] ones (not passed to the model)."""
    prompt_lens: torch.Tensor
    """[B] response tokens of row i start at position prompt_lens[i]."""
    response_mask: torch.Tensor
    """[B, Tresp] 1 on real response tokens."""
    behavior_logprobs: torch.Tensor
    """[B, Tresp] exactly as recorded by the engines (zero on padding)."""
    advantages: torch.Tensor
    """[B]"""
    proximal_logprobs: torch.Tensor | None = None
    """[B, Tresp] the pre-update policy's logprobs when the step has several mini-batches (zero on padding)."""
    token_lags: torch.Tensor | None = None
    """[B, Tresp] int64 policy version minus each token's version (zero on padding), for the mismatch metrics."""
    position_ids: torch.Tensor | None = None
    """Packed only: [1, T] positions restarting at 0 for each row (they keep attention within rows)."""
    pred_index: torch.Tensor | None = None
    """Packed only: [n] the packed positions that predict a response token, row by row."""
    resp_slot: torch.Tensor | None = None
    """Packed only: [n] where each of those tokens sits in the flattened [B, Tresp] response tensors."""
    seq_lens: tuple[int, ...] | None = None
    """Packed only: each row's length, host ints, for the attention of every layer (learners/packed_attention.py)."""

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_mask.sum())


def collate(
    input_ids: list[np.ndarray],
    prompt_lens: np.ndarray,
    behavior_logprobs: list[np.ndarray],
    advantages: np.ndarray,
    device: torch.device | str = "cpu",
    pad_id: int = 0,
    proximal_logprobs: list[np.ndarray] | None = None,
    loss_masks: list[np.ndarray] | None = None,
    versions: list[np.ndarray] | None = None,
    policy_version: int = 0,
    packed: bool = False,
) -> MicroBatch:
    """Right-pad a list of rows into a `MicroBatch`, or with `packed` concatenate them (module
    docstring). `loss_masks` (per response token, 0 for environment tokens) becomes part of
    `response_mask`, so loss, normalisers and metrics skip them. `versions` (per response token)
    with the batch's `policy_version` give `token_lags`."""
    n = len(input_ids)
    seq_len = max(len(x) for x in input_ids)
    resp_len = max(max((len(b) for b in behavior_logprobs), default=0), 1)
    ids = np.full((n, seq_len), pad_id, np.int64)
    attn = np.zeros((n, seq_len), np.int64)
    rmask = np.zeros((n, resp_len), np.float32)
    blp = np.zeros((n, resp_len), np.float32)
    for i, (x, b) in enumerate(zip(input_ids, behavior_logprobs)):
        if len(x) != int(prompt_lens[i]) + len(b):
            raise ValueError(f"row {i}: {len(x)} tokens but prompt {int(prompt_lens[i])} + response {len(b)}")
        ids[i, : len(x)] = x
        attn[i, : len(x)] = 1
        rmask[i, : len(b)] = 1.0 if loss_masks is None else np.asarray(loss_masks[i], np.float32)
        blp[i, : len(b)] = b
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    prox = None
    if proximal_logprobs is not None:
        prox = np.zeros((n, resp_len), np.float32)
        for i, x in enumerate(proximal_logprobs):
            prox[i, : len(x)] = x
        prox = t(prox)
    lags = None
    if versions is not None:
        lags = np.zeros((n, resp_len), np.int64)
        for i, v in enumerate(versions):
            lags[i, : len(v)] = policy_version - np.asarray(v, np.int64)
        lags = t(lags)
    mb = MicroBatch(t(ids), t(attn), t(np.asarray(prompt_lens, np.int64)), t(rmask), t(blp),
                    t(np.asarray(advantages, np.float32)), prox, lags)
    return _packed(mb, input_ids, prompt_lens, behavior_logprobs, t) if packed else mb


def _packed(mb: MicroBatch, input_ids, prompt_lens, behavior_logprobs, t) -> MicroBatch:
    """`mb` with its token side packed: rows concatenated, positions restarting per row."""
    lens = [len(x) for x in input_ids]
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
    resp_len = mb.response_mask.shape[1]
    if min(int(p) for p in prompt_lens) < 1:
        raise ValueError("every row needs at least one prompt token")
    # Response token j of row i sits at starts[i] + prompt_lens[i] + j and is predicted one position before.
    pred = [s + int(p) - 1 + np.arange(len(b)) for s, p, b in zip(starts, prompt_lens, behavior_logprobs)]
    slot = [i * resp_len + np.arange(len(b)) for i, b in enumerate(behavior_logprobs)]
    ids = np.concatenate([np.asarray(x, np.int64) for x in input_ids])[None]
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)[None]
    return dataclasses.replace(
        mb, input_ids=t(ids), attention_mask=t(np.ones_like(ids)), position_ids=t(pos),
        pred_index=t(np.concatenate(pred).astype(np.int64)), resp_slot=t(np.concatenate(slot).astype(np.int64)),
        seq_lens=tuple(lens),
    )  # fmt: skip


def response_logprobs(model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False):
    """Logprobs [B, Tresp] of each row's response tokens under `model`, zero on padding; with
    `with_entropy`, also (no gradient) the entropy of the policy at each response token, [B, Tresp].

    The model's head computes them from the hidden states in chunks (`LogprobHead`, installed on
    first use; the learner installs it before FSDP2 sharding), and only at positions that predict a
    response token: padded, from the first such position on (`logits_to_keep`); packed, exactly those.
    """
    if mb.packed:
        return _packed_logprobs(model, mb, temperature, with_entropy)
    seq_len = mb.input_ids.shape[1]
    resp_len = mb.response_mask.shape[1]
    # Position p predicts token p+1; the first response token of row i is predicted at prompt_lens[i]-1.
    first = int(mb.prompt_lens.min()) - 1
    if first < 0:
        raise ValueError("every row needs at least one prompt token")
    keep = seq_len - first
    # Kept position j sits at first + j and predicts the token at first + j + 1 (the last predicts nothing).
    targets = torch.zeros_like(mb.input_ids[:, first:])
    targets[:, :-1] = mb.input_ids[:, first + 1 :]
    with logprob_request(model, LogprobRequest(targets, temperature, with_entropy)) as req:
        model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=keep, use_cache=False)
    lp = req.logprobs  # [B, keep]
    offs = (mb.prompt_lens - 1 - first).unsqueeze(1) + torch.arange(resp_len, device=lp.device).unsqueeze(0)
    offs = offs.clamp(max=keep - 1)
    out = lp.gather(1, offs) * mb.response_mask
    if not with_entropy:
        return out
    return out, req.entropy.gather(1, offs) * mb.response_mask


def _packed_logprobs(model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool):
    shape = mb.response_mask.shape
    targets = mb.input_ids[:, mb.pred_index + 1]  # [1, n]
    with logprob_request(model, LogprobRequest(targets, temperature, with_entropy)) as req:
        # No attention mask: the row boundaries come from the restarting position ids (transformers) or, for
        # sdpa_packed, from the row lengths handed to every layer once (packed_attention.forward_kwargs).
        model(input_ids=mb.input_ids, position_ids=mb.position_ids, logits_to_keep=mb.pred_index, use_cache=False,
              **forward_kwargs(model, mb.seq_lens))
    spread = lambda v: v.new_zeros(shape.numel()).index_copy(0, mb.resp_slot, v[0]).reshape(shape) * mb.response_mask
    out = spread(req.logprobs)
    return (out, spread(req.entropy)) if with_entropy else out
