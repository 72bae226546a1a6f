"""Parity mode on a Hugging Face decoder (`model.parity`): the same kernels in the engine and the learner.

`install(model, dtype)` points the modules of a Qwen2/Llama-style model at async_april/parity/kernels.py,
per instance (the classes are untouched), so the model's own forward -- the torch engine's KV-cache
prefill and decode, the learner's padded, packed and chunked-head forwards, FSDP2's hooks around each
module -- computes every token with the batch-invariant kernels:

    nn.Linear (q/k/v/o, MLP, an untied lm_head)   kernels.linear, weight and input rounded to `dtype`
    peft lora.Linear                              kernels.linear on the weight THE ENGINE holds:
                                                  adapter sync merge_lora(base in dtype, A, scale B),
                                                  merged sync merge_lora(base, A, scale B) in dtype
                                                  (actors/engines/torch_batch.py, learners/lora.py)
    nn.Embedding                                  the lookup, rounded to `dtype`
    *RMSNorm, *RotaryEmbedding, the MLP's SiLU   kernels.rms_norm / rotary / silu
    attention                                     kernels.attention, registered as ATTN_NAME
    the logits                                    fp32 from kernels.linear; the logprob is
                                                  kernels.token_logprobs in both (engine: log_softmax)

`dtype` is `model.dtype`: the engine's parameter dtype. The learner keeps fp32 master weights and rounds
them to it in each forward, so in bf16 both sides compute with the same bf16 weights and activations.
The gradient flows through ordinary matmuls (kernels.linear's backward): parity is about the values.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from async_april.weights.lora import merge_lora
from async_april.parity import kernels

ATTN_NAME = "parity"
"""The attention implementation registered with transformers' AttentionInterface in parity mode."""
SEQ_LENS_KWARG = "packed_seq_lens"
"""The forward kwarg with a packed row's sequence lengths (the learner's, learners/packed_attention.py)."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return _DTYPES[dtype] if isinstance(dtype, str) else dtype


def _segments(position_ids, packed_seq_lens):
    if packed_seq_lens is not None:
        return list(packed_seq_lens)
    return None if position_ids is None else kernels.segment_lengths(position_ids)


def parity_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None,
                     packed_seq_lens=None, sliding_window=None, **kwargs):
    """transformers attention function (query [B, H, Q, D], key/value [B, KVH, T, D]) -> ([B, Q, H, D], None)."""
    if sliding_window is not None:
        raise ValueError("model.parity runs plain causal attention; this model uses a sliding window")
    if dropout:
        raise ValueError("model.parity: attention dropout would make the learner's values differ from the engine's")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    segments = None
    if attention_mask is None and query.shape[0] == 1 and query.shape[2] == key.shape[2]:
        segments = _segments(position_ids, packed_seq_lens)
    return kernels.attention(query, key, value, attention_mask, scale, segments), None


def parity_mask(*args, attention_mask=None, kv_length=None, **kwargs):
    """The padding mask as [B, kv_length] bool (None: every key real); causality is the attention's own."""
    if attention_mask is None:
        return None
    m = attention_mask.bool()
    if kv_length is not None and m.shape[-1] != kv_length:
        raise ValueError(f"parity mask has {m.shape[-1]} keys, the attention {kv_length}")
    return m if not bool(m.all()) else None


def register() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_NAME, parity_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, parity_mask)
    return ATTN_NAME


def _linear_forward(dtype, out_dtype=None):
    def forward(self, x):
        return kernels.linear(x, self.weight, self.bias, dtype, out_dtype)
    return forward


def lora_engine_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype,
                       sync: str) -> torch.Tensor:
    """The weight the torch engine holds for an adapted layer, differentiable in a and b: adapter sync merges
    into its kept base (in its dtype), merged sync casts the learner's fp32 merge (learners/lora.py LoraExport)."""
    if sync == "adapter":
        return merge_lora(base.to(dtype), a.float(), b.float() * scale)
    return merge_lora(base, a, b.float() * scale).to(dtype)


def _peft_forward(dtype, sync: str, adapter: str):
    def forward(self, x, *args, **kwargs):
        if args or kwargs or self.disable_adapters or self.merged:
            raise ValueError("model.parity supports a plain peft LoRA layer (one adapter, not merged, no extra arguments)")
        base = self.base_layer
        w = lora_engine_weight(base.weight, self.lora_A[adapter].weight, self.lora_B[adapter].weight,
                               self.scaling[adapter], dtype, sync)
        return kernels.linear(x, w, base.bias, dtype)
    return forward


