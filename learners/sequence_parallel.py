"""Ulysses sequence parallelism (`learner.sequence_parallel`): one row's positions split across ranks.

With world size W and sp S the ranks form W/S data-parallel groups of S
consecutive ranks (a 2-D DeviceMesh ("dp", "sp"), rank = dp * S + sp). Every
rank of a group holds the same right-padded micro-batch, padded to a multiple
of S, and runs the model on its contiguous slice of positions
[r * L/S, (r+1) * L/S) with the slice's GLOBAL position ids (rotary).

    q, k, v  [B, H, L/S, D]  --all-to-all-->  [B, H/S, L, D]   (heads scattered, positions gathered)
    sdpa, causal, over the full sequence for H/S heads (and KVH/S KV heads: GQA groups stay whole)
    out      [B, L, H/S, D]  --all-to-all-->  [B, L/S, H, D]

Right padding makes the plain causal mask exact: a real token never sees a
later (padding) key, and padding positions are never scored.

Each rank gathers the logprobs of its slice's positions (the last position of
a slice predicts the next slice's first token: the targets are taken from the
full row, which every rank holds) into the full [B, L] with `gather_slices`,
whose backward keeps only the local slice: every rank of the group then
computes the SAME loss of the group's rows, and the gradient of that loss
reaches each rank's own computation exactly once. The parameter gradients of
the S ranks are partial sums that FSDP2 adds up.

FSDP2 shards over ALL W ranks (the 1-D mesh of learners/parallelize.py), not
over "dp": the parameter gradients of every rank must be summed over all W
anyway (sp partials within a group, data parallel across groups), which is
exactly FSDP2's SUM reduce-scatter over W; sharding over W also cuts the
parameter, gradient and optimizer memory per rank by W instead of W/S.
Only the all-to-alls and the logprob gather use the "sp" groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from learners.chunked_logprobs import LogprobRequest, logprob_request
from learners.logprobs import MicroBatch
from learners.packed_attention import uses_sliding_window

ATTN_NAME = "ulysses_sdpa"
"""The attention implementation registered with transformers' AttentionInterface."""


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's place in the ("dp", "sp") layout."""

    group: dist.ProcessGroup
    rank: int
    """Rank inside the sp group: which slice of positions this rank computes."""
    size: int
    dp_rank: int
    """Which data-parallel group (which shard of the rows) this rank belongs to."""
    dp_size: int


_ACTIVE: SequenceParallel | None = None
"""The process's sp group, read by the registered attention function (one learner per process)."""
_PARITY = False
"""model.parity: the gathered heads' attention by the batch-invariant kernel (async_april/parity/kernels.py)."""


def set_parity(on: bool) -> None:
    global _PARITY
    _PARITY = on


def check_sequence_parallel(sp: int, world_size: int, num_heads: int | None = None, num_kv_heads: int | None = None) -> None:
    """Clear errors for layouts Ulysses cannot run: sp must divide the ranks, the heads and the KV heads."""
    if sp < 1:
        raise ValueError(f"learner.sequence_parallel={sp} must be >= 1")
    if world_size % sp:
        raise ValueError(f"learner.sequence_parallel={sp} must divide learner.world_size={world_size} (the ranks form "
                         f"world_size / sequence_parallel data-parallel groups); set learner.world_size to a multiple of "
                         f"{sp} or learner.sequence_parallel to a divisor of {world_size}")
    for what, n in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads)):
        if n is not None and n % sp:
            raise ValueError(f"learner.sequence_parallel={sp} must divide the model's {what}={n} (Ulysses gives each "
                             f"rank {what} / sequence_parallel heads); set learner.sequence_parallel to a divisor of {n}")


