"""Built-in engine: continuous batching over a transformers causal LM with a KV cache.

One worker loop and the rows it owns; its tensor operations (prefill, sampling, cache merges,
weight staging) are pure functions in torch_batch.py.

Thread model: one worker thread owns the model and runs the loop below; the
asyncio side only enqueues work and awaits futures, so the actor stays
responsive to `abort_all` / `update_weights` while a forward pass runs.

    generate() --submit--> inbox --+--> worker: [commands] -> admit -> prefill -> decode step -> finish rows
    abort_all() / update_weights() +        (commands run between steps; results go back with
                                             loop.call_soon_threadsafe)

A weight update runs between two decode steps. `update_weights` rebuilds the
cache of rows still running with the new weights (a re-prefill, counted);
`update_weights_in_flight` keeps it, so those rows continue at once and only
tokens fed after the load go through the new weights.

The running batch is one left-padded `DynamicCache` plus a [B, T] attention mask
(torch_batch.py): new requests are prefilled as their own batch and merged in,
finished rows dropped. Position ids count each row's real tokens, so padding
never changes a row's numbers: logprobs match a teacher-forced forward to ~1e-6
in fp32 (tests/test_torch_engine.py). Each request samples from its own
`torch.Generator` seeded from `SamplingParams.seed`, and each token is tagged
with the weight version of the step that produced it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch

from actors.engine import ADMISSION_BLOCK_DIVISOR, EngineStats, GenerateRequest, GenerateResult, WeightBucket, settle_future
from actors.engines.torch_batch import merge_kv, prefill, sample_next, select_kv, stage_weight_update

ADMIT_EVERY_STEPS = 4
"""While rows are running, waiting requests wait at most this many decode steps to be prefilled,
or less once a block of them (ADMISSION_BLOCK_DIVISOR) fits."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Row:
    req: GenerateRequest
    fut: asyncio.Future
    loop: asyncio.AbstractEventLoop
    seq: int
    gen: torch.Generator
    stop: frozenset[int]
    length: int = 0
    """Real (unpadded) tokens in the cache for this row, i.e. the next position id."""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cancelled: bool = False


