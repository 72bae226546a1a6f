"""A user-written agent loop (`rollout.env: module:function`), run through the environment interface.

    async def solve(ctx: AgentContext, row: EnvRow) -> float:
        ctx.observe(system_ids)                       # before the first turn: extends the prompt
        while True:
            turn = await ctx.generate()               # the model's next turn, token ids
            call = parse_tool_call(ctx.decode(turn))
            if call is None:
                return score(turn, row.answer)        # the response's reward
            try:                                      # recorded: never run twice for one episode
                result = await ctx.call(run_tool, call, timeout_s=10)
            except ToolFailed as failure:             # raised or timed out: the loop chooses what
                result = {"error": str(failure)}      # the model sees
            ctx.observe(tool_message_ids(result))     # token ids, loss mask 0

The loop reads like the verl/slime custom generate functions it replaces, but
it never holds the engine: `ctx.generate()` does not call one. The runner
(actors/agents/runner.py) owns generation, limits, aborts and resumes, and
asks the loop for the next step through `AgentLoopEnv.step`, which replays
the loop from the start with the turns recorded so far:

- each `ctx.generate()` returns the next recorded turn; the first one past
  the record ends the step (the model's turn is what comes next);
- each `ctx.call(fn, ...)` returns the recorded result of that call (or
  raises its recorded failure), or runs `fn` and records its result (plain
  data) or failure when the replay reaches a call it has not made before;
- the observations and rewards produced after the newest turn are the step's.

So the episode's whole state is plain data in the sample (the row, the
turns, the call results), and an episode aborted anywhere (an early stop, a
weight update, a checkpoint, another actor) resumes exactly as an
environment's does: a call that was running when the abort came is run
again, the finished ones are not, those of the step the abort cut included
(each is reported to the runner as it finishes, through the step's
`progress`). The price: the loop must be deterministic given the row, its
turns and its call results (use `row.seed` for any randomness); a replay
that diverges from its record raises, and the step fails with a message
that says so.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
from typing import Any, Callable

import numpy as np

from actors.agents.threads import in_thread
from async_april.environment import EnvRow, Reset, Step


class _TurnNeeded(BaseException):
    """The loop asked for a model turn past the recorded ones: this step is over. A BaseException,
    so that a user's `except Exception` around `ctx.generate()` cannot swallow it."""


class ToolFailed(Exception):
    """A `ctx.call` raised or timed out (the message says which); a replay raises it again at that call."""


class LoopDiverged(RuntimeError):
    """The replay of an agent loop did not repeat its record: the loop is not deterministic."""


