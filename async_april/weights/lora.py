"""LoRA adapters on the wire and the one merge every side runs (learner export, engines, `export --merge`).

An adapter update names each adapted weight by the ENGINE's parameter name (the base model's, e.g.
`model.layers.0.self_attn.q_proj.weight`) plus a suffix:

    <weight>.lora_A    A, r x in
    <weight>.lora_B    scale * B, out x r      (scale = lora alpha / rank, folded in by the sender)

and the weight the engine runs is `merge_lora(W_base, A, scaled_B)` = W_base + scaled_B @ A, computed in
fp32 and cast to W's dtype. The learner's merged export, the torch engine's own merge and
`async-april export --merge` all call this function, so an engine that merges adapters itself and one
that is sent merged weights hold the same bits.

Pure tensor code; imports neither actors/ nor learners/ (both use it).
"""

from __future__ import annotations

from typing import Iterable

import torch

LORA_A_SUFFIX = ".lora_A"
LORA_B_SUFFIX = ".lora_B"


def adapter_names(weight: str) -> tuple[str, str]:
    """The payload names of the adapter pair of base weight `weight`."""
    return weight + LORA_A_SUFFIX, weight + LORA_B_SUFFIX


def is_adapter_name(name: str) -> bool:
    return name.endswith((LORA_A_SUFFIX, LORA_B_SUFFIX))


def base_weight_name(name: str) -> str:
    """`<weight>.lora_A` / `<weight>.lora_B` -> `<weight>`."""
    for suffix in (LORA_A_SUFFIX, LORA_B_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    raise ValueError(f"{name!r} is not an adapter tensor name (ends neither in {LORA_A_SUFFIX} nor {LORA_B_SUFFIX})")


def merge_lora(base: torch.Tensor, a: torch.Tensor, scaled_b: torch.Tensor) -> torch.Tensor:
    """W_base + scaled_B @ A in fp32 (bf16 weights would round the small update away), cast to W's dtype."""
    if a.ndim != 2 or scaled_b.ndim != 2 or a.shape[0] != scaled_b.shape[1]:
        raise ValueError(f"LoRA factors do not chain: A {tuple(a.shape)}, B {tuple(scaled_b.shape)} (want A r x in, B out x r)")
    if (scaled_b.shape[0], a.shape[1]) != tuple(base.shape):
        raise ValueError(f"LoRA update {scaled_b.shape[0]} x {a.shape[1]} does not fit the weight {tuple(base.shape)}")
    delta = scaled_b.to(device=base.device, dtype=torch.float32) @ a.to(device=base.device, dtype=torch.float32)
    return (base.float() + delta).to(base.dtype)


def pair_adapters(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base weight name: (A, scaled B)} from adapter tensors; an A without its B (or the reverse) is an error."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in named:
        halves.setdefault(base_weight_name(name), {})[name[-len(LORA_A_SUFFIX):]] = t
    out = {}
    for weight, pair in halves.items():
        if set(pair) != {LORA_A_SUFFIX, LORA_B_SUFFIX}:
            raise ValueError(f"adapter update: {weight!r} has only {sorted(pair)}; both {LORA_A_SUFFIX} and {LORA_B_SUFFIX} are needed")
        out[weight] = (pair[LORA_A_SUFFIX], pair[LORA_B_SUFFIX])
    return out