class TorchEngine:
    """Continuous-batching engine on a Hugging Face causal LM (CPU or CUDA)."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        model: torch.nn.Module | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        max_running: int = 64,
        max_batch_tokens: int = 8192,
        eos_token_ids: Iterable[int] | None = None,
        num_threads: int | None = 1,
        version: int = 0,
        parity: bool = False,
    ) -> None:
        if model_path is None and model is None:
            raise ValueError("TorchEngine needs model_path (a Hugging Face model directory) or model")
        if max_running < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_running ({max_running}) and max_batch_tokens ({max_batch_tokens}) must be >= 1")
        self.model_path, self.device = model_path, torch.device(device)
        self.dtype, self.attn_implementation = _DTYPES[dtype], attn_implementation
        self.max_running, self.max_batch_tokens = max_running, max_batch_tokens
        self.num_threads = num_threads
        self.model = model
        self._eos = None if eos_token_ids is None else tuple(int(t) for t in eos_token_ids)
        self._version = version
        self.parity = parity
        """model.parity: the batch-invariant kernels of async_april/parity/, the learner's numbers bit for bit."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._seq = itertools.count()
        self._stats = EngineStats()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._seed_rng = np.random.default_rng()
        self._lora_base: dict[str, torch.Tensor] = {}
        """LoRA: the base weights an adapter update merges into, kept (on the host) at the first one."""

    # ---------------------------------------------------------------- asyncio side
    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        if self._thread is not None:
            return
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        if self.model is None:
            self.model = await asyncio.to_thread(self._load)
        if self.parity:  # before the cast below, which would round the rotary frequencies (async_april/parity/model.py)
            from async_april.parity.model import install

            install(self.model, self.dtype)
        self.model.to(device=self.device, dtype=self.dtype).eval()
        if self._eos is None:
            eos = getattr(self.model.generation_config, "eos_token_id", None) or self.model.config.eos_token_id
            self._eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.x
        self._thread = threading.Thread(target=self._worker, name="torch-engine", daemon=True)
        self._thread.start()

    def _load(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=self.dtype, attn_implementation=self.attn_implementation
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos or ()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._thread is None:
            raise RuntimeError("TorchEngine.start() must be awaited before generate()")
        sp = request.sampling
        if sp.max_new_tokens < 1:
            raise ValueError(f"{request.request_id}: max_new_tokens must be >= 1, got {sp.max_new_tokens}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        seed = sp.seed if sp.seed is not None else int(self._seed_rng.integers(2**62))
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        stop = frozenset(sp.stop_token_ids or self.eos_token_ids)
        row = _Row(request, fut, loop, next(self._seq), gen, stop)
        self._submit(("gen", row))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            row.cancelled = True
            self._wake.set()
            raise

    async def abort_all(self) -> None:
        upto = next(self._seq)
        await self._command("abort", lambda r: r.seq <= upto)

    async def abort_requests(self, prefix: str) -> None:
        """Abort live requests whose id starts with `prefix` (SGLang's /abort_request rid semantics)."""
        await self._command("abort", lambda r: r.req.request_id.startswith(prefix))

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load between decode steps; rows still running get their cache rebuilt with the new weights."""
        await self._command("update", (buckets, version, False))

    async def update_weights_in_flight(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load between decode steps; rows still running keep their KV cache (rollout.on_weight_update=continue)."""
        await self._command("update", (buckets, version, True))

    async def pause(self) -> None:
        """Stop decoding between steps (running requests keep their cache) until `resume()`."""
        await self._command("pause", True)

    async def resume(self) -> None:
        await self._command("pause", False)

    def stats(self) -> EngineStats:
        s = self._stats
        return dataclasses.replace(s, extra=dict(s.extra))

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        await self.abort_all()
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)
        self._thread = None

    async def _command(self, kind: str, arg: Any) -> Any:
        if self._thread is None:
            raise RuntimeError(f"TorchEngine.start() must be awaited before {kind}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit((kind, (arg, fut, loop)))
        return await fut

    def _submit(self, item: tuple) -> None:
        self._inbox.put(item)
        self._wake.set()

    # ---------------------------------------------------------------- worker thread
    def _worker(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        self._waiting: list[_Row] = []
        self._running: list[_Row] = []
        self._cache = None
        self._mask: torch.Tensor | None = None
        self._paused = False
        self._steps_since_admit = 0
        last = time.perf_counter()
        with torch.inference_mode():
            while not self._stop:
                self._drain_inbox()
                self._drop_cancelled()
                if not self._paused:
                    self._admit()
                if self._running and not self._paused:
                    self._decode_step()
                    now = time.perf_counter()
                    self._stats.busy_s += now - last
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
                    now = time.perf_counter()
                    self._stats.idle_s += now - last
                last = now

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "gen":
                self._waiting.append(arg)
                continue
            val, fut, loop = arg
            try:
                out = None
                if kind == "abort":
                    self._abort(val)
                elif kind == "update":
                    self._update(*val)
                elif kind == "pause":
                    self._paused = val
                loop.call_soon_threadsafe(settle_future, fut, out, None)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                loop.call_soon_threadsafe(settle_future, fut, None, e)

    def _abort(self, hit) -> None:
        for r in self._running + self._waiting:
            if hit(r):
                self._finish(r, "abort")
        self._select_rows([i for i, r in enumerate(self._running) if not hit(r)])
        self._waiting = [r for r in self._waiting if not hit(r)]

    def _drop_cancelled(self) -> None:
        self._waiting = [r for r in self._waiting if not r.cancelled]
        if any(r.cancelled for r in self._running):
            self._select_rows([i for i, r in enumerate(self._running) if not r.cancelled])

    def _load_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """All or nothing: every bucket is received and checked (names, shapes, dtypes, coverage)
        before any weight is copied, so a failed update leaves the model and its version as they
        were. Costs one staged copy of the weights in host memory during the update."""
        staged = stage_weight_update(self.model, buckets, version, self._lora_base)
        for p, tensor in staged:
            p.data.copy_(tensor.to(device=p.device, dtype=p.dtype), non_blocking=True)
        self._version = version

    def _update(self, buckets: Iterable[WeightBucket], version: int, keep_cache: bool) -> None:
        """Runs between two decode steps. With keep_cache the running rows go on with the KV of
        their earlier tokens as the old weights computed it (PipelineRL's in-flight update); the
        next decode step feeds each row's last sampled token through the new weights."""
        self._load_weights(buckets, version)
        if self._running and not keep_cache:
            self._reprefill()

    def _reprefill(self) -> None:
        """Recompute the running rows' KV cache with the new weights, so every later token is exactly
        the new policy's (SGLang flushes its cache for the same reason). The last sampled token is
        not fed yet: the next decode step feeds it."""
        seqs = [np.concatenate([np.asarray(r.req.input_ids, np.int64), np.asarray(r.ids[:-1], np.int64)])
                for r in self._running]
        _, self._cache, self._mask = prefill(self.model, seqs, self.device, self._cache_kw)
        for r, x in zip(self._running, seqs):
            r.length = len(x)
        self._stats.prefill_tokens += sum(len(x) for x in seqs)
        self._stats.reprefill_tokens += sum(len(x) for x in seqs)

    def _admit(self) -> None:
        if not self._waiting:
            return
        self._steps_since_admit += 1
        free = self.max_running - len(self._running)
        # A prefill costs a whole forward pass and a cache merge however few rows it carries, so
        # while the batch is busy new rows are taken in blocks: every ADMIT_EVERY_STEPS decode
        # steps, or at once when a block of free slots and waiting rows is ready.
        block = max(1, self.max_running // ADMISSION_BLOCK_DIVISOR)
        if self._running and self._steps_since_admit < ADMIT_EVERY_STEPS and min(free, len(self._waiting)) < block:
            return
        self._steps_since_admit = 0
        held = sum(r.length for r in self._running)
        batch: list[_Row] = []
        while self._waiting and len(self._running) + len(batch) < self.max_running:
            n = len(self._waiting[0].req.input_ids)
            if (self._running or batch) and held + n > self.max_batch_tokens:
                break
            batch.append(self._waiting.pop(0))
            held += n
        if batch:
            self._prefill(batch)

    def _prefill(self, rows: list[_Row]) -> None:
        seqs = [np.asarray(r.req.input_ids, np.int64) for r in rows]
        out, cache, mask = prefill(self.model, seqs, self.device, self._cache_kw)
        for r, x in zip(rows, seqs):
            r.length = len(x)
        self._stats.prefill_tokens += sum(len(x) for x in seqs)
        self._merge(rows, cache, mask)
        self._sample_and_finish(out.logits[:, -1, :], len(self._running) - len(rows))

    def _merge(self, rows: list[_Row], cache, mask: torch.Tensor) -> None:
        if not self._running:
            self._running, self._cache, self._mask = list(rows), cache, mask
            return
        self._mask = merge_kv(self._cache, self._mask, cache, mask)
        self._running.extend(rows)

    def _decode_step(self) -> None:
        rows = self._running
        last = torch.tensor([[r.ids[-1]] for r in rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([[r.length] for r in rows], dtype=torch.long, device=self.device)
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(rows), 1)], 1)
        out = self.model(input_ids=last, attention_mask=self._mask, position_ids=pos, use_cache=True,
                         **{self._cache_kw: self._cache})
        held = 0
        for r in rows:
            r.length += 1
            held += r.length
        # Counted on the host from the rows' lengths (reading the mask would sync a GPU every step).
        slots = len(rows) * self._mask.shape[1]
        self._stats.kv_slots += slots
        self._stats.kv_pad_slots += slots - held
        self._stats.batch_rows += len(rows)
        self._stats.batch_capacity += self.max_running
        self._sample_and_finish(out.logits[:, -1, :], 0)

    def _sample_and_finish(self, logits: torch.Tensor, first: int) -> None:
        """Sample one token for rows[first:] from `logits` (one row each), then drop finished rows."""
        rows = self._running[first:]
        tokens, picked = sample_next(logits, [r.req.sampling for r in rows], [r.gen for r in rows], self.parity)
        self._stats.generated_tokens += len(rows)
        keep = list(range(first))
        for i, (r, tok, lp) in enumerate(zip(rows, tokens, picked)):
            r.ids.append(tok)
            r.logprobs.append(lp)
            r.versions.append(self._version)
            if tok in r.stop:
                self._finish(r, "stop")
            elif len(r.ids) >= r.req.sampling.max_new_tokens:
                self._finish(r, "length")
            else:
                keep.append(first + i)
        if len(keep) < len(self._running):
            self._select_rows(keep)

    def _select_rows(self, keep: list[int]) -> None:
        if len(keep) == len(self._running):
            return
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        self._mask = select_kv(self._cache, self._mask, keep)

    def _finish(self, r: _Row, reason: str) -> None:
        res = GenerateResult(
            request_id=r.req.request_id,
            output_ids=np.asarray(r.ids, np.int64),
            logprobs=np.asarray(r.logprobs, np.float32),
            versions=np.asarray(r.versions, np.int64),
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=len(r.req.input_ids),
        )
        r.loop.call_soon_threadsafe(settle_future, r.fut, res, None)
