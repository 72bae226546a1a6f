"""Exact packed attention for `sdpa` without a [T, T] mask.

A packed micro-batch is one row of T tokens holding many sequences, with position
ids restarting at 0 where each begins (learners/logprobs.py). On `sdpa`,
transformers keeps attention within each sequence by building a block-diagonal
causal mask [1, 1, T, T] (masking_utils `find_packed_sequence_indices`), and a
masked `scaled_dot_product_attention` then computes, and on CPU stores for
backward, all T x T scores: measured on the tiny model with 32 rows of 128
tokens, the learner's peak doubled (0.27 GB to 0.54 GB) against right padding,
where each row's scores are only 128 x 128. Flash-attention's varlen kernel
avoids this on GPU; this is the same idea for `sdpa`:

    attention "sdpa_packed" (registered with transformers' AttentionInterface)
      no attention mask (a packed or unpadded batch):
          segments = where position_ids restart;  for each: sdpa(q_s, k_s, v_s, is_causal=True)
      an attention mask (a right-padded batch): plain sdpa with transformers' mask

Its mask function builds no mask when the caller passed none (the packed
call), and transformers' sdpa mask otherwise, so the padded path is unchanged.
The cost is a Python loop over the micro-batch's sequences per layer, small
next to the attention itself.

The row lengths reach every layer as a forward kwarg, `packed_seq_lens` (host
ints, known when the micro-batch was collated: `forward_kwargs`), the way
transformers hands flash attention its `cu_seq_lens_q` / `max_length_q`
(modeling_flash_attention_utils.py, "pre-computed `cu_seqlens`"): the model
passes its forward's **kwargs down to each attention call. Derived from the
position ids in every layer instead, they cost a `.tolist()`, a device sync,
per layer on GPU; that stays only as the fallback for a caller that passes
restarting position ids without them. torch.compile of a layer traces the
kwarg (ints) without the graph break the `.tolist()` made.

Attention stays plain causal within each row, so a model with a sliding
window is refused (`check_model`), as sequence parallelism refuses it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from async_april.errors import UserError
from async_april.parity.kernels import segment_lengths  # one definition: the parity kernels split packed rows the same way

ATTN_NAME = "sdpa_packed"
"""The attention implementation the learner uses for `sdpa` when `learner.packing` is on."""
PARITY_ATTN_NAME = "parity"
"""Parity mode's attention (async_april/parity/model.py), which takes the same row lengths."""
LENGTHS_KWARG = "packed_seq_lens"
"""The forward kwarg carrying a packed row's sequence lengths (a tuple of ints) to every attention call."""


class SlidingWindowError(UserError, ValueError):
    """A model with sliding-window attention where the learner runs plain causal attention."""


def uses_sliding_window(config) -> bool:
    """Whether any layer of the model attends within a window: Qwen2/3 (`use_sliding_window`, then
    `layer_types` "sliding_attention" from `max_window_layers` on), Gemma (`layer_types`), Mistral
    (`sliding_window` set, no switch)."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return True
    if getattr(config, "use_sliding_window", None) is False:
        return False
    return getattr(config, "sliding_window", None) is not None


SLIDING_WINDOW_REFUSAL = (
    "learner.packing with model.attn_implementation=sdpa runs plain causal attention within each packed row "
    f"({ATTN_NAME}); this model uses a sliding window. Set learner.packing=false (or "
    "model.attn_implementation=flash_attention_2, whose varlen kernel keeps the window)")


def check_model(config) -> None:
    """Refuse a sliding-window model when the learner loads it: sdpa_packed attends causally over each whole row."""
    if uses_sliding_window(config):
        raise SlidingWindowError(SLIDING_WINDOW_REFUSAL)


def forward_kwargs(model: nn.Module, seq_lens: tuple[int, ...] | None) -> dict[str, Any]:
    """Extra kwargs of a packed forward: the row lengths for sdpa_packed, nothing for other attentions."""
    if seq_lens is None or getattr(model.config, "_attn_implementation", None) not in (ATTN_NAME, PARITY_ATTN_NAME):
        return {}
    return {LENGTHS_KWARG: tuple(seq_lens)}


def packed_sdpa_attention(module: nn.Module, query, key, value, attention_mask, position_ids=None,
                          packed_seq_lens: tuple[int, ...] | None = None, **kwargs):
    """transformers attention function: query/key/value [B, heads, T, dim] -> ([B, T, heads, dim], None).
    `packed_seq_lens`: the packed row's sequence lengths (module docstring), else read from `position_ids`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if packed_seq_lens is None and position_ids is None:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    if kwargs.get("sliding_window") is not None:  # the learner refused the model at load; a direct caller too
        raise SlidingWindowError(SLIDING_WINDOW_REFUSAL)
    lengths = list(packed_seq_lens) if packed_seq_lens is not None else segment_lengths(position_ids)
    if sum(lengths) != query.shape[2]:
        raise ValueError(f"{LENGTHS_KWARG} sum to {sum(lengths)} tokens, the packed row has {query.shape[2]}")
    if len(lengths) == 1:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    outs = [
        sdpa_attention_forward(module, q, k, v, None, **kwargs)[0]
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2))
    ]
    return torch.cat(outs, dim=1), None


def packed_sdpa_mask(*args, attention_mask=None, **kwargs):
    """No mask for a call without one (packed: the attention function splits by position ids);
    transformers' sdpa mask for a right-padded call."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Register the attention and mask functions with transformers; returns their name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_NAME, packed_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, packed_sdpa_mask)
    return ATTN_NAME