class AgentContext:
    """What an agent loop drives its episode with (see the module docstring)."""

    def __init__(self, row: EnvRow, turns: list[list[int]], calls: list[list], tokenizer: Any, args: dict[str, Any],
                 on_record: Callable[[list[list]], None] | None = None):
        self.row = row
        self.tokenizer = tokenizer
        self.args = args
        """`rollout.agent.env_args`, as given."""
        self._turns = turns
        self.calls = calls
        """[function name, result, error or None] of every call so far, this replay's new ones appended."""
        self._on_record = on_record
        """Told the calls so far each time a new one is recorded (see AgentLoopEnv.step's `progress`)."""
        self._next_turn = 0
        self._next_call = 0
        self.prompt_extra: list[int] = []
        self.observations: list[list[int]] = [[] for _ in turns]
        """Observation ids after each turn, in this replay."""
        self.rewards: list[float] = [0.0 for _ in turns]

    async def generate(self) -> np.ndarray:
        """The model's next turn: the token ids it sampled, its stop token included."""
        if self._next_turn == len(self._turns):
            raise _TurnNeeded()
        turn = self._turns[self._next_turn]
        self._next_turn += 1
        return np.asarray(turn, np.int64)

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` (a function or a coroutine function), run once per episode: a replay
        returns the recorded result. The result must be plain data (it is kept in the sample and
        checkpoints). A call that raises or runs past `timeout_s` raises `ToolFailed` here, and again
        at the same call in every replay (the failure is recorded too): catch it to choose what the
        model sees. The step's own timeout (`rollout.agent.step_timeout_s`) bounds all its calls."""
        name = getattr(fn, "__qualname__", repr(fn))
        i = self._next_call
        self._next_call += 1
        if i < len(self.calls):
            recorded, result, error = self.calls[i]
            if recorded != name:
                raise LoopDiverged(f"agent loop replay: call #{i} was {recorded} and is now {name}; the loop must make the "
                                   "same calls given the same row, turns and call results (seed randomness with row.seed)")
            if error is not None:
                raise ToolFailed(error)
            return result
        try:
            result = await _run_bounded(fn, args, kwargs, timeout_s)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the tool's failure is the loop's to handle (sys.exit too)
            error = (f"{name} timed out after {timeout_s:g}s" if isinstance(exc, (TimeoutError, asyncio.TimeoutError))
                     else f"{name} called sys.exit({exc.code!r})" if isinstance(exc, SystemExit)
                     else f"{name} raised {type(exc).__name__}: {exc}")
            self._record([name, None, error])
            raise ToolFailed(error) from None
        where = _not_plain(result)
        if where is not None:
            raise TypeError(f"agent loop: ctx.call({name}) returned {where}; a call's result is kept in the sample "
                            "and its checkpoints, so return plain data (None, bool, int, float, str, lists, dicts, "
                            "numpy arrays)")
        self._record([name, result, None])
        return result

    def _record(self, call: list) -> None:
        self.calls.append(call)
        if self._on_record is not None:
            self._on_record(self.calls)

    def observe(self, ids) -> None:
        """Append token ids the model will see (loss mask 0). Before the first turn they extend the prompt."""
        ids = [int(t) for t in np.asarray(ids).reshape(-1)]
        if self._next_turn == 0:
            self.prompt_extra.extend(ids)
        else:
            self.observations[self._next_turn - 1].extend(ids)

    def add_reward(self, reward: float) -> None:
        """Reward for the episode so far (the response's reward is the sum, plus what the loop returns)."""
        if self._next_turn == 0:
            raise ValueError("agent loop: add_reward before the first ctx.generate(); a reward needs a model turn")
        self.rewards[self._next_turn - 1] += float(reward)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=skip_special_tokens)


class AgentLoopEnv:
    """The environment the runner sees for an agent loop `fn(ctx, row)`; one per generation actor."""

    loop: Callable[..., Any]

    def __init__(self, tokenizer: Any = None, **env_args: Any) -> None:
        self.tokenizer = tokenizer
        self.env_args = env_args

    def reset(self, row: EnvRow) -> Reset:
        state = {"row": {"prompt": row.prompt, "prompt_ids": [int(t) for t in row.prompt_ids], "answer": row.answer,
                         "extra": dict(row.extra), "seed": int(row.seed)},
                 "turns": [], "calls": [], "observations": []}
        ctx, finished = self._replay(state)
        if finished:
            raise ValueError(f"agent loop {self.loop.__qualname__} returned before its first ctx.generate(); "
                             "an episode needs at least one model turn")
        state["prompt_extra"] = ctx.prompt_extra
        prompt = None if not ctx.prompt_extra else np.asarray(state["row"]["prompt_ids"] + ctx.prompt_extra, np.int64)
        return Reset(state=state, prompt_ids=prompt)

    def step(self, state: dict, turn_ids: np.ndarray, progress: Callable[[dict], None] | None = None) -> Step:
        """Replay the loop with this turn appended, up to its next `ctx.generate()` (or its return).
        Each call it finishes is reported to `progress` as the state this step restarts from if it
        is aborted: the same turns, that call recorded (so a resume never runs it again)."""
        before = state
        on_record = None if progress is None else (lambda calls: progress({**before, "calls": copy.deepcopy(calls)}))
        state = {**state, "turns": [*state["turns"], [int(t) for t in turn_ids]], "calls": [list(c) for c in state["calls"]]}
        ctx, finished = self._replay(state, on_record)
        new = len(state["turns"]) - 1
        if ctx.prompt_extra != state["prompt_extra"]:
            raise LoopDiverged("agent loop replay: the ids observed before the first turn differ from the ones recorded; "
                               "the loop must be deterministic given its row, turns and call results")
        for i, recorded in enumerate(state["observations"]):
            if ctx.observations[i] != recorded:
                raise LoopDiverged(f"agent loop replay: the observation after turn {i} differs from the one recorded; "
                                   "the loop must be deterministic given its row, turns and call results")
        state["observations"] = [*state["observations"], ctx.observations[new]]
        reward = ctx.rewards[new] + (float(finished[0]) if finished and finished[0] is not None else 0.0)
        return Step(np.asarray(ctx.observations[new], np.int64), reward, bool(finished), state)

    def _replay(self, state: dict, on_record: Callable[[list[list]], None] | None = None) -> tuple[AgentContext, tuple | None]:
        """Run the loop from the start over the recorded turns; (ctx, (returned value,)) if it returned,
        (ctx, None) if it asked for the next turn."""
        r = state["row"]
        row = EnvRow(prompt=r["prompt"], prompt_ids=np.asarray(r["prompt_ids"], np.int64), answer=r["answer"],
                     extra=dict(r["extra"]), seed=int(r["seed"]))
        ctx = AgentContext(row, state["turns"], state["calls"], self.tokenizer, self.env_args, on_record)

        async def go():
            try:
                return (await self.loop(ctx, row),)
            except _TurnNeeded:
                return None

        # The step runs in a thread of its own (the runner's), with no event loop: give the replay one.
        return ctx, asyncio.run(go())


async def _run_bounded(fn: Callable[..., Any], args: tuple, kwargs: dict, timeout_s: float | None) -> Any:
    """fn(*args, **kwargs), awaited if it is a coroutine; TimeoutError past `timeout_s`. A plain function
    with a timeout runs in a daemon thread of its own (`actors/agents/threads.py` `in_thread`), left to finish if it
    overruns (Python threads cannot be killed), so a hung tool holds neither this step nor the exit."""
    if timeout_s is None:
        result = fn(*args, **kwargs)
    elif inspect.iscoroutinefunction(fn):
        result = await asyncio.wait_for(fn(*args, **kwargs), timeout_s)
    else:
        result = await asyncio.wait_for(in_thread(fn, *args, **kwargs), timeout_s)
    return await result if inspect.isawaitable(result) else result


def _not_plain(value: Any) -> str | None:
    """None if `value` is plain data; else what is not, and where (e.g. "an object of type Foo at [0]['x']")."""
    if isinstance(value, np.ndarray) and value.dtype == object:
        return "a numpy array of Python objects"
    if value is None or isinstance(value, (bool, int, float, str, np.ndarray, np.generic)):
        return None
    if isinstance(value, (list, tuple)):
        items = enumerate(value)
    elif isinstance(value, dict):
        bad_key = next((k for k in value if not isinstance(k, (str, int))), None)
        if bad_key is not None:
            return f"a dict key of type {type(bad_key).__name__}"
        items = value.items()
    else:
        return f"an object of type {type(value).__name__}"
    for k, v in items:
        inner = _not_plain(v)
        if inner is not None:
            return f"{inner} at [{k!r}]" if " at " not in inner else inner.replace(" at ", f" at [{k!r}]", 1)
    return None


def agent_loop_env(fn: Callable[..., Any]) -> type:
    """The environment class for the agent loop `fn`."""
    return type(f"AgentLoop[{fn.__qualname__}]", (AgentLoopEnv,), {"loop": staticmethod(fn), "__module__": __name__})
