"""The only place that applies FSDP2, activation checkpointing and compile to a model.

Order (as torchtitan's `parallelize.py`): activation checkpointing, then
`torch.compile` per decoder layer, then `fully_shard` per decoder layer and
finally the root (embeddings, final norm, lm_head). Gradients are SUMMED
across ranks, not averaged: the loss is already normalised by the global
token / sequence count of the whole step batch (see docs/learner.md).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

FLASH_ATTN_HINT = (
    "model.attn_implementation=flash_attention_2 needs FlashAttention 2 (the flash-attn package) and a CUDA GPU; "
    "the [gpu] extra does not bring it: install it after that extra with `pip install flash-attn "
    "--no-build-isolation` (README). flash-attn-4, which sglang 0.5.23 pulls in, is not FA2. "
    "Otherwise use model.attn_implementation=sdpa"
)


def flash_attn_2_installed() -> bool:
    """FlashAttention 2 itself. flash-attn-4 (a dependency of sglang 0.5.23) installs a bare `flash_attn/cute`
    namespace, so `find_spec("flash_attn")` is true without FA2 (transformers' `is_flash_attn_2_available`
    checks the distribution name for the same reason); FA2 ships a regular `flash_attn` package (an
    `__init__.py`: a spec with an origin) and its CUDA extension, the top-level `flash_attn_2_cuda`."""
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and spec.origin is not None and importlib.util.find_spec("flash_attn_2_cuda") is not None


def resolve_attn_implementation(name: str) -> str:
    """Check that the requested attention kernel can run here; return the name for transformers."""
    if name == "flash_attention_2" and not flash_attn_2_installed():
        raise RuntimeError(FLASH_ATTN_HINT)
    if name not in ("sdpa", "eager", "flash_attention_2"):
        raise ValueError(f"model.attn_implementation={name!r}: expected sdpa, eager or flash_attention_2")
    return name


def make_mesh(device_type: str, world_size: int) -> DeviceMesh:
    """A 1-D data-parallel mesh over all ranks of the default process group."""
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a Hugging Face causal LM (`model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `model.layers` ModuleList; cannot shard it per decoder layer")
    return layers


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    mixed_precision: bool,
    activation_checkpointing: bool = False,
    compile: bool = False,
    reshard_after_forward: bool = True,
    offload_optimizer: bool = False,
) -> nn.Module:
    """Shard `model` in place with FSDP2 and return it.

    mixed_precision: bf16 parameters in forward/backward, fp32 gradient
    reduction (GPU); off keeps everything fp32 (CPU). The fp32 master weights
    and optimizer state stay sharded either way.

    offload_optimizer (learner.offload_optimizer): FSDP2's CPUOffloadPolicy. torch 2.13's
    torch/distributed/fsdp/_fully_shard/_fsdp_api.py: it "offloads parameters, gradients, and optimizer
    states to CPU. Sharded parameters are copied host-to-device before all-gather ... Sharded gradients
    are copied device-to-host in backward, and the optimizer step runs on CPU with CPU optimizer states"
    (_fsdp_param.py `_init_sharded_param` copies each padded shard back to the CPU, pinned, after
    _fsdp_init.py moved the unit to the mesh's device, and `all_gather_inputs` copies it in for each
    all-gather; _fsdp_param_group.py `_validate_cpu_offload_params` checks the shards stay on the CPU).
    Pinning needs CUDA, so only on GPU.
    """
    if activation_checkpointing:
        # transformers' own per-layer checkpointing keeps parameter names unchanged
        # (a checkpoint_wrapper would insert `_checkpoint_wrapped_module.`).
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = decoder_layers(model)
    if compile:
        for layer in layers:
            layer.compile()  # in place: names stay `model.layers.N.*`
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_optimizer else OffloadPolicy()
    for i, layer in enumerate(layers):
        # The last layer is gathered again at once by the root's backward; keep it unsharded.
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload,
                    reshard_after_forward=reshard_after_forward and i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard_after_forward)
    set_gradient_sum(model)
    return model


def set_gradient_sum(model: nn.Module) -> None:
    """Make every FSDP unit SUM gradients across ranks instead of averaging them.

    The loss of each rank is already divided by the global token count, so the
    sum over ranks is the gradient of the global loss. Forcing SUM-type
    collectives also avoids PREMUL_SUM, which gloo does not implement.
    """
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
