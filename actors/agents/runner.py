"""The multi-turn loop: model turn, environment step, model turn, ... for one sample.

    lease ──> [reset] ──> model turn (engine.generate) ──turn ends──> env step (thread, timeout)
                  ^                                                        │
                  └──────────── observation appended (loss mask 0) <───────┘
    until the environment says done, or max_turns, or rollout.max_new_tokens is spent

Each model turn is its own engine request whose input is the prompt plus every
token so far (model and environment, as token ids); the engine never sees
text. Environment steps run in a thread each, so a slow tool holds neither the
event loop nor the other rollouts: `step_concurrency` bounds how many run at
once and `step_timeout_s` how long one may take (a timed-out thread is left to
finish, its slot freed).

Partial rollouts: an abort (early stop, interrupt) either cuts a model turn
(the engine returns the tokens so far, reason `abort`; the resume continues
that turn, with the same per-turn length target on the simulated engine) or
lands while a step runs (the sample leaves with `env_pending`; the resume runs
that step again from the state it kept, so the continuation is the one the
uninterrupted rollout would have had). Every model token keeps the logprob and
version the engine recorded; environment tokens are masked out of training.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import Counter
from functools import partial
from typing import Any, Callable

import numpy as np

from actors.agents.env import make_env
from actors.agents.threads import in_thread
from async_april.environment import EnvRow, Step, on_failure
from async_april.config import Config
from async_april.rollout.trajectory import Sample


class StepAborted(Exception):
    """An abort arrived while an environment step was waiting or running."""


class StepProgress:
    """Handed to an environment step that takes `progress=` (an agent loop does): the step calls it,
    from its thread, with the state a resume must restart the step from once a side effect is done
    (a finished tool call recorded). An abort keeps the latest such state; reports that arrive after
    the runner gave up on the step are ignored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict | None = None
        self._closed = False

    def __call__(self, state: dict) -> None:
        with self._lock:
            if not self._closed:
                self._state = state

    def close(self) -> dict | None:
        """The latest state reported (None: none); later reports are ignored."""
        with self._lock:
            self._closed = True
            return self._state


