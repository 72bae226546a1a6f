"""Batch-invariant kernels: a token's numbers never depend on what else is in the tensor.

Stock CPU kernels are not batch invariant. A GEMM picks its blocking (and, for one row, a GEMV) by
shape, so row i of `X @ W^T` changes in the last bits with the number of rows; a reduction over keys
changes with the padding after the last real key; and an elementwise transcendental (exp, cos, silu,
rsqrt) runs the SLEEF vector code on most elements but the scalar libm code on the tail of each
contiguous run (ATen `cpu/Loops.h`, `vectorized_loop`: the last `n % (2 * Vec::size())` elements go
through `basic_loop`), and the two can differ by an ulp, so which element lands in the tail depends
on the batch. Each kernel here removes one of those:

    linear(x, W)         every output row a reduction of its own over K, in one fixed order
                         ((x_m * W).sum(-1) on a fresh contiguous [rows, N, K] product), fp32 accumulation;
                         backward: ordinary matmuls (only the forward values must match)
    pointwise(fn, x)     fn on x flattened, padded to a multiple of LANES and cut into pieces of at most
                         SERIAL_MAX elements: every element takes the vector path, on one thread
    rms_norm             row-wise; the rsqrt through `pointwise`
    attention            per row of the batch: scores by the row-wise reduction, softmax and the
                         weighted sum of values by a running (cumsum) reduction over keys read at each
                         query's last key, so keys after it (padding, later tokens) and exact zeros
                         before it (left padding) change nothing
    log_softmax          z - (max + log(sum(exp(z - max)))), the exp and log through `pointwise`

The engine and the learner call these same functions on the same dtypes (async_april/parity/model.py),
so a token's logprob is the same bits whether it was computed one decode step at a time with a KV
cache, in a padded batch, or in a packed row. It is exact on CPU, the only place this project can test
it (tests/test_parity.py); a GPU needs batch-invariant GPU kernels (docs/algorithms.md, "Parity").

Cost: the [rows, N, K] product and the [H, q, T, D] running sums are far slower than a GEMM and an
SDPA kernel (docs/benchmarks.md, "Parity mode").
"""

from __future__ import annotations

from typing import Callable

import torch

LANES = 64
"""Pad elementwise inputs to a multiple of this: 2 x the widest CPU vector torch dispatches to (AVX-512, 16 fp32)
times 2, so no element falls in `vectorized_loop`'s scalar tail."""
SERIAL_MAX = 32768
"""ATen's `internal::GRAIN_SIZE`: an elementwise op on at most this many elements runs on one thread, so
a thread split (whose chunk ends are not multiples of the vector width) never makes a scalar tail."""
PRODUCT_BUDGET = 1 << 22
"""Elements of the [rows, N, K] product `linear` makes at once (16 MB in fp32)."""


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for a compute dtype: fp32 for fp32 and narrower."""
    return torch.promote_types(dtype, torch.float32)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` for an elementwise `fn`, each element through the same code path whatever x's shape."""
    flat = x.contiguous().reshape(-1)
    n = flat.numel()
    pad = (-n) % LANES
    if pad:
        flat = torch.cat([flat, flat.new_ones(pad)])  # ones: finite under log and rsqrt
    if flat.numel() > SERIAL_MAX:
        out = torch.cat([fn(c) for c in flat.split(SERIAL_MAX)])
    else:
        out = fn(flat)
    return out[:n].reshape(x.shape)


def _rowwise_matmul(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, K] x [N, K] -> [M, N], each output element one contiguous reduction over K."""
    n, k = w.shape
    rows = max(1, PRODUCT_BUDGET // max(1, n * k))
    outs = [(c[:, None, :] * w[None, :, :]).sum(-1) for c in x2.split(rows)]
    return torch.cat(outs) if len(outs) > 1 else outs[0]


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, acc_dtype):
        k = x.shape[-1]
        x2 = x.reshape(-1, k).to(acc_dtype).contiguous()
        w = weight.to(acc_dtype).contiguous()
        ctx.save_for_backward(x, weight)
        ctx.acc_dtype = acc_dtype
        return _rowwise_matmul(x2, w).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        cdt = ctx.acc_dtype
        g2 = g.reshape(-1, g.shape[-1]).to(cdt)
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = (g2 @ weight.to(cdt)).reshape(x.shape).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(cdt)).to(weight.dtype)
        return gx, gw, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ weight^T + bias, with x and weight first rounded to `dtype` (the engine's parameter dtype), the
    products accumulated in fp32 (or wider), the result in `out_dtype` (default `dtype`)."""
    acc = compute_dtype(dtype)
    out = _Linear.apply(x.to(dtype), weight.to(dtype), acc)
    if bias is not None:
        out = out + bias.to(dtype).to(acc)
    return out.to(out_dtype or dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Qwen2/Llama RMSNorm (transformers' `Qwen2RMSNorm`: fp32 statistics, weight times the normalised
    input in the parameter dtype), row by row."""
    h = x.to(dtype).to(torch.float32).contiguous()
    var = (h * h).mean(-1, keepdim=True)
    h = h * pointwise(torch.rsqrt, var + eps)
    return weight.to(dtype) * h.to(dtype)


def rotary(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype):
    """(cos, sin) [B, T, D] of transformers' default rotary embedding (`Qwen2RotaryEmbedding.forward`:
    freqs = position * inv_freq, emb = cat(freqs, freqs)), the cos and sin through `pointwise`."""
    freqs = position_ids[..., None].to(torch.float32) * inv_freq.to(torch.float32)
    emb = torch.cat([freqs, freqs], -1)
    cos = pointwise(torch.cos, emb) * scaling
    sin = pointwise(torch.sin, emb) * scaling
    return cos.to(dtype), sin.to(dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU in fp32 (or wider), rounded back to x's dtype."""
    return pointwise(torch.nn.functional.silu, x.to(compute_dtype(x.dtype))).to(x.dtype)


