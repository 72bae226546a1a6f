"""One learner rank: FSDP2 model, optimizer, micro-batched IS-corrected update.

A plain class: `LearnerGroup` wraps it in one Ray actor per rank, and it also
runs under torchrun or in a single process (world_size=1) for tests. Here: the update loop and
the rank state it owns. Set-up before the model exists (device, process group, seeds, loading) is
learners/rank_setup.py; the maths is in learners/update.py, logprobs.py, chunked_logprobs.py,
packed_attention.py, dropout.py and sequence_parallel.py; export in weight_export.py.

    train_step(batch):
        mini-batches = learner.mini_batches consecutive parts of the FULL batch (learners/update.py)
        rows of this rank = mini.shard(dp_rank, dp_size)   global_tokens / sequences from the FULL mini-batch
        [learner.sequence_parallel S > 1: dp = rank // S of world // S; the S ranks split each row's positions]
        [decoupled/none/rejection against pi_prox, several mini-batches, or rejected tokens out of the
         normaliser: proximal logprobs of every row, no grad, pre-update weights (learners/update.py)]
        [rejected tokens out of the normaliser: global_tokens / sequences = the KEPT ones, summed over ranks]
        for each mini-batch:
          micro-batches by token budget, packed (learner.packing) or right-padded (same count on every
          rank; empty ones run a zero-loss forward)
          for each micro-batch: logprobs (grad) + entropy [+ proximal: precomputed, or logprobs.detach()
                                with one mini-batch] [+ ref, no grad]
                                [dropout on: values from an eval-mode forward, gradient from the train-mode
                                 one (learners/dropout.py); proximal forwards in eval mode]
                                loss = policy_loss(..., behaviour logprobs exactly as sampled)
                                loss.backward()            FSDP2 reduce-scatters, SUM over ranks
          clip grad norm -> finite?  optimizer step  else skip it (zero grads)
        unless every mini-batch was skipped: scheduler step, version += 1 (else one more consecutive bad step)

Every method that touches the model is collective: call it on all ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import resource
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from async_april.errors import WeightsDivergedError
from learners import checkpoint as ckpt
from learners import dropout, lora
from learners import sequence_parallel as seqpar
from learners.hf_dir import write_hf_dir
from learners.logprobs import collate, response_logprobs
from learners.optim import make_lr_scheduler, peak_flops
from learners.rank_setup import join_process_group, load_model, pick_device, seed_everything
from learners.update import (kept_counts, mean_over_mini_batches, merge_rank_metrics, needs_proximal_forward,
                             pack_micro_batches, split_mini_batches)
from learners.weight_export import WeightExport
from learners.parallelize import make_mesh, parallelize

if TYPE_CHECKING:
    from async_april.rollout.batch import TrainBatch
    from async_april.config import Config

INJECT_NAN_ENV = "ASYNC_APRIL_INJECT_NAN_STEPS"
"""TEST HOOK (docs/reliability.md): comma-separated learner steps (1-based train_step calls) whose
loss is multiplied by NaN before backward, to exercise the bad-step path. Unset in real runs."""


def parse_inject_steps(text: str) -> frozenset[int]:
    return frozenset(int(x) for x in text.replace(" ", "").split(",") if x)


class LearnerWorker(WeightExport):
    """One FSDP2 rank. See the module docstring for the step."""

    def __init__(
        self,
        cfg: "Config",
        model_path: str,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
    ) -> None:
        from async_april.models.paths import model_path_on_this_node

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.model_path = str(model_path_on_this_node(cfg.model, model_path))  # a hub ID resolves per node
        lc = cfg.learner
        self.device = pick_device(lc)
        join_process_group(self.device, lc, rank, world_size, master_addr, master_port)
        seed_everything(cfg.run.seed)
        model = load_model(cfg, self.model_path)
        self.hf_config = model.config
        # Sequence parallelism (learners/sequence_parallel.py): Ulysses attention, rows sharded over "dp" only.
        self.sp = seqpar.setup(model, world_size, lc.sequence_parallel, self.device.type)
        self.dp_rank, self.dp_size = (self.sp.dp_rank, self.sp.dp_size) if self.sp else (rank, world_size)
        self._counts_rows = self.sp is None or self.sp.rank == 0  # an sp group's ranks share rows: report them once
        self.num_params = sum(p.numel() for p in model.parameters())
        ref = None
        if cfg.algorithm.kl_coef > 0:
            ref = copy.deepcopy(model).requires_grad_(False).eval()
        model.train()
        self.mesh = make_mesh(self.device.type, world_size)
        gpu = self.device.type == "cuda"
        self.lora = lora.LoraExport(lora.apply_lora(model, lc.lora), lc.lora, lora.sync_mode(cfg)) if lc.lora.enabled else None
        if self.lora is not None and gpu:
            lora.freeze_base_dtype(model, torch.bfloat16)  # frozen: no fp32 master copy needed
        if cfg.model.parity:  # the engine's kernels and dtype in every forward (async_april/parity/); after LoRA, before FSDP2
            from async_april.parity.model import install

            install(model, cfg.model.dtype, lora_sync=lora.sync_mode(cfg) if self.lora else "adapter",
                    keep_attention=self.sp is not None)
            seqpar.set_parity(self.sp is not None)
        self.model = parallelize(
            model, self.mesh, mixed_precision=gpu, activation_checkpointing=lc.activation_checkpointing, compile=lc.compile,
            offload_optimizer=lc.offload_optimizer,
        )
        self.ref_model = parallelize(ref, self.mesh, mixed_precision=gpu) if ref is not None else None
        self._dropout = dropout.has_dropout(self.model)  # logprob values from an eval forward (learners/dropout.py)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=lc.lr, betas=tuple(lc.betas), weight_decay=lc.weight_decay, eps=1e-8
        )
        self.scheduler = make_lr_scheduler(self.optimizer, lc, cfg.run.steps)
        from async_april.algorithms.losses import LossSettings

        self.loss_settings = LossSettings.from_config(cfg.algorithm, cfg.rollout.max_new_tokens)
        self.step = 0
        self.version = 0
        self.bad_steps = 0
        self.pad_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        self._inject_nan_steps = parse_inject_steps(os.environ.get(INJECT_NAN_ENV, ""))

    # ------------------------------------------------------------------ train

    def train_step(self, batch: "TrainBatch") -> dict[str, float]:
        """`learner.mini_batches` optimizer updates on `batch` (the FULL step batch; each rank trains
        its shard of every mini-batch). Bumps the version unless every update was skipped."""
        t0 = time.perf_counter()
        if len(batch) == 0 or batch.num_response_tokens == 0:
            raise ValueError("train_step got a batch with no response tokens")
        lc = self.cfg.learner
        minis = split_mini_batches(batch, lc.mini_batches)  # identical on every rank
        parts = [m.shard(self.dp_rank, self.dp_size) for m in minis]
        if needs_proximal_forward(self.loss_settings, lc.mini_batches):
            parts = [self._with_proximal(p) for p in parts]  # all of it before the first update
        lr = self.scheduler.get_last_lr()[0]
        inject_nan = self.step + 1 in self._inject_nan_steps
        per_mini = [self._update(mini, part, inject_nan) for mini, part in zip(minis, parts)]
        stepped = sum(not m.pop("_skipped") for m in per_mini)
        bad = stepped == 0
        if bad:
            self._count_bad_step(per_mini[-1])
        else:
            self.bad_steps = 0
            self.scheduler.step()  # per rollout batch, as run.steps and learner.warmup_steps count (verl, AReaL)
            self.version += 1
        self.step += 1
        elapsed = time.perf_counter() - t0
        all_tokens = sum(m.pop("_forward_tokens") for m in per_mini)
        peak_mem_gb = max(m.pop("_peak_mem_gb") for m in per_mini)
        out = mean_over_mini_batches(per_mini)
        out.update({
            "train/lr": lr,
            "train/policy_version": float(self.version),
            "train/bad_step": float(bad),
            "train/consecutive_bad_steps": float(self.bad_steps),
            "train/response_tokens": float(batch.num_response_tokens),
            "train/mini_batches": float(len(minis)),
            "train/optimizer_steps": float(stepped),
            "perf/learner_tokens_per_s": all_tokens / elapsed,
            "perf/peak_mem_gb": peak_mem_gb,
            "timing_s/train": elapsed,
        })  # fmt: skip
        if self.device.type == "cuda":
            peak = peak_flops(torch.cuda.get_device_name(self.device))
            if peak:
                out["perf/mfu"] = 6.0 * self.num_params * all_tokens / elapsed / (peak * self.world_size)
        return out

    def _update(self, mini: "TrainBatch", local: "TrainBatch", inject_nan: bool) -> dict[str, float]:
        """One optimizer step on mini-batch `mini`, of which this rank trains `local`. The loss is
        normalised by the whole mini-batch's tokens and sequences (all micro-batches, all ranks)."""
        from async_april.algorithms.losses import policy_loss
        from async_april.algorithms.mismatch import finalize_mismatch

        batch_tokens = float(mini.num_response_tokens)
        global_tokens, global_sequences = batch_tokens, float(len(mini))
        if self.loss_settings.rejection.counts_before_step:  # rejected tokens leave the normaliser
            counts = kept_counts(local, self.loss_settings) if self._counts_rows else (0, 0)  # once per sp group
            kept = torch.tensor(counts, dtype=torch.int64, device=self.device)
            dist.all_reduce(kept, op=dist.ReduceOp.SUM)
            # Every token rejected: the loss is zero whatever divides it.
            global_tokens, global_sequences = float(max(int(kept[0]), 1)), float(max(int(kept[1]), 1))
        lengths = np.array([len(x) for x in local.input_ids], np.int64)
        groups = pack_micro_batches(lengths, self.cfg.learner.max_tokens_per_microbatch, self._packed)
        n_micro = self._all_reduce_int(len(groups), dist.ReduceOp.MAX)
        temperature = self.cfg.rollout.temperature
        reads_prox = self.loss_settings.needs_proximal

        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64)
        per_micro: list[dict[str, float]] = []
        tokens = 0
        for i in range(n_micro):
            if i >= len(groups):
                self._zero_loss_backward()  # keeps FSDP collectives in step with ranks that have more rows
                continue
            mb = self._collate(local.select(groups[i]))
            tokens += mb.num_tokens
            ref_lp = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref_lp = self._logprobs(self.ref_model, mb, temperature)
            logprobs, entropy = dropout.loss_logprobs(
                lambda ent: self._logprobs(self.model, mb, temperature, with_entropy=ent), self.model, self._dropout)
            prox = mb.proximal_logprobs
            if prox is None and reads_prox:
                # One update per batch: the pre-update (proximal) policy IS the current parameters,
                # so its logprobs are these values without gradient -- no second forward.
                prox = logprobs.detach()
            loss, metrics = policy_loss(
                logprobs, mb.behavior_logprobs, mb.advantages, mb.response_mask, self.loss_settings,
                global_tokens, global_sequences, proximal_logprobs=prox, ref_logprobs=ref_lp,
                token_lags=mb.token_lags, max_lag=self.cfg.async_.max_lag, batch_tokens=batch_tokens,
            )  # fmt: skip
            if i == 0 and inject_nan:
                loss = loss * float("nan")  # test hook, see INJECT_NAN_ENV
            loss.backward()
            loss_sum += loss.detach().double().cpu()
            metrics["loss/entropy"] = entropy.sum() / mb.response_mask.sum().clamp(min=1)
            per_micro.append({k: float(v) for k, v in metrics.items()})

        grad_norm = torch.nn.utils.clip_grad_norm_(self._trained(), self.cfg.learner.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        mine = {"micro": per_micro, "loss": float(loss_sum), "tokens": tokens}
        if not self._counts_rows:  # the sp group's ranks hold the same rows and loss: count them once
            mine = {"micro": [], "loss": 0.0, "tokens": 0}
        gathered = self._gather_objects({**mine, "peak_mem_gb": self.peak_mem_gb()})
        total_loss = sum(g["loss"] for g in gathered)
        skipped = not (math.isfinite(total_loss) and math.isfinite(grad_norm))
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._check_weights_finite(total_loss, grad_norm)
        out = finalize_mismatch(merge_rank_metrics([m for g in gathered for m in g["micro"]]))
        out.update({
            "loss/total": total_loss,
            "train/grad_norm": grad_norm,
            "train/micro_batches": float(n_micro),
            "_peak_mem_gb": max(g["peak_mem_gb"] for g in gathered),
            "_skipped": skipped,
            "_forward_tokens": sum(g["tokens"] for g in gathered),
        })  # fmt: skip
        return out

    def _check_weights_finite(self, loss: float, grad_norm: float) -> None:
        """WeightsDivergedError when this optimizer step made any weight NaN/inf although its loss and
        gradient were finite (settings the schema admits but the maths does not: an enormous weight
        decay, lr x weight_decay > 1, a bf16 overflow). Raised before anything is saved or broadcast,
        so the last checkpoint and the engines keep the last finite weights."""
        # Only what the optimizer updates can have changed (LoRA: a frozen base read every step for nothing).
        local = all(bool(torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()) for p in self._trained())
        if self._all_reduce_int(int(local), dist.ReduceOp.MIN):
            return
        lc = self.cfg.learner
        raise WeightsDivergedError(
            f"learner step {self.step + 1} made the weights non-finite (NaN/inf) in the optimizer step, with a finite "
            f"loss ({loss:.4g}) and gradient norm ({grad_norm:.4g}): the optimizer settings are the likely cause "
            f"(learner.lr={lc.lr:g}, learner.weight_decay={lc.weight_decay:g}, learner.betas={tuple(lc.betas)}); "
            "stopped before saving or broadcasting them, the last checkpoint is intact. Lower learner.lr or "
            "learner.weight_decay, then resume with run.resume=auto")

    def _trained(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (LoRA: the adapters; a frozen parameter has no gradient)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _count_bad_step(self, last: dict[str, float]) -> None:
        """A rollout batch none of whose optimizer steps could be taken: one more consecutive bad step
        (counted per rollout batch, whatever learner.mini_batches is); past the limit the run stops."""
        self.bad_steps += 1
        if self.bad_steps >= self.cfg.learner.max_bad_steps:
            raise RuntimeError(
                f"{self.bad_steps} consecutive learner steps had a non-finite loss ({last['loss/total']}) or gradient "
                f"norm ({last['train/grad_norm']}) and were skipped; stopping (learner.max_bad_steps="
                f"{self.cfg.learner.max_bad_steps}, counted per rollout batch). Check advantages/rewards "
                "for NaN, lower learner.lr, or raise learner.max_bad_steps"
            )

    def _with_proximal(self, local: "TrainBatch") -> "TrainBatch":
        """`local` with the current (pre-update) policy's logprob of every response token: no-grad
        forwards over the same micro-batches as training. Collective: every rank runs as many."""
        lengths = np.array([len(x) for x in local.input_ids], np.int64)
        groups = pack_micro_batches(lengths, self.cfg.learner.max_tokens_per_microbatch, self._packed)
        n_micro = self._all_reduce_int(len(groups), dist.ReduceOp.MAX)
        prox: list[np.ndarray | None] = [None] * len(local)
        with torch.no_grad(), dropout.deterministic(self.model):  # the sampled policy: no dropout
            for i in range(n_micro):
                if i >= len(groups):
                    self.model(input_ids=torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device), use_cache=False)
                    continue
                sub = local.select(groups[i])
                lp = self._logprobs(self.model, self._collate(sub), self.cfg.rollout.temperature).float().cpu().numpy()
                for j, row in enumerate(groups[i]):
                    prox[row] = lp[j, : len(sub.behavior_logprobs[j])]
        return dataclasses.replace(local, proximal_logprobs=prox)

    def _logprobs(self, model, mb, temperature: float, with_entropy: bool = False):
        if self.sp is not None:
            return seqpar.sp_response_logprobs(model, mb, temperature, self.sp, with_entropy)
        return response_logprobs(model, mb, temperature, with_entropy)

    @property
    def _packed(self) -> bool:
        """Packed micro-batches (learner.packing), except under sequence parallelism, which slices
        each right-padded row's positions across the sp ranks."""
        return self.cfg.learner.packing and self.sp is None

    def _collate(self, sub: "TrainBatch"):
        return collate(sub.input_ids, sub.prompt_lens, sub.behavior_logprobs, sub.advantages, self.device, self.pad_id,
                       proximal_logprobs=sub.proximal_logprobs, loss_masks=sub.loss_masks,
                       versions=sub.versions, policy_version=sub.policy_version, packed=self._packed)

    def _zero_loss_backward(self) -> None:
        dummy = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
        with torch.no_grad():
            if self.ref_model is not None:
                self.ref_model(input_ids=dummy, use_cache=False)
            if self._dropout:  # as many forwards as a real micro-batch (dropout.loss_logprobs): collectives in step
                self.model(input_ids=dummy, use_cache=False)
        logits = self.model(input_ids=dummy, use_cache=False).logits
        (logits.float().sum() * 0.0).backward()

    def _all_reduce_int(self, value: int, op: dist.ReduceOp) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=op)
        return int(t.item())

    def _gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def peak_mem_gb(self) -> float:
        """Peak memory of this rank: CUDA max allocated on GPU, process max RSS on CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux

    # ------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer and this rank's scheduler, RNG, step, version (safetensors + JSON). Collective."""
        extra = {"step": self.step, "version": self.version, "bad_steps": self.bad_steps}
        keys = None
        if self.lora is not None:  # adapters + their optimizer state; the base is model.path, named by its hash
            keys, extra[lora.BASE_HASH_KEY] = lora.trainable_keys(self.model), lora.base_model_hash(self.model_path)
        ckpt.save(path, self.model, self.optimizer, self.scheduler, self.rank, self.world_size, extra, model_keys=keys)

    def load_checkpoint(self, path: str) -> dict[str, int]:
        keys = None
        if self.lora is not None:
            lora.check_base(lora.json_meta(path).get(lora.BASE_HASH_KEY), self.model_path, f"learner checkpoint {path}")
            keys = lora.trainable_keys(self.model)
        extra = ckpt.load(path, self.model, self.optimizer, self.scheduler, self.rank, model_keys=keys)
        self.step, self.version, self.bad_steps = int(extra["step"]), int(extra["version"]), int(extra["bad_steps"])
        return {"step": self.step, "version": self.version}

    def export_hf(self, path: str) -> str | None:
        """Rank 0 writes a Hugging Face model directory (weights in model.dtype + tokenizer). Collective."""
        sd = self.full_state_dict()
        if self.rank != 0:
            return None
        if self.lora is not None:
            sd = lora.merged_state(sd, self.lora.scale)
        return str(write_hf_dir(sd, self.hf_config, self.model_path, path, self.cfg.model.dtype))

    # ----------------------------------------------------------------- misc

    def pin_cpus(self, cores: tuple[int, ...]) -> None:
        """Pin this rank's process to `cores` (run.pin_cpus)."""
        from async_april.hosts.cpu_pinning import pin_process

        pin_process(cores)

    def get_version(self) -> int:
        return self.version

    def set_version(self, version: int) -> None:
        self.version = int(version)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

