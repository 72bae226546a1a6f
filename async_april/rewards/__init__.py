"""Reward functions, looked up by registered name or by import path.

Every reward has the signature `fn(prompt: str, response: str, answer: str,
**extra) -> float`, where `response` is the decoded sample text (special
tokens skipped) and `answer` the dataset's reference. `extra` carries any
other dataset columns; rewards must ignore keys they do not know.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from async_april.errors import UserError
from async_april.import_path import import_object

RewardFn = Callable[..., float]


class RewardSpecError(UserError, ValueError):
    """A name in `reward.functions` that does not lead to a usable function."""

REGISTRY: dict[str, str] = {
    "reverse_match": "async_april.rewards.reverse:reverse_match",
    "math_verify": "async_april.rewards.math:math_verify",
    "gsm8k": "async_april.rewards.math:gsm8k",
    "format": "async_april.rewards.math:boxed_format",
    "boxed_format": "async_april.rewards.math:boxed_format",
    "answer_tag_format": "async_april.rewards.math:answer_tag_format",
}
"""Registered reward names and the import path they stand for (imported lazily)."""


def _import_reward(spec: str, path: str) -> RewardFn:
    fn = import_object(path, f"reward {spec!r}", "function", RewardSpecError)
    module_name, _, attr = path.partition(":")
    if not callable(fn):
        raise RewardSpecError(f"reward {spec!r}: {module_name}:{attr} is a {type(fn).__name__}, not a function")
    return fn


def check_reward_signature(name: str, fn: RewardFn, extra: dict[str, Any]) -> None:
    """RewardSpecError unless `fn(prompt=, response=, answer=, **extra)` binds for this dataset's extra columns."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        sig.bind(prompt="", response="", answer="", **extra)
    except TypeError as e:
        cols = f"; this dataset's other columns: {sorted(extra)}" if extra else ""
        raise RewardSpecError(f"reward {name!r} cannot be called as fn(prompt=..., response=..., answer=..., **extra) "
                              f"({e}){cols}; give it those parameters and **extra") from None


def get_reward_fn(name: str) -> RewardFn:
    """The reward function for a registered `name` or an import path `module:function`."""
    if name in REGISTRY:
        return _import_reward(name, REGISTRY[name])
    if ":" in name:
        return _import_reward(name, name)
    known = ", ".join(sorted(REGISTRY))
    raise RewardSpecError(
        f"reward {name!r} is not a registered name ({known}) nor an import path 'module:function'; "
        "list one of those in reward.functions"
    )


__all__ = ["REGISTRY", "RewardFn", "RewardSpecError", "check_reward_signature", "get_reward_fn"]