def _one_row_attention(q, k, v, allowed, last, scaling):
    """q [H, Q, D], k/v [H, T, D] (acc dtype), allowed [Q, T] bool, last [Q] each query's last key
    -> [H, Q, D]. Keys after `last` never reach a query's numbers; keys not allowed are exact zeros."""
    s = (q[:, :, None, :] * k[:, None, :, :]).sum(-1) * scaling  # [H, Q, T], one reduction over D each
    neg = torch.tensor(float("-inf"), dtype=s.dtype, device=s.device)
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    m = torch.where(allowed, s, neg).amax(-1, keepdim=True)  # max is exact in any order
    m = torch.where(torch.isfinite(m), m, zero)  # a padding query with no key: any finite value
    e = torch.where(allowed, pointwise(torch.exp, s - m), zero)
    idx = last.view(1, -1, 1).expand(e.shape[0], -1, 1)
    denom = e.cumsum(-1).gather(-1, idx)  # [H, Q, 1]: the running sum read at the last key
    denom = torch.where(denom > 0, denom, torch.ones((), dtype=s.dtype, device=s.device))
    # Not-allowed keys give exact zeros, whatever their values (padding may hold anything, even NaN).
    num = torch.where(allowed[None, :, :, None], e[..., None] * v[:, None, :, :], zero).cumsum(2)  # [H, Q, T, D]
    num = num.gather(2, idx[..., None].expand(-1, -1, 1, v.shape[-1])).squeeze(2)
    return num / denom


def attention(query, key, value, key_mask, scaling: float, segments: list[int] | None = None):
    """Causal attention, batch invariant: query [B, H, Q, D], key/value [B, KVH, T, D] (the last Q keys
    are the queries' own positions) -> [B, Q, H, D] in query's dtype.

    key_mask: [B, T] bool, the real keys (left or right padding), or None (all real). segments: packed
    rows (B == 1, no mask): the lengths of the sequences in the row; each attends only within itself."""
    b, h, nq, d = query.shape
    t = key.shape[2]
    acc = compute_dtype(query.dtype)
    rep = h // key.shape[1]
    if rep > 1:  # grouped-query attention: each KV head serves `rep` query heads (an exact copy)
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    q, k, v = (x.to(acc).contiguous() for x in (query, key, value))
    if segments is not None and len(segments) > 1:
        if b != 1 or nq != t or key_mask is not None:
            raise ValueError("packed attention needs one row, as many queries as keys and no mask")
        outs, start = [], 0
        for n in segments:
            sl = slice(start, start + n)
            outs.append(attention(query[:, :, sl], key[:, :, sl], value[:, :, sl], None, scaling))
            start += n
        return torch.cat(outs, 1)
    pos = torch.arange(t, device=q.device)
    last = pos[t - nq:]  # query i sits at key position t - nq + i
    causal = pos[None, :] <= last[:, None]  # [Q, T]
    rows = []
    for i in range(b):
        allowed = causal if key_mask is None else causal & key_mask[i].bool()[None, :]
        rows.append(_one_row_attention(q[i], k[i], v[i], allowed, last, scaling))
    out = torch.stack(rows)  # [B, H, Q, D]
    return out.transpose(1, 2).contiguous().to(query.dtype)


def logsumexp(z: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dim of a contiguous fp32 z, row by row."""
    z = z.contiguous()
    m = z.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return (m + pointwise(torch.log, pointwise(torch.exp, z - m).sum(-1, keepdim=True))).squeeze(-1)


def log_softmax(z: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, row by row (the engine's whole-vocabulary form)."""
    return z - logsumexp(z)[..., None]


def token_logprobs(z: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(z)[targets] for z [..., V] (already divided by the temperature): the same numbers as
    `log_softmax(z)` read at the targets (one subtraction of the same two values)."""
    return z.gather(-1, targets[..., None]).squeeze(-1) - logsumexp(z)


def entropy(z: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(z) per row, no gradient (a metric, not part of parity)."""
    with torch.no_grad():
        lse = logsumexp(z)
        p = pointwise(torch.exp, z - lse[..., None])
        return lse - (p * z).sum(-1)


def segment_lengths(position_ids: torch.Tensor) -> list[int]:
    """Lengths of the sequences packed in one row, from where its position ids restart at 0."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(pos == 0).reshape(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    bounds = [*starts, pos.numel()]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]
