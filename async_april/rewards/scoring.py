"""RewardScorer: the weighted sum of the configured reward functions, with error policy.

Each function is called as `fn(prompt=..., response=..., answer=..., **extra)` and must
return a finite float. A function that raises or returns NaN/inf is counted, its
first traceback logged, and scored 0 (`reward.on_error: zero`) or the run stops
(`stop`). Per-function values are kept so the controller can log `reward/<name>`.
"""

from __future__ import annotations

import logging
import math
import traceback
from typing import Any

from async_april.config import RewardConfig
from async_april.rewards import get_reward_fn

log = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward function failed and `reward.on_error` is `stop`."""


class RewardScorer:
    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.functions = {name: get_reward_fn(name) for name in cfg.functions}
        self.errors = 0

    def score(self, prompt: str, response: str, answer: str, extra: dict[str, Any] | None = None) -> tuple[float, dict[str, float]]:
        """(weighted total, {name: value}) for one response."""
        parts: dict[str, float] = {}
        for name, fn in self.functions.items():
            try:
                value = float(fn(prompt=prompt, response=response, answer=answer, **(extra or {})))
                if not math.isfinite(value):
                    raise ValueError(f"reward {name!r} returned {value}")
            except Exception as e:
                self.errors += 1
                if self.errors == 1:
                    log.error("reward %r failed (first failure; later ones are only counted in rollout/reward_errors):\n%s", name, traceback.format_exc())
                if self.cfg.on_error == "stop":
                    raise RewardError(f"reward {name!r} failed and reward.on_error=stop: {e!r}") from e
                value = 0.0
            parts[name] = value
        total = sum(self.cfg.functions[n] * v for n, v in parts.items())
        return total, parts
