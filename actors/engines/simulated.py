"""Simulated engine: a latency model and a response-length distribution, no weights.

For capacity planning and scheduling benchmarks without a GPU: it speaks the
`Engine` protocol (abort, resume, weight versions), but every response length
is drawn from a distribution and every decode step costs

    step_s = a + b * running_requests + c * batch_tokens (+ p * prefill tokens admitted this step)

Prefill is costed per token, so a resumed request (prompt + partial response)
pays for its whole context again, and `update_weights` re-prefills the
requests still running (counted in `reprefill_tokens`), while
`update_weights_in_flight` lets them continue on their cache: the three
`rollout.on_weight_update` policies can be compared at paper scale.

simulated seconds, where batch_tokens is the context (prompt + generated) held
by the running batch. Real time is simulated time times `time_scale`, so
"minutes" of GPU time run in seconds (time_scale=0.01 is 100x faster).

Lengths (`lengths=`): `lognormal` (median 300, sigma 1), `april` (median 4k,
sigma 1.2, 16k limit: ~12% of responses hit it), `copris` (median 6k, sigma
0.9, 40k limit), or a path to an empirical histogram: JSON `{"length": count}`
/ `[[length, count], ...]` / `{"lengths": [...], "counts": [...]}`, or CSV
rows `length,count` (header optional).

Determinism across abort/resume: a response's total target length is drawn
from a generator seeded by (`GenerateRequest.response_seed`, or else
`SamplingParams.seed`, and the ORIGINAL prompt ids). Callers that change the
sampling seed per resume (the generation actor does) set `response_seed`.
The original prompt is `input_ids[:request.prompt_len]` when the caller sets
`GenerateRequest.prompt_len` on a resume (input_ids = prompt + partial
response); otherwise the whole `input_ids` on the first call, and on a resume
without `prompt_len` the engine falls back to what it remembered for that seed.
A resumed call generates only what is left of the target.

Multi-turn rollouts send one request per model turn (`prompt_len` = the context
before the turn, a `response_seed` per turn), so each turn draws its own length;
the tool calls between turns take simulated time drawn from `ToolLatency`
(actors/agents/simulated.py runs them).
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import hashlib
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from actors.engine import EngineStats, GenerateRequest, GenerateResult, WeightBucket

PRESETS = {
    # name: (median, sigma, hard limit)
    "lognormal": (300.0, 1.0, 4096),
    "april": (4000.0, 1.2, 16384),
    "copris": (6000.0, 0.9, 40960),
}


@dataclass(frozen=True)
class LatencyModel:
    """Simulated seconds per decode step: a + b * running + c * batch_tokens + prefill_s_per_token * prefilled.

    The defaults are roughly a 4B dense model in bf16 on one H100-class GPU: `a` reads the
    weights (~8 ms), `c` reads the KV cache (~150 KB per token of context at ~3 TB/s), so a
    full batch of 128 requests at 8k context decodes ~2,000 tokens/s and a lone 16k-token
    straggler ~110 tokens/s: the long-tail penalty partial rollouts remove. Prefill is compute-
    bound: ~8 GFLOP per token (2 x 4B parameters) plus attention over ~8k of context (~3 GFLOP)
    at ~500 TFLOP/s (half of an H100's bf16 peak) is ~2e-5 s per token, so re-prefilling 128
    requests of 8k context costs ~20 s: what `on_weight_update: interrupt` pays per update."""

    a: float = 0.008
    b: float = 5e-5
    c: float = 5e-8
    prefill_s_per_token: float = 2e-5
    """Was 2e-6 (4 PFLOP/s, ten times what one GPU does) until issue 16; figures before it used that."""
    update_s: float = 2.0
    """Simulated seconds to load new weights (the engine produces nothing meanwhile)."""

    def step_s(self, running: int, batch_tokens: int, prefill_tokens: int = 0) -> float:
        return self.a + self.b * running + self.c * batch_tokens + self.prefill_s_per_token * prefill_tokens


@dataclass(frozen=True)
class ToolLatency:
    """Simulated seconds one tool call (an environment step of a multi-turn rollout) takes: lognormal
    around `median_s` with log-std `sigma`, capped at `max_s`. Drawn per call, so a few calls form the
    long tail agents add to generation time. Used by `actors/agents/simulated.py`."""

    median_s: float = 2.0
    sigma: float = 1.0
    max_s: float = 60.0

    def __post_init__(self) -> None:
        if self.median_s < 0 or self.sigma < 0 or self.max_s < 0:
            raise ValueError(f"tool latency median_s, sigma and max_s must be >= 0, got {self}")

    def sample(self, rng: np.random.Generator) -> float:
        if self.median_s == 0:
            return 0.0
        return float(min(self.max_s, self.median_s * np.exp(self.sigma * rng.standard_normal())))


class LengthDistribution:
    """Draws a response length from a named preset or an empirical histogram."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        if spec in PRESETS:
            self.median, self.sigma, self.limit = PRESETS[spec]
            self.values = self.probs = None
        else:
            path = Path(spec).expanduser()
            if not path.is_file():
                raise ValueError(
                    f"simulated lengths {spec!r}: not one of {sorted(PRESETS)} and not a histogram file; "
                    "give a preset name or a JSON/CSV file of length,count"
                )
            lengths, counts = _read_histogram(path)
            self.values = np.asarray(lengths, np.int64)
            self.probs = np.asarray(counts, np.float64) / float(np.sum(counts))
            self.limit = int(self.values.max())

    def sample(self, rng: np.random.Generator) -> int:
        if self.values is not None:
            return int(rng.choice(self.values, p=self.probs))
        x = self.median * np.exp(self.sigma * rng.standard_normal())
        return int(min(max(1, round(x)), self.limit))


def _read_histogram(path: Path) -> tuple[list[int], list[float]]:
    if path.suffix.lower() == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "lengths" in data:
            pairs = list(zip(data["lengths"], data["counts"]))
        elif isinstance(data, dict):
            pairs = [(int(k), v) for k, v in data.items()]
        else:
            pairs = [tuple(p) for p in data]
    else:
        pairs = []
        for row in csv.reader(path.read_text().splitlines()):
            if len(row) >= 2 and row[0].strip().lstrip("-").isdigit():
                pairs.append((int(row[0]), float(row[1])))
    pairs = [(int(n), float(c)) for n, c in pairs if float(c) > 0]
    if not pairs or any(n < 1 for n, _ in pairs):
        raise ValueError(f"histogram {str(path)!r}: needs rows of length >= 1 with count > 0")
    return [n for n, _ in pairs], [c for _, c in pairs]


@dataclass
class _Req:
    req: GenerateRequest
    fut: asyncio.Future
    seq: int
    todo: int
    """Tokens this call still has to produce."""
    finish: str
    context: int
    rng: np.random.Generator
    done: int = 0
    marks: list[tuple[int, int]] = field(default_factory=list)
    """(token index, version) where a new weight version starts."""


class SimulatedEngine:
    """Latency-model engine. Stats are in simulated seconds; `extra['real_s']` is wall time."""

    def __init__(
        self,
        lengths: str = "lognormal",
        *,
        latency: LatencyModel | None = None,
        time_scale: float = 0.01,
        max_running: int = 64,
        max_batch_tokens: int = 1 << 30,
        vocab_size: int = 32000,
        version: int = 0,
    ) -> None:
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.lengths = LengthDistribution(lengths)
        self.latency = latency or LatencyModel()
        self.time_scale, self.max_running, self.max_batch_tokens = time_scale, max_running, max_batch_tokens
        self.vocab_size = vocab_size
        self._version = version
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._commands: list[tuple[str, object, asyncio.Future]] = []
        self._seq = itertools.count()
        self._prompt_len_by_seed: dict[int, int] = {}
        self._stats = EngineStats()
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self.sim_time_s = 0.0
        self._chunk: tuple[float, np.ndarray, int] | None = None
        self._unpaid_prefill = 0
        """Prefill tokens (admitted requests, caches rebuilt after an update) not yet costed."""

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._t0 = time.perf_counter()
            self._task = asyncio.create_task(self._run(), name="simulated-engine")

    def target_length(self, request: GenerateRequest) -> tuple[int, int]:
        """(total target response length, tokens already generated) for this request, deterministic per seed and prompt."""
        ids = np.asarray(request.input_ids, np.int64)
        seed = request.response_seed if request.response_seed is not None else request.sampling.seed
        plen = getattr(request, "prompt_len", None)
        if plen is None:
            plen = self._prompt_len_by_seed.get(seed, len(ids)) if seed is not None else len(ids)
        plen = min(int(plen), len(ids))
        if seed is not None:
            self._prompt_len_by_seed.setdefault(seed, plen)
        digest = hashlib.sha256(ids[:plen].tobytes()).digest()[:8]
        rng = np.random.default_rng([int(seed if seed is not None else np.random.SeedSequence().entropy % 2**63),
                                     int.from_bytes(digest, "little")])
        return self.lengths.sample(rng), len(ids) - plen

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if self._task is None:
            raise RuntimeError("SimulatedEngine.start() must be awaited before generate()")
        total, done = self.target_length(request)
        left = max(total - done, 1)
        cap = request.sampling.max_new_tokens
        todo, finish = (left, "stop") if left <= cap else (cap, "length")
        seed = request.sampling.seed if request.sampling.seed is not None else None
        r = _Req(request, asyncio.get_running_loop().create_future(), next(self._seq), todo, finish,
                 len(request.input_ids), np.random.default_rng(None if seed is None else [seed, done]))
        self._waiting.append(r)
        self._wake.set()
        return await asyncio.shield(r.fut)

    async def abort_all(self) -> None:
        await self._command("abort", next(self._seq))

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load; requests still running have their context re-prefilled (costed, counted)."""
        for _ in buckets:  # consume, as a real engine would; the tensors themselves are ignored
            pass
        await self._command("update", (version, False))

    async def update_weights_in_flight(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load between decode steps; requests still running keep their KV cache (no re-prefill)."""
        for _ in buckets:
            pass
        await self._command("update", (version, True))

    def stats(self) -> EngineStats:
        s = self._stats
        in_chunk = 0
        if self._chunk is not None:  # steps already elapsed in the chunk being slept through
            t, cum_real, B = self._chunk
            in_chunk = B * int(np.searchsorted(cum_real, time.perf_counter() - t, "right"))
        extra = dict(s.extra, real_s=time.perf_counter() - self._t0 if self._task else 0.0, sim_time_s=self.sim_time_s)
        return dataclasses.replace(s, generated_tokens=s.generated_tokens + in_chunk, extra=extra)

    async def shutdown(self) -> None:
        if self._task is not None:
            await self.abort_all()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _command(self, kind: str, arg: object) -> None:
        if self._task is None:
            raise RuntimeError(f"SimulatedEngine.start() must be awaited before {kind}")
        fut = asyncio.get_running_loop().create_future()
        self._commands.append((kind, arg, fut))
        self._wake.set()
        await fut

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        """Advance k decode steps at a time (k = steps until the next finish), waking early on any event."""
        while True:
            await self._handle_commands()
            # Prefill (admitted requests, caches rebuilt by an update) is paid with the next step.
            self._unpaid_prefill += self._admit()
            prefill = self._unpaid_prefill
            if not self._running:
                self._unpaid_prefill = 0  # whatever it was for was aborted before running a step
                t = time.perf_counter()
                self._wake.clear()
                await self._wake.wait()
                self._stats.idle_s += (time.perf_counter() - t) / self.time_scale if self.time_scale else 0.0
                continue
            B = len(self._running)
            T0 = sum(r.context for r in self._running)
            k = min(r.todo - r.done for r in self._running)
            steps = self.latency.a + self.latency.b * B + self.latency.c * (T0 + B * np.arange(k))
            steps[0] += self.latency.prefill_s_per_token * prefill
            cum = np.cumsum(steps)
            self._wake.clear()
            t = time.perf_counter()
            self._chunk = (t, cum * self.time_scale, B)
            if self.time_scale > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), cum[-1] * self.time_scale)
                except asyncio.TimeoutError:
                    pass
                j = k if not self._wake.is_set() else int(np.searchsorted(cum * self.time_scale, time.perf_counter() - t, "right"))
                if j < k:  # a step once started runs to its end, as a forward pass does: events wait for it
                    await asyncio.sleep(max(0.0, cum[j] * self.time_scale - (time.perf_counter() - t)))
                    j += 1
            else:
                j = k
                await asyncio.sleep(0)
            self._chunk = None
            if j:
                self._unpaid_prefill = 0
                self._advance(j, float(cum[j - 1]))

    def _admit(self) -> int:
        held = sum(r.context for r in self._running)
        prefill = 0
        while self._waiting and len(self._running) < self.max_running:
            r = self._waiting[0]
            if self._running and held + r.context > self.max_batch_tokens:
                break
            self._waiting.pop(0)
            r.marks.append((0, self._version))
            self._running.append(r)
            held += r.context
            prefill += r.context
        self._stats.prefill_tokens += prefill
        return prefill

    def _advance(self, j: int, sim_s: float) -> None:
        self.sim_time_s += sim_s
        self._stats.busy_s += sim_s
        self._stats.generated_tokens += j * len(self._running)
        self._stats.batch_rows += j * len(self._running)
        self._stats.batch_capacity += j * self.max_running
        keep = []
        for r in self._running:
            r.done += j
            r.context += j
            if r.done >= r.todo:
                self._finish(r, r.finish)
            else:
                keep.append(r)
        self._running = keep

    async def _handle_commands(self) -> None:
        while self._commands:
            kind, arg, fut = self._commands.pop(0)
            if kind == "abort":
                for r in [r for r in self._running + self._waiting if r.seq <= arg]:
                    self._finish(r, "abort")
                self._running = [r for r in self._running if r.seq > arg]
                self._waiting = [r for r in self._waiting if r.seq > arg]
            elif kind == "update":
                version, keep_cache = arg
                if self.time_scale > 0:
                    await asyncio.sleep(self.latency.update_s * self.time_scale)
                self.sim_time_s += self.latency.update_s
                self._version = int(version)
                for r in self._running:
                    r.marks.append((r.done, self._version))
                if not keep_cache:  # the running requests' cache is recomputed with the new weights
                    n = sum(r.context for r in self._running)
                    self._unpaid_prefill += n
                    self._stats.prefill_tokens += n
                    self._stats.reprefill_tokens += n
            if not fut.done():
                fut.set_result(None)

    def _finish(self, r: _Req, reason: str) -> None:
        n = r.done
        versions = np.full(n, self._version, np.int64)
        for (start, v), nxt in zip(r.marks, r.marks[1:] + [(n, None)]):
            versions[start : nxt[0]] = v
        res = GenerateResult(
            request_id=r.req.request_id,
            output_ids=r.rng.integers(0, self.vocab_size, size=n, dtype=np.int64),
            logprobs=np.full(n, -1.0, np.float32),
            versions=versions,
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=len(r.req.input_ids),
        )
        if not r.fut.done():
            r.fut.set_result(res)
