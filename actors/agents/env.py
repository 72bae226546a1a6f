"""The environment interface a user implements for multi-turn rollouts, and its loader.

Token in, token out: the model's turn reaches `step` as the token ids it
sampled, and the observation comes back as token ids that are appended to the
response as they are. Nothing is ever re-tokenised, so the tokens the learner
trains on are exactly the ones the engine sampled (re-tokenising a decoded
conversation can merge or split tokens at turn boundaries and silently change
them). An environment that talks to a chat model wraps its observation in the
chat template's turn markers itself; `actors/agents/chat.py` computes them.

    row ──reset──> prompt ids + state
    model turn ids ──step(state, ids)──> observation ids, reward, done, new state

State is plain data (dicts, lists, numbers, strings) kept in the `Sample`, not
in the environment object: a response interrupted between turns can resume on
another actor or after a checkpoint, and a step interrupted while it ran is
simply run again on resume. So `step` must be a function of (state, turn ids):
the same inputs give the same observation, reward and state.
One instance serves all of an actor's episodes, and its steps run in several
threads at once: keep no per-episode data on it, and guard anything shared.

Steps run in threads off the generation loop (actors/agents/runner.py), with a
timeout; a step that raises, times out or returns an observation over the
limit goes to `on_failure`, which chooses what the model sees next.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from async_april.errors import UserError
from async_april.import_path import import_object

REGISTRY: dict[str, str] = {
    "builtin:reverse_turns": "async_april.tasks.reverse_turns:ReverseTurnsEnv",
    "builtin:simulated_tool": "actors.agents.simulated:SimulatedToolEnv",
    "builtin:calculator": "actors.agents.calculator:CalculatorEnv",
}
"""Built-in environments and the class each stands for (imported lazily)."""


class EnvSpecError(UserError, ValueError):
    """`rollout.env` does not lead to a usable environment class."""


@dataclass
class EnvRow:
    """One dataset row as the environment sees it at reset."""

    prompt: str
    """The prompt text of the dataset row."""
    prompt_ids: np.ndarray
    """The prompt as the data pipeline tokenised it (chat template applied when `data.chat_template` says so)."""
    answer: str
    """The row's reference answer (`data.answer_key`)."""
    extra: dict
    """The row's other columns."""
    seed: int
    """Seed for this response (the same on every resume): use it for any randomness of the episode."""


@dataclass
class Reset:
    state: dict
    """The episode's state, plain data."""
    prompt_ids: np.ndarray | None = None
    """What the model sees first; None keeps the dataset's prompt ids."""


@dataclass
class Step:
    observation_ids: np.ndarray
    """Token ids appended after the model's turn (turn markers included); empty when done."""
    reward: float = 0.0
    """Reward for this turn; the response's reward is the sum over its turns."""
    done: bool = False
    """The episode is over: no further model turn."""
    state: dict = field(default_factory=dict)
    """The episode's state after this step."""


class Environment:
    """Base class for environments (subclassing it is optional: the runner only calls these methods).

    Constructed once per generation actor as `Class(tokenizer=tok, **rollout.agent.env_args)`.
    """

    turn_end_ids: tuple[int, ...] = ()
    """Token ids that end a model turn, besides the model's own stop tokens (e.g. a tool-call close tag)."""

    def __init__(self, tokenizer: Any = None, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{type(self).__name__} takes no env_args, got {sorted(kwargs)}")
        self.tokenizer = tokenizer

    def reset(self, row: EnvRow) -> Reset:
        raise NotImplementedError

    def step(self, state: dict, turn_ids: np.ndarray) -> Step:
        raise NotImplementedError

    def on_failure(self, state: dict, turn_ids: np.ndarray, error: str) -> Step:
        """The step raised, timed out or overflowed: by default the episode ends with no reward for the turn."""
        return Step(np.zeros(0, np.int64), 0.0, True, state)


def load_env_class(spec: str) -> type:
    """The class named by `rollout.env`: a built-in name, `module:Class`, or `module:function` (an agent
    loop, wrapped in its environment class); EnvSpecError saying what to fix."""
    path = REGISTRY.get(spec, spec)
    if spec.startswith("builtin:") and spec not in REGISTRY:
        raise EnvSpecError(f"rollout.env {spec!r} is not a built-in environment ({', '.join(sorted(REGISTRY))}); "
                           "give one of those or an import path 'module:Class' (or 'module:function' for an agent loop)")
    if ":" not in path:
        raise EnvSpecError(f"rollout.env {spec!r}: give an import path 'module:Class' ('module:function' for an agent loop) or a built-in ({', '.join(sorted(REGISTRY))})")
    obj = import_object(path, f"rollout.env {spec!r}", "Class", EnvSpecError)
    module_name, _, attr = path.partition(":")
    if inspect.isfunction(obj):
        return _agent_loop_class(spec, obj)
    if not inspect.isclass(obj):
        raise EnvSpecError(f"rollout.env {spec!r}: {module_name}:{attr} is a {type(obj).__name__}, not a class "
                           "or an agent loop function")
    missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
    if missing:
        raise EnvSpecError(f"rollout.env {spec!r}: class {attr} has no {' or '.join(missing)} method; "
                           "an environment needs reset(row) and step(state, turn_ids) (actors/agents/env.py)")
    return obj


def _agent_loop_class(spec: str, fn) -> type:
    """`module:function`: an agent loop, `async def fn(ctx, row)` (actors/agents/loop.py)."""
    from actors.agents.loop import agent_loop_env

    if not inspect.iscoroutinefunction(fn):
        raise EnvSpecError(f"rollout.env {spec!r}: {fn.__qualname__} is a plain function; an agent loop is "
                           "'async def loop(ctx, row)' that awaits ctx.generate() for each model turn (docs/agents.md)")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise EnvSpecError(f"rollout.env {spec!r}: {fn.__qualname__}{inspect.signature(fn)} cannot be called as "
                           "loop(ctx, row); an agent loop takes exactly those two arguments") from None
    return agent_loop_env(fn)


def make_env(spec: str, tokenizer: Any, env_args: dict[str, Any]) -> Any:
    """An instance of the environment `spec`, built with the tokenizer and `rollout.agent.env_args`."""
    cls = load_env_class(spec)
    try:
        env = cls(tokenizer=tokenizer, **env_args)
    except TypeError as exc:
        raise EnvSpecError(f"rollout.env {spec!r}: {cls.__name__}(tokenizer=..., **rollout.agent.env_args) failed ({exc}); "
                           "fix rollout.agent.env_args or the constructor's parameters") from None
    return env


def on_failure(env: Any, state: dict, turn_ids: np.ndarray, error: str) -> Step:
    """The environment's own `on_failure` when it has one, else the base class's (episode over)."""
    hook = getattr(env, "on_failure", None)
    if hook is None:
        return Environment.on_failure(env, state, turn_ids, error)
    return hook(state, turn_ids, error)