def setup(model: nn.Module, world_size: int, sp: int, device_type: str) -> SequenceParallel | None:
    """Check the model, build the ("dp", "sp") mesh and switch `model` to Ulysses attention. None when sp == 1.
    Collective (every rank creates every group)."""
    cfg = model.config
    check_sequence_parallel(sp, world_size, cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None))
    if sp == 1:
        return None
    if uses_sliding_window(cfg):
        raise ValueError("learner.sequence_parallel > 1 runs plain causal attention over the full sequence; this model "
                         "uses a sliding window. Set learner.sequence_parallel=1")
    if cfg._attn_implementation != "sdpa":
        raise ValueError(f"learner.sequence_parallel > 1 wraps sdpa attention; model.attn_implementation="
                         f"{cfg._attn_implementation!r}: set model.attn_implementation=sdpa")
    mesh = init_device_mesh(device_type, (world_size // sp, sp), mesh_dim_names=("dp", "sp"))
    global _ACTIVE
    _ACTIVE = SequenceParallel(mesh.get_group("sp"), mesh.get_local_rank("sp"), sp, mesh.get_local_rank("dp"), world_size // sp)
    use_ulysses(model)
    return _ACTIVE


def use_ulysses(model: nn.Module) -> None:
    """Register the Ulysses attention function and point `model` at it (its mask creation is skipped:
    transformers builds no mask for an implementation without a mask function, and we run causal)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, ulysses_attention)
    model.config._attn_implementation = ATTN_NAME


# ----------------------------------------------------------------------------- collectives with autograd


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    # all_to_all_single exchanges chunks of dim 0 (the only all-to-all gloo implements): stack the chunks there.
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None  # the inverse exchange


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` along `scatter_dim` across the group and concatenate what arrives along `gather_dim`
    (chunk j from group rank j). Differentiable."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherSlices(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.rank, ctx.size, ctx.dim = dist.get_rank(group), dist.get_world_size(group), dim
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        # Every rank computes the same function of the gathered tensor, so each already holds the full
        # gradient: keep this rank's slice (summing over ranks would count it `size` times).
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None


def gather_slices(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate the group's slices of `x` along `dim`, for a REPLICATED downstream computation."""
    return _GatherSlices.apply(x, group, dim)


# ----------------------------------------------------------------------------- attention and logprobs


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function: [B, H, L/S, D] per rank in, [B, L/S, H, D] out (as sdpa returns)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _ACTIVE is None:
        raise RuntimeError(f"attention {ATTN_NAME!r} runs only inside a sequence-parallel learner (learners/sequence_parallel.setup)")
    group = _ACTIVE.group
    q, k, v = (all_to_all(t, group, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    # The local mask transformers might pass covers L/S positions; the full-sequence mask of a right-padded
    # micro-batch is plain causal (module docstring).
    if _PARITY:  # the same kernel as the engine's, over the full sequence of this rank's heads (right padding: causal)
        from async_april.parity.kernels import attention

        out = attention(q, k, v, None, scaling if scaling is not None else q.shape[-1] ** -0.5)
        return all_to_all(out, group, scatter_dim=1, gather_dim=2), None
    out, _ = sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)
    return all_to_all(out, group, scatter_dim=1, gather_dim=2), None


def padded_length(length: int, sp: int) -> int:
    """`length` rounded up to a multiple of `sp` (every rank gets an equal slice)."""
    return -(-length // sp) * sp


def sp_response_logprobs(model: nn.Module, mb: MicroBatch, temperature: float, sp: SequenceParallel,
                         with_entropy: bool = False):
    """`learners.logprobs.response_logprobs` under sequence parallelism: the same [B, Tresp] on every rank
    of the sp group (and entropy, no gradient), each rank running the model on its slice of positions."""
    rows, seq_len = mb.input_ids.shape
    if int(mb.prompt_lens.min()) < 1:
        raise ValueError("every row needs at least one prompt token")  # as response_logprobs
    full = padded_length(seq_len, sp.size)
    ids = F.pad(mb.input_ids, (0, full - seq_len))  # right padding: never attended by real tokens, never scored
    targets = torch.zeros_like(ids)
    targets[:, :-1] = ids[:, 1:]  # position p predicts p + 1, across slice boundaries too
    n = full // sp.size
    lo = sp.rank * n
    positions = torch.arange(lo, lo + n, device=ids.device).unsqueeze(0).expand(rows, n)
    # The slice's logprobs (and entropy) come from the chunked head: no [B, n, vocab] logits kept.
    with logprob_request(model, LogprobRequest(targets[:, lo : lo + n], temperature, with_entropy)) as req:
        model(input_ids=ids[:, lo : lo + n], position_ids=positions, use_cache=False)
    lp = gather_slices(req.logprobs, sp.group, dim=1)  # [B, full]
    resp_len = mb.response_mask.shape[1]
    offs = (mb.prompt_lens - 1).unsqueeze(1) + torch.arange(resp_len, device=lp.device).unsqueeze(0)
    offs = offs.clamp(max=full - 1)
    out = lp.gather(1, offs) * mb.response_mask
    if not with_entropy:
        return out
    with torch.no_grad():
        ent = gather_slices(req.entropy, sp.group, dim=1)
    return out, ent.gather(1, offs) * mb.response_mask