def _embedding_forward(dtype):
    def forward(self, ids):
        return nn.functional.embedding(ids, self.weight, self.padding_idx).to(dtype)
    return forward


def _norm_forward(dtype):
    def forward(self, x):
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
        return kernels.rms_norm(x, self.weight, eps, dtype)
    return forward


def _rotary_forward(self, x, position_ids):
    if getattr(self, "rope_type", "default") != "default":
        raise ValueError(f"model.parity supports the default rotary embedding, not {self.rope_type!r}")
    return kernels.rotary(position_ids, self.parity_inv_freq.to(x.device), self.attention_scaling, x.dtype)


class _SiLU(nn.Module):
    def forward(self, x):
        return kernels.silu(x)


def install(model: nn.Module, dtype: str | torch.dtype, lora_sync: str = "adapter", keep_attention: bool = False) -> nn.Module:
    """Route every module of `model` through the parity kernels (module docstring); idempotent. Before FSDP2's
    fully_shard and before the learner's LogprobHead is asked for logprobs (it checks `parity_dtype`).
    keep_attention: leave the attention function as it is (sequence parallelism's Ulysses wrapper, which calls
    kernels.attention itself in parity mode: learners/sequence_parallel.py)."""
    dt = as_dtype(dtype)
    if getattr(model, "parity_dtype", None) is not None:
        return model
    try:
        from peft.tuners.lora import Linear as LoraLinear
    except ImportError:  # peft is only needed with LoRA
        LoraLinear = ()  # noqa: N806
    head = model.get_output_embeddings()
    lora_bases = set()
    for m in model.modules():
        if LoraLinear and isinstance(m, LoraLinear):
            if m.lora_variant or m.fan_in_fan_out or list(m.lora_A) != ["default"]:
                raise ValueError("model.parity supports plain LoRA adapters (one adapter, no DoRA, weights out x in)")
            m.forward = types.MethodType(_peft_forward(dt, lora_sync, "default"), m)
            lora_bases.add(id(m.base_layer))
    for name, m in model.named_modules():
        kind = type(m).__name__
        if isinstance(m, nn.Linear):
            if id(m) in lora_bases:
                continue
            m.forward = types.MethodType(_linear_forward(dt, torch.float32 if m is head else None), m)
        elif isinstance(m, nn.Embedding):
            m.forward = types.MethodType(_embedding_forward(dt), m)
        elif kind.endswith("RMSNorm"):
            m.forward = types.MethodType(_norm_forward(dt), m)
        elif kind.endswith("RotaryEmbedding"):
            # A plain attribute, not a buffer: `model.to(bfloat16)` (the engine) would round the buffer, and the
            # learner's stays fp32; both use the fp32 frequencies the model was built with.
            m.parity_inv_freq = m.inv_freq.detach().to(torch.float32).clone()
            if m.inv_freq.dtype != torch.float32:
                raise ValueError("model.parity: install before casting the model (its rotary frequencies are rounded)")
            m.forward = types.MethodType(_rotary_forward, m)
        elif hasattr(m, "act_fn") and isinstance(getattr(m, "act_fn"), nn.Module):
            act = type(m.act_fn).__name__.lower()
            if "silu" not in act and "swish" not in act:
                raise ValueError(f"model.parity supports SiLU MLPs, not {type(m.act_fn).__name__} in {name}")
            m.act_fn = _SiLU()
    if not keep_attention:
        for cfg in {id(c): c for c in _configs(model)}.values():
            cfg._attn_implementation = register()
    if hasattr(head, "request"):  # the learner's LogprobHead (learners/chunked_logprobs.py): head_logprobs
        head.parity_dtype = dt
    model.parity_dtype = dt
    return model


def _configs(model: nn.Module):
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "_attn_implementation"):
            yield c


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                  dtype: torch.dtype, with_entropy: bool = False):
    """The learner's head in parity mode: fp32 logits from kernels.linear, divided by the temperature, the
    targets' logprobs by kernels.token_logprobs (the engine: kernels.log_softmax at the sampled token)."""
    z = kernels.linear(hidden, weight, None, dtype, torch.float32)
    if temperature != 1.0:
        z = z / temperature
    lp = kernels.token_logprobs(z, targets)
    return (lp, kernels.entropy(z)) if with_entropy else (lp, None)
