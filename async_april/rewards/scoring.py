"""RewardScorer: the weighted sum of the configured reward functions, with error policy.

Each function is called as `fn(prompt=..., response=..., answer=..., **extra)` and must
return a finite float. A function that raises or returns NaN/inf is counted, its
first traceback logged, and scored 0 (`reward.on_error: zero`) or the run stops
(`stop`). Per-function values are kept so the controller can log `reward/<name>`.

Where the functions run (`reward.num_workers`):

    num_workers = 0:  score() / score_async() call them inline, in the caller's thread
    num_workers > 0:  a ProcessPoolExecutor (spawn) of that many processes; score_async()
                      awaits the pool (loop.run_in_executor), so a slow reward (math-verify,
                      sympy) never blocks the generation actor's event loop; score() blocks

Pool workers build their own function table from the config and report each
function's value or traceback; the error policy and counting stay in the
calling process. A pool that breaks (a worker killed) is rebuilt and the
samples scored during the break count as reward errors.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from async_april.config import RewardConfig
from async_april.rewards import get_reward_fn

log = logging.getLogger(__name__)

Outcome = tuple[str, float | None, str | None]
"""(reward name, value or None, error text or None) for one function on one response."""


class RewardError(RuntimeError):
    """A reward function failed and `reward.on_error` is `stop`."""


def _run_functions(functions: dict[str, Any], prompt: str, response: str, answer: str, extra: dict[str, Any] | None) -> list[Outcome]:
    out: list[Outcome] = []
    for name, fn in functions.items():
        try:
            value = float(fn(prompt=prompt, response=response, answer=answer, **(extra or {})))
            if not math.isfinite(value):
                raise ValueError(f"reward {name!r} returned {value}")
            out.append((name, value, None))
        except Exception as e:  # noqa: BLE001 - reported to the caller, which applies reward.on_error
            out.append((name, None, f"{e!r}\n{traceback.format_exc()}"))
    return out


# ----------------------------------------------------------------- pool worker side

_WORKER_FUNCTIONS: dict[str, Any] = {}


def _init_worker(names: list[str]) -> None:
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _WORKER_FUNCTIONS.update({name: get_reward_fn(name) for name in names})


def _score_in_worker(prompt: str, response: str, answer: str, extra: dict[str, Any] | None) -> list[Outcome]:
    return _run_functions(_WORKER_FUNCTIONS, prompt, response, answer, extra)


# ----------------------------------------------------------------- the scorer


class RewardScorer:
    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.functions = {name: get_reward_fn(name) for name in cfg.functions}  # fails fast on a bad name
        self.errors = 0
        self._pool: ProcessPoolExecutor | None = None

    # -- public ------------------------------------------------------------------
    def score(self, prompt: str, response: str, answer: str, extra: dict[str, Any] | None = None) -> tuple[float, dict[str, float]]:
        """(weighted total, {name: value}) for one response. Blocks until scored."""
        if self.cfg.num_workers == 0:
            return self._combine(_run_functions(self.functions, prompt, response, answer, extra))
        try:
            outcomes = self._get_pool().submit(_score_in_worker, prompt, response, answer, extra).result()
        except BrokenProcessPool as e:
            outcomes = self._pool_broken(e)
        return self._combine(outcomes)

    async def score_async(self, prompt: str, response: str, answer: str, extra: dict[str, Any] | None = None) -> tuple[float, dict[str, float]]:
        """Like `score`, awaitable: with `reward.num_workers > 0` the functions run in the
        process pool and the event loop stays free meanwhile; with 0 they run inline."""
        if self.cfg.num_workers == 0:
            return self.score(prompt, response, answer, extra)
        loop = asyncio.get_running_loop()
        try:
            outcomes = await loop.run_in_executor(self._get_pool(), _score_in_worker, prompt, response, answer, extra)
        except BrokenProcessPool as e:
            outcomes = self._pool_broken(e)
        return self._combine(outcomes)

    def close(self) -> None:
        """Shut the pool down (if any). Safe to call twice."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __del__(self) -> None:  # best effort; the pool's workers also exit when this process does
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # -- internals ---------------------------------------------------------------
    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.cfg.num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(list(self.cfg.functions),),
            )
        return self._pool

    def _pool_broken(self, exc: BaseException) -> list[Outcome]:
        log.error("reward worker pool broke (%r); rebuilding it", exc)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        return [(name, None, f"reward worker pool broke: {exc!r}") for name in self.cfg.functions]

    def _combine(self, outcomes: list[Outcome]) -> tuple[float, dict[str, float]]:
        parts: dict[str, float] = {}
        for name, value, err in outcomes:
            if err is not None:
                self.errors += 1
                if self.errors == 1:
                    log.error("reward %r failed (first failure; later ones are only counted in rollout/reward_errors):\n%s", name, err)
                if self.cfg.on_error == "stop":
                    raise RewardError(f"reward {name!r} failed and reward.on_error=stop: {err.splitlines()[0]}")
                value = 0.0
            parts[name] = float(value)
        total = sum(self.cfg.functions[n] * v for n, v in parts.items())
        return total, parts
