"""Reward functions that misbehave on purpose, for tests/test_faults.py (imported by path
`tests.fault_rewards:NAME` inside the generation actors)."""

from __future__ import annotations

import math

from async_april.rewards.reverse import reverse_match

_calls = 0


def fails_after_40(prompt: str, response: str, answer: str, **extra) -> float:
    """reverse_match for the first 40 calls in this process, then raises."""
    global _calls
    _calls += 1
    if _calls > 40:
        raise ValueError(f"fault_rewards: injected failure at call {_calls}")
    return reverse_match(prompt=prompt, response=response, answer=answer)


def nan_every_fifth(prompt: str, response: str, answer: str, **extra) -> float:
    """reverse_match, except every fifth call in this process returns NaN."""
    global _calls
    _calls += 1
    return math.nan if _calls % 5 == 0 else reverse_match(prompt=prompt, response=response, answer=answer)
