"""The loader of `rollout.env`: built-in environments, `module:Class`, and agent loops `module:function`.

The interface an environment implements (`Environment`, `Reset`, `Step`, `EnvRow`) is
async_april/environment.py; it is re-exported here, where environments were always imported from.
"""

from __future__ import annotations

import inspect
from typing import Any

from actors.agents.loop import agent_loop_env
from async_april.environment import EnvRow, Environment, Reset, Step, on_failure
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


__all__ = ["REGISTRY", "EnvRow", "EnvSpecError", "Environment", "Reset", "Step", "load_env_class", "make_env", "on_failure"]
