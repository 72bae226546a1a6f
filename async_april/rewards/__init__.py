"""Reward functions, looked up by registered name or by import path.

Every reward has the signature `fn(prompt: str, response: str, answer: str,
**extra) -> float`, where `response` is the decoded sample text (special
tokens skipped) and `answer` the dataset's reference. `extra` carries any
other dataset columns; rewards must ignore keys they do not know.
"""

from __future__ import annotations

import importlib
from typing import Callable

RewardFn = Callable[..., float]

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
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or ":" in attr:
        raise ValueError(f"reward {spec!r}: an import path must look like 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name}: {exc}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward {spec!r}: module {module_name} has no attribute {attr}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name}:{attr} is a {type(fn).__name__}, not a function")
    return fn


def get_reward_fn(name: str) -> RewardFn:
    """The reward function for a registered `name` or an import path `module:function`."""
    if name in REGISTRY:
        return _import_reward(name, REGISTRY[name])
    if ":" in name:
        return _import_reward(name, name)
    known = ", ".join(sorted(REGISTRY))
    raise ValueError(
        f"reward {name!r} is not a registered name ({known}) nor an import path 'module:function'; "
        "list one of those in reward.functions"
    )


__all__ = ["REGISTRY", "RewardFn", "get_reward_fn"]
