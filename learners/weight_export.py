"""Weights out of a learner rank: the full model, bucketed for the engines (object store, disk, NCCL).

A mixin of `LearnerWorker` (learners/worker.py), kept apart because it is its own idea: how sharded
parameters leave the learner, one bucket at a time, in the format of async_april/weights/buckets.py.
It uses the worker's `cfg`, `model`, `optimizer`, `rank`, `device` and `lora` (None, or learners/lora.py's
`LoraExport`: adapter factors or merged weights under the base model's names). Every method is collective.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from async_april.weights.buckets import TensorSpec, plan_buckets


class WeightExport:
    """Full weights of an FSDP2 model, gathered one tensor at a time (see the module docstring)."""


    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 CPU tensors on rank 0, {} elsewhere. Collective."""
        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.rank == 0 else {}

    def full_optimizer_state_dict(self) -> dict[str, Any]:
        """Full optimizer state (CPU) on rank 0, {} elsewhere. Collective; for tests and tools."""
        osd = get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return osd if self.rank == 0 else {}

    def weight_specs(self) -> list[TensorSpec]:
        """Name, export dtype and full shape of every tensor sent to the engines, in send order."""
        dtype = getattr(torch, self.cfg.model.dtype)
        if self.lora is not None:  # adapters only, or merged weights under the base names (learners/lora.py)
            return self.lora.specs(self.model, dtype)
        # Tied parameters (lm_head = embed_tokens) travel once, under their first name: engines
        # share the storage too (TorchEngine covers them by identity, SGLang skips a tied lm_head).
        every = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        tied = every - {n for n, _ in self.model.named_parameters()}
        return [
            TensorSpec(name, str(dtype if t.is_floating_point() else t.dtype).removeprefix("torch."), tuple(t.shape))
            for name, t in self.model.state_dict().items()
            if name not in tied
        ]

    def iter_weight_buckets(self, bucket_mb: float, device: str = "cpu") -> Iterator[dict[str, torch.Tensor]]:
        """Yield full-weight buckets (rank 0 gets tensors, other ranks empty dicts). Collective.

        Tensors are gathered one at a time in bucket order, so rank 0 holds at
        most one bucket of full tensors at once.
        """
        sd = self.model.state_dict()
        for bucket in plan_buckets(self.weight_specs(), bucket_mb):
            out: dict[str, torch.Tensor] = {}
            for spec in bucket:
                if self.lora is not None:
                    full = self.lora.full_tensor(sd, spec.name)
                else:
                    t = sd[spec.name]
                    full = t.full_tensor() if isinstance(t, DTensor) else t
                if self.rank == 0:
                    out[spec.name] = full.detach().to(device=device, dtype=getattr(torch, spec.dtype))
            yield out

    def weight_buckets(self, bucket_mb: float) -> list[Any]:
        """Put each bucket in the Ray object store; rank 0 returns the ObjectRefs in order, others []."""
        import ray

        refs = []
        for bucket in self.iter_weight_buckets(bucket_mb):
            if self.rank == 0:
                refs.append(ray.put(bucket))
        return refs

    def write_weights(self, root: str, bucket_mb: float, version: int) -> str | None:
        """Disk transport: rank 0 writes safetensors buckets + manifest under root/v{version}. Collective."""
        from async_april.weights.buckets import DiskBucketWriter

        writer = DiskBucketWriter(root, version) if self.rank == 0 else None
        for bucket in self.iter_weight_buckets(bucket_mb):
            if writer is not None:
                writer.add(bucket)
        return writer.commit() if writer is not None else None

    def init_weight_broadcast(self, master_addr: str, master_port: int, world_size: int, group_name: str,
                              backend: str = "nccl", timeout_s: float = 600.0) -> None:
        """NCCL transport, rank 0 only: join the learner->engines broadcast group as its rank 0 (`backend`:
        weight_buckets.broadcast_backend of this rank's device); an earlier group is destroyed first."""
        from async_april.weights.buckets import init_broadcast_group

        if self.rank == 0:
            self.destroy_weight_broadcast()
            self._bcast_group = init_broadcast_group(master_addr, master_port, world_size, 0, group_name,
                                                     backend=backend, timeout_s=timeout_s)

    def destroy_weight_broadcast(self) -> None:
        """Rank 0's half of the broadcast group, if any (the engines destroy theirs themselves)."""
        from async_april.weights.buckets import destroy_broadcast_group

        group, self._bcast_group = getattr(self, "_bcast_group", None), None
        if group is not None:
            destroy_broadcast_group(group)

    def broadcast_weights(self, bucket_mb: float) -> None:
        """NCCL transport: gather each bucket (all ranks), rank 0 broadcasts it to the engines."""
        for bucket in self.iter_weight_buckets(bucket_mb, device=str(self.device)):
            if self.rank == 0:
                for t in bucket.values():
                    dist.broadcast(t, src=0, group=self._bcast_group)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
