"""Reward functions that misbehave on purpose, for tests/test_faults.py and tests/test_task_and_reward.py
(imported by path `tests.fault_rewards:NAME` inside the generation actors and reward workers)."""

from __future__ import annotations

import math
import signal
import sys
import time

from async_april.rewards.reverse import reverse_match

_calls = 0
_first_call_done = False


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


def sleeps_forever(prompt: str, response: str, answer: str, **extra) -> float:
    """Never returns (a reward stuck on I/O or in an endless loop)."""
    time.sleep(1e9)
    return 0.0


def ignores_its_timer(prompt: str, response: str, answer: str, **extra) -> float:
    """Never returns and cannot be interrupted by SIGALRM (as if stuck inside C code)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(1e9)
    return 0.0


def hangs_on_its_first_call(prompt: str, response: str, answer: str, **extra) -> float:
    """1.0, except that the first call of this function in each process never returns."""
    global _first_call_done
    if not _first_call_done:
        _first_call_done = True
        time.sleep(1e9)
    return 1.0


def calls_sys_exit(prompt: str, response: str, answer: str, **extra) -> float:
    """Ends its process the way a careless script does (SystemExit is a BaseException, not an Exception)."""
    sys.exit(4)
