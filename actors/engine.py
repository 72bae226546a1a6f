"""The contract every generation backend implements.

An engine turns token ids into sampled continuations and, for partial
rollouts, must be able to (1) abort everything in flight and hand back what it
produced so far, (2) continue a response from prompt + partial response, and
(3) take new weights in place, bumping its policy version. Logprobs are those
of the distribution actually sampled from, log_softmax(logits / temperature),
as SGLang reports them (before top-k / top-p).

Backends: `engines/torch_engine.py` (built-in, continuous batching, CPU/CUDA),
`engines/sglang_engine.py` (HTTP to an SGLang server), `engines/simulated.py`
(latency model, no weights). `make_engine` picks one from the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Literal, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import asyncio

    import torch


FinishReason = Literal["stop", "length", "abort"]
WeightBucket = dict[str, "torch.Tensor"]
"""A bounded group of named full (unsharded) tensors, all of one dtype."""


ADMISSION_BLOCK_DIVISOR = 8
"""Work joins a busy engine in blocks of max_running / ADMISSION_BLOCK_DIVISOR requests: the torch
engine prefills that many together and the generation actor leases that many at once, because a
prefill (a forward pass) and a store call cost about as much for one request as for a block."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Per-request sampling seed: the same request and weights give the same tokens whatever else is batched."""


@dataclass
class GenerateRequest:
    request_id: str
    """Unique, and never a prefix of another live id (SGLang aborts by prefix)."""
    input_ids: np.ndarray
    sampling: SamplingParams
    prompt_len: int | None = None
    """On a resume (input_ids = prompt + partial response): the original prompt's length. None: all of input_ids is prompt.
    Only the simulated engine reads it (to continue toward the same drawn total length)."""
    response_seed: int | None = None
    """Stable identity of the response across resumes (the sampling seed changes per resume).
    Only the simulated engine reads it: a response's drawn total length must not change when it is resumed."""


@dataclass
class GenerateResult:
    request_id: str
    output_ids: np.ndarray
    logprobs: np.ndarray
    """log_softmax(logits / temperature)[token] for each output token."""
    versions: np.ndarray
    """Policy version of the weights that produced each output token."""
    finish_reason: FinishReason
    prompt_tokens: int = 0

    def __post_init__(self) -> None:
        if not (len(self.output_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"{self.request_id}: output_ids ({len(self.output_ids)}), logprobs ({len(self.logprobs)}) "
                f"and versions ({len(self.versions)}) must have one entry per token"
            )


@dataclass
class EngineStats:
    busy_s: float = 0.0
    """Wall time spent with at least one request running."""
    idle_s: float = 0.0
    """Wall time the engine was up with nothing to run."""
    generated_tokens: int = 0
    prefill_tokens: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    batch_rows: int = 0
    """Running requests summed over decode steps: over `batch_capacity`, how full the batch was while busy
    (a batch below `max_running` makes each step cost about the same for fewer tokens)."""
    batch_capacity: int = 0
    """`max_running` summed over decode steps."""
    kv_slots: int = 0
    """KV-cache positions the decode steps attended, padding included, summed over steps and rows (torch
    engine: its batch shares one left-padded cache, so a row attends to the longest row's width)."""
    kv_pad_slots: int = 0
    """Of `kv_slots`, the padding: attention and cache copies spent on no token."""
    reprefill_tokens: int = 0
    """Prefill tokens the engine itself recomputed for requests it was already running (a cache
    rebuilt after a weight update). Resumes the caller asks for are counted by the caller
    (`GenerationActor`), so every engine reports `rollout/reprefill_tokens` the same way."""


@runtime_checkable
class Engine(Protocol):
    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded."""
        ...

    async def start(self) -> None:
        """Load the model / connect to the server. Called once before the first request."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Sample a continuation of `request.input_ids`."""
        ...

    async def abort_all(self) -> None:
        """Every pending `generate` returns promptly with its tokens so far and reason `abort`."""
        ...

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load new full weights bucket by bucket, then report `version`. Callers abort or drain first;
        requests still running get their cache recomputed with the new weights (counted in
        `EngineStats.reprefill_tokens`)."""
        ...

    def stats(self) -> EngineStats:
        ...

    # Optional capability (rollout.on_weight_update=continue; torch, simulated and SGLang engines):
    #   async def update_weights_in_flight(self, buckets, version) -> None
    # loads the weights between two decode steps while requests keep running on their KV cache;
    # every token sampled afterwards carries `version` and the logprob computed with the new
    # weights over that (mixed) cache. See docs/async.md for the approximation.

    async def shutdown(self) -> None:
        ...


def settle_future(fut: "asyncio.Future", value: Any, exc: BaseException | None) -> None:
    """Resolve `fut` with `value` or `exc` unless it is already done (cancelled by a timeout or an abort).
    Call it on the future's own loop (`loop.call_soon_threadsafe`) from the thread that did the work."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