class AgentRunner:
    """Runs samples through `env` on `engine`; one per generation actor.

    `make_request(sample, max_new_tokens, prompt_len, turn)` builds the engine request for the
    next (or resumed) model turn; `aborting` is the actor's set of uids an abort covers."""

    def __init__(self, cfg: Config, env: Any, engine: Any, make_request: Callable[..., Any], aborting: set[str]):
        self.cfg, self.env, self.engine = cfg, env, engine
        self.agent = cfg.rollout.agent
        self.make_request = make_request
        self.aborting = aborting
        self.slots = asyncio.Semaphore(self.agent.step_concurrency)
        self.abort_events: dict[str, asyncio.Event] = {}
        self.step_takes_progress = "progress" in inspect.signature(env.step).parameters
        self.counters: Counter = Counter()
        """Cumulative: steps, step_timeouts, step_failures, step_s (`agent/*` metrics)."""

    def abort(self, uids) -> None:
        """Wake the samples among `uids` that wait on an environment step (called by the actor's abort)."""
        for uid in uids:
            if uid in self.abort_events:
                self.abort_events[uid].set()

    def metrics(self) -> dict[str, float]:
        return {f"agent/{k}": float(v) for k, v in self.counters.items()}

    async def run(self, sample: Sample, row: EnvRow) -> None:
        """Advance `sample` until it ends (reason stop/length, reward = sum of step rewards) or is
        aborted (reason abort; resumable). Mutates `sample`."""
        self.abort_events[sample.uid] = asyncio.Event()
        try:
            await self._run(sample, row)
        except StepAborted:
            sample.finish_reason = "abort"
        finally:
            self.abort_events.pop(sample.uid, None)

    async def _run(self, sample: Sample, row: EnvRow) -> None:
        r, a = self.cfg.rollout, self.agent
        if sample.env_state is None:
            reset = await self._off_loop(sample, self.env.reset, row, timeout=None)
            sample.env_state = dict(reset.state)
            if reset.prompt_ids is not None:
                sample.prompt_ids = np.asarray(reset.prompt_ids, np.int64)
        while True:
            if sample.env_pending:
                if self._apply_step(sample, await self._step(sample)):
                    return
            self._check_abort(sample)
            remaining = r.max_new_tokens - sample.num_tokens
            if remaining <= 0:
                sample.finish_reason = "length"
                return
            in_turn = sample.num_tokens - sample.turn_start  # > 0 when resuming a cut turn
            budget = remaining if a.max_turn_tokens is None else min(remaining, a.max_turn_tokens - in_turn)
            if budget <= 0:  # the turn already used its budget before it was cut: hand it over as it is
                sample.env_pending = True
                continue
            req = self.make_request(sample, budget, len(sample.prompt_ids) + sample.turn_start, sample.turns)
            res = await self.engine.generate(req)
            sample.extend(res.output_ids, res.logprobs, res.versions, res.finish_reason)
            if res.finish_reason == "abort":
                return
            if res.finish_reason == "length" and sample.num_tokens >= r.max_new_tokens:
                return  # the response's token budget is spent mid-turn: no step for a cut-off turn
            sample.finish_reason = None  # a turn ended, not the response
            sample.env_pending = True

    def _apply_step(self, sample: Sample, step: Step) -> bool:
        """Append the observation, add the reward; True when the response is over."""
        r, a = self.cfg.rollout, self.agent
        sample.env_pending = False
        sample.turns += 1
        sample.env_reward += float(step.reward)
        sample.env_state = dict(step.state)
        if step.done:
            sample.finish_reason = "stop"
            return True
        obs = np.asarray(step.observation_ids, np.int64).reshape(-1)
        room = r.max_new_tokens - sample.num_tokens
        sample.observe(obs[:room])
        sample.turn_begin = sample.num_tokens  # recorded: an empty observation leaves no token to find it by
        if sample.turns >= a.max_turns or len(obs) >= room:
            sample.finish_reason = "length"  # out of turns, or no room left for the model to answer
            return True
        return False

    async def _step(self, sample: Sample) -> Step:
        """The environment's step on the last model turn, off the loop, bounded; failures go to on_failure."""
        a = self.agent
        turn = sample.response_ids[sample.turn_start :].copy()
        state = dict(sample.env_state or {})
        t0 = time.perf_counter()
        error = None
        progress = StepProgress()
        call = partial(self.env.step, progress=progress) if self.step_takes_progress else self.env.step
        try:
            step = await self._off_loop(sample, call, state, turn, timeout=a.step_timeout_s)
            obs = np.asarray(step.observation_ids).reshape(-1)
            if len(obs) > a.max_observation_tokens:
                raise ValueError(f"observation of {len(obs)} tokens is over rollout.agent.max_observation_tokens="
                                 f"{a.max_observation_tokens}")
        except asyncio.TimeoutError:
            self.counters["step_timeouts"] += 1
            error = f"timed out after {a.step_timeout_s:g}s"
        except StepAborted:
            kept = progress.close()  # what the step had done before the abort is not done again
            if kept is not None:
                sample.env_state = kept
            raise
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a failing tool is an observation, not a crash
            # SystemExit too: an environment calling sys.exit() would otherwise end the generation actor.
            self.counters["step_failures"] += 1
            error = f"called sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else f"{type(exc).__name__}: {exc}"
        if error is not None:  # the environment chooses what the model sees; the limit still holds
            step = on_failure(self.env, state, turn, error)
            step = Step(np.asarray(step.observation_ids, np.int64).reshape(-1)[: a.max_observation_tokens],
                        step.reward, step.done, step.state)
        self.counters["steps"] += 1
        self.counters["step_s"] += time.perf_counter() - t0
        return step

    async def _off_loop(self, sample: Sample, fn, *args, timeout: float | None):
        """fn(*args) in a thread under the concurrency limit; StepAborted if an abort comes first,
        asyncio.TimeoutError past `timeout` (counted from when the step starts running)."""
        self._check_abort(sample)
        abort = asyncio.ensure_future(self.abort_events[sample.uid].wait())
        try:
            slot = asyncio.ensure_future(self.slots.acquire())
            await asyncio.wait({slot, abort}, return_when=asyncio.FIRST_COMPLETED)
            if not slot.done():
                slot.cancel()
                raise StepAborted()
            try:
                self._check_abort(sample)
                work = in_thread(fn, *args)
                done, _ = await asyncio.wait({work, abort}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if work in done:
                    return work.result()
                work.add_done_callback(_consume)  # its result (or error) arrives after nobody waits
                if abort in done:
                    raise StepAborted()
                raise asyncio.TimeoutError()
            finally:
                self.slots.release()
        finally:
            abort.cancel()

    def _check_abort(self, sample: Sample) -> None:
        if sample.uid in self.aborting:
            raise StepAborted()


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def build_agent(cfg: Config, tokenizer: Any, engine: Any, make_request: Callable[..., Any], aborting: set[str],
                stop_token_ids: tuple[int, ...]) -> tuple[AgentRunner, tuple[int, ...]]:
    """The turn loop for `rollout.env` on `engine` (the environment built with the tokenizer and
    `rollout.agent.env_args`), and the stop tokens its turns end at: `stop_token_ids` plus the
    environment's `turn_end_ids`. Shared by the generation and evaluation actors."""
    env = make_env(cfg.rollout.env, tokenizer, cfg.rollout.agent.env_args)
    stops = tuple(dict.fromkeys(stop_token_ids + tuple(int(t) for t in getattr(env, "turn_end_ids", ()))))
    return AgentRunner(cfg, env, engine, make_request, aborting), stops

