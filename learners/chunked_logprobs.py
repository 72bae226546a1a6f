"""Logprobs of given tokens from the final hidden states, without the full logits.

    hidden [N, H] (after the final norm), lm_head weight [V, H], targets [N]
      for each chunk of C positions:  z = (h_c @ W^T) / T      [C, V], freed after the chunk
                                      logprob = z[target] - logsumexp(z),  entropy = lse - sum(p z)
      saved for backward: hidden, weight, targets, lse [N]    (no [N, V] tensor)
      backward, per chunk: recompute z, p = exp(z - lse)
                           dz = g (onehot(target) - p) / T;  dh = dz W,  dW += dz^T h   (in place)

Peak memory is ~ C x V fp32 temporaries instead of the N x V logits plus their
gradient (issue 28: 15.8 GB at 8k positions x 152k vocabulary on the old path).
The weight's gradient is accumulated in place into ONE [V, H] tensor in the compute
dtype (`_accumulate_weight_grad`): in fp32 weights that tensor is the gradient returned,
so the backward adds nothing of [V, H] size; with bf16 weights (GPU) it is an fp32
accumulator beside the bf16 gradient returned, plus one [VOCAB_SLICE, H] product at a
time. Before issue 38 each chunk also made a [V, H] product and its fp32 copy:
8 bytes x V x H beyond the weights in fp32 (measured 8.7), 10 in bf16 (10.5), against
4 and 6 now (tests/test_memory_plan.py, which async_april/planning/memory.py counts).
The maths is `learners/logprobs.py`'s `token_logprobs`/`token_entropy` on the
logits `h @ W^T`, in fp32 (or the inputs' dtype when wider, so float64 tests are
exact).

FSDP2 all-gathers the root's parameters (embeddings, final norm, lm_head) in the
root module's pre-forward hook; outside that forward `lm_head.weight` is a sharded
DTensor. So the projection runs INSIDE the model's forward: `install_logprob_head`
replaces `lm_head` by `LogprobHead`, which holds the same Parameter (state-dict
name and tied embeddings unchanged) and, while a `LogprobRequest` is active,
returns logprobs instead of logits. Install it before `fully_shard`: FSDP2
records which module owns each parameter.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

CHUNK_POSITIONS = 1024
"""Positions per chunk: the fp32 [chunk, vocab] temporaries (0.6 GB at a 152k vocabulary)."""
VOCAB_SLICE = 8192
"""Vocabulary rows per product of dz^T h when the weight is narrower than fp32 (bf16): the [slice, hidden]
temporary added into the fp32 accumulator (42 MB at hidden 2560), instead of a whole [vocab, hidden] one."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _tempered_logits(h: torch.Tensor, weight: torch.Tensor, cdt: torch.dtype, temperature: float) -> torch.Tensor:
    """(h @ W^T) / T in `cdt`, a fresh [chunk, V] tensor the caller may modify in place."""
    z = (h @ weight.t()).to(cdt)
    return z.div_(temperature) if temperature != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_nd, weight, targets_nd, temperature: float, chunk: int, with_entropy: bool):
        # Shaped here, not by the caller: a reshaped output would be a view, on which FSDP2's
        # pre-backward hook (registered on the root forward's outputs) is fragile.
        hidden, targets = hidden_nd.reshape(-1, hidden_nd.shape[-1]), targets_nd.reshape(-1)
        n, shape = hidden.shape[0], targets_nd.shape
        cdt = _compute_dtype(hidden.dtype)
        lp_out = hidden.new_empty(shape, dtype=cdt)  # written through a flat view, returned as is
        ent_out = hidden.new_empty(shape if with_entropy else (0,), dtype=cdt)
        lp, ent = lp_out.view(-1), ent_out.view(-1)
        lse = hidden.new_empty(n, dtype=cdt)
        for s in range(0, n, chunk):
            z = _tempered_logits(hidden[s : s + chunk], weight, cdt, temperature)
            picked = z.gather(-1, targets[s : s + chunk, None]).squeeze(-1)
            top = z.amax(-1, keepdim=True)
            e = z.sub_(top).exp_()  # in place: one [chunk, V] buffer
            total = e.sum(-1)
            lse[s : s + chunk] = top.squeeze(-1) + total.log()
            lp[s : s + chunk] = picked - lse[s : s + chunk]
            if with_entropy:
                # sum(p z) = sum(e log e) / total + top, with e = exp(z - top).
                ent[s : s + chunk] = total.log() - torch.xlogy(e, e).sum(-1) / total
            del z, e
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk, ctx.hidden_shape = temperature, chunk, hidden_nd.shape
        ctx.mark_non_differentiable(ent_out)
        return lp_out, ent_out

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_lp = grad_lp.reshape(-1)
        t, chunk = ctx.temperature, ctx.chunk
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        cdt = lse.dtype
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if want_w else None
        rows = torch.arange(min(chunk, hidden.shape[0]), device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            g = grad_lp[s : s + chunk].to(cdt)
            # d logprob / d z = onehot(target) - softmax(z); chain through z = logits / t. In place.
            dz = _tempered_logits(h, weight, cdt, t).sub_(lse[s : s + chunk, None]).exp_().mul_(-g[:, None])
            dz[rows[: h.shape[0]], targets[s : s + chunk]] += g
            dz = dz.div_(t).to(hidden.dtype)
            if want_h:
                grad_h[s : s + chunk] = dz @ weight
            if want_w:
                _accumulate_weight_grad(grad_w, dz, h)
            del dz
        grad_h = None if grad_h is None else grad_h.reshape(ctx.hidden_shape)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def _accumulate_weight_grad(grad_w: torch.Tensor, dz: torch.Tensor, h: torch.Tensor, vocab_slice: int = VOCAB_SLICE) -> None:
    """grad_w += dz^T h in place: grad_w [V, H] in the compute dtype, dz [C, V] and h [C, H] in the inputs'.
    Same dtypes: one addmm_ into grad_w, no temporary. A narrower dz, h (bf16; addmm_ wants one dtype and
    torch 2.13's fp32-output addmm is CUDA-only): the product of `vocab_slice` rows at a time in that dtype,
    as before, added into grad_w's rows in place (the cast happens inside the add)."""
    if dz.dtype == grad_w.dtype:
        grad_w.addmm_(dz.t(), h)
        return
    for v in range(0, grad_w.shape[0], vocab_slice):
        grad_w[v : v + vocab_slice].add_(dz[:, v : v + vocab_slice].t() @ h)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk: int = CHUNK_POSITIONS,
):
    """log_softmax(hidden @ weight^T / temperature)[targets] per position, without keeping the
    logits: hidden [..., H], weight [V, H], targets [...] -> logprobs of targets' shape (fp32, or
    wider with wider inputs); with `with_entropy` also the entropy (no gradient). Differentiable in
    hidden and weight; the backward recomputes each chunk's logits."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets {tuple(targets.shape)} do not match the hidden states' positions {tuple(hidden.shape[:-1])}")
    lp, ent = _ChunkedLogprobs.apply(hidden, weight, targets, float(temperature), chunk, with_entropy)
    return (lp, ent) if with_entropy else lp


@dataclass
class LogprobRequest:
    """What `LogprobHead` computes during one forward, and where it leaves the results."""

    targets: torch.Tensor
    """Token ids, the shape of the kept positions (`logits_to_keep`) without the hidden dim."""
    temperature: float
    with_entropy: bool = False
    logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


class LogprobHead(nn.Module):
    """`lm_head` that, inside `logprob_request(...)`, returns the targets' logprobs (chunked, see the
    module docstring) instead of logits; otherwise a plain bias-free linear layer."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if getattr(linear, "bias", None) is not None:
            raise ValueError("LogprobHead supports a bias-free lm_head only (every Qwen2/Llama-style model)")
        self.weight = linear.weight  # the same Parameter: tied embeddings and state-dict names unchanged
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.request: LogprobRequest | None = None
        self.parity_dtype: torch.dtype | None = None
        """Set by parity mode (async_april/parity/model.py): logprobs from its kernels, the engine's numbers."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        req = self.request
        if req is None:
            return nn.functional.linear(hidden, self.weight)
        if self.parity_dtype is not None:
            from async_april.parity.model import head_logprobs

            req.logprobs, req.entropy = head_logprobs(hidden, self.weight, req.targets, req.temperature,
                                                      self.parity_dtype, req.with_entropy)
            return req.logprobs
        out = chunked_logprobs(hidden, self.weight, req.targets, req.temperature, req.with_entropy)
        req.logprobs, req.entropy = out if req.with_entropy else (out, None)
        return req.logprobs


def install_logprob_head(model: nn.Module) -> LogprobHead:
    """Replace the model's output projection by a `LogprobHead` (idempotent); returns it. Call before
    FSDP2's `fully_shard`, which records the module that owns each parameter."""
    head = model.get_output_embeddings()
    if isinstance(head, LogprobHead):
        return head
    if type(head) is not nn.Linear:
        raise TypeError(f"cannot install the chunked logprob head on a {type(head).__name__} output layer; expected nn.Linear")
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        raise RuntimeError(  # noqa: TRY004 -- a call-order error, not a type error
            "install_logprob_head must run before fully_shard (FSDP2 would keep the old lm_head's parameter views)"
        )
    new = LogprobHead(head)
    model.set_output_embeddings(new)
    return new


@contextmanager
def logprob_request(model: nn.Module, req: LogprobRequest):
    """Within the block, the model's forward computes `req` in its head instead of logits."""
    head = install_logprob_head(model)
    head.request = req
    try:
        yield req
    finally:
        head.request = None
