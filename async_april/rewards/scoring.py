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

`reward.timeout_s` (needs num_workers > 0: only a process can be stopped): each
function call in a worker runs under a SIGALRM timer that raises `RewardTimeout`
inside it, so a reward that sleeps or loops in Python is an ordinary error for
`reward.on_error` and its worker goes on. One stuck where the timer cannot
reach it (inside C code) is given up on by the caller at twice `timeout_s` per
function plus HARD_GRACE_S: the pool's processes are killed and the pool
rebuilt, and the calls it held count as reward errors. Either way its group is not held up
beyond the timeout, and the actor's event loop never waits on a reward.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import signal
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from async_april.config import RewardConfig
from async_april.errors import UserError
from async_april.rewards import get_reward_fn

log = logging.getLogger(__name__)

Outcome = tuple[str, float | None, str | None]
"""(reward name, value or None, error text or None) for one function on one response."""


HARD_GRACE_S = 1.0
"""Past twice timeout_s per function plus this, a call its worker's own timer could not stop is abandoned."""


class RewardError(UserError, RuntimeError):
    """A reward function failed and `reward.on_error` is `stop`."""


class RewardTimeout(Exception):
    """Raised inside a reward call (worker process) that ran past `reward.timeout_s`."""


def _alarm(signum, frame):
    raise RewardTimeout()


def _run_functions(functions: dict[str, Any], prompt: str, response: str, answer: str, extra: dict[str, Any] | None,
                   timeout_s: float | None = None) -> list[Outcome]:
    out: list[Outcome] = []
    for name, fn in functions.items():
        try:
            if timeout_s is not None:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                value = float(fn(prompt=prompt, response=response, answer=answer, **(extra or {})))
            finally:
                if timeout_s is not None:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            if not math.isfinite(value):
                raise ValueError(f"reward {name!r} returned {value}")
            out.append((name, value, None))
        except RewardTimeout:
            out.append((name, None, f"RewardTimeout: reward {name!r} took longer than reward.timeout_s={timeout_s}s"))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - reported to the caller, which applies reward.on_error;
            # SystemExit too: a reward calling sys.exit() would otherwise end the actor's thread (or pool worker).
            what = f"reward {name!r} called sys.exit({e.code!r})" if isinstance(e, SystemExit) else repr(e)
            out.append((name, None, f"{what}\n{traceback.format_exc()}"))
    return out


# ----------------------------------------------------------------- pool worker side

_WORKER_FUNCTIONS: dict[str, Any] = {}


_WORKER_TIMEOUT: list[float | None] = [None]


def _init_worker(names: list[str], timeout_s: float | None = None) -> None:
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _WORKER_FUNCTIONS.update({name: get_reward_fn(name) for name in names})
    _WORKER_TIMEOUT[0] = timeout_s
    if timeout_s is not None:
        signal.signal(signal.SIGALRM, _alarm)  # tasks run in the worker's main thread, where signals arrive


def _score_in_worker(prompt: str, response: str, answer: str, extra: dict[str, Any] | None) -> list[Outcome]:
    return _run_functions(_WORKER_FUNCTIONS, prompt, response, answer, extra, _WORKER_TIMEOUT[0])


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
            fut = self._get_pool().submit(_score_in_worker, prompt, response, answer, extra)
            outcomes = fut.result(timeout=self._hard_deadline_s)
        except BrokenProcessPool as e:
            outcomes = self._pool_broken(e)
        except TimeoutError:
            outcomes = self._abandon_stuck()
        return self._combine(outcomes)

    async def score_async(self, prompt: str, response: str, answer: str, extra: dict[str, Any] | None = None) -> tuple[float, dict[str, float]]:
        """Like `score`, awaitable: with `reward.num_workers > 0` the functions run in the
        process pool and the event loop stays free meanwhile; with 0 they run inline."""
        if self.cfg.num_workers == 0:
            return self.score(prompt, response, answer, extra)
        loop = asyncio.get_running_loop()
        try:
            call = loop.run_in_executor(self._get_pool(), _score_in_worker, prompt, response, answer, extra)
            outcomes = await asyncio.wait_for(call, self._hard_deadline_s)
        except BrokenProcessPool as e:
            outcomes = self._pool_broken(e)
        except asyncio.TimeoutError:
            outcomes = self._abandon_stuck()
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
    @property
    def _hard_deadline_s(self) -> float | None:
        t = self.cfg.timeout_s
        return None if t is None else 2 * t * len(self.cfg.functions) + HARD_GRACE_S

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.cfg.num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(list(self.cfg.functions), self.cfg.timeout_s),
            )
        return self._pool

    def _abandon_stuck(self) -> list[Outcome]:
        """A call its worker's timer could not stop (stuck in C code): kill the pool's processes
        (the only way to stop it) and start a new pool for the next calls."""
        log.error("a reward call did not return within reward.timeout_s=%ss even after its timer fired; "
                  "killing the reward worker processes", self.cfg.timeout_s)
        if self._pool is not None:
            for proc in list(getattr(self._pool, "_processes", {}).values()):
                proc.kill()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        return [(name, None, f"RewardTimeout: reward call did not return within reward.timeout_s={self.cfg.timeout_s}s "
                 "(its worker process was killed)") for name in self.cfg.functions]

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
