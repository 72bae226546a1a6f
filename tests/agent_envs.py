"""Environments of the tests' own (tests/test_agents.py), named in configs as `tests.agent_envs:Class`,
the way a user names theirs. A module of its own so the class the runner imports and the one the test
holds (with its events) are the same object."""

from __future__ import annotations

import threading
import time

import numpy as np

from actors.agents.env import Step
from async_april.tasks.reverse_turns import ReverseTurnsEnv

STEP_NOTE = "not an environment: a module attribute that is no class"


class SlowReverseEnv(ReverseTurnsEnv):
    """The built-in task with a tool that takes STEP_S per call."""

    STEP_S = 0.05

    def step(self, state, turn_ids):
        time.sleep(self.STEP_S)
        return super().step(state, turn_ids)


class GatedReverseEnv(ReverseTurnsEnv):
    """Each step announces itself (`entered`) and waits for `release`: the test decides where an abort lands."""

    entered = threading.Event()
    release = threading.Event()

    def step(self, state, turn_ids):
        type(self).entered.set()
        assert type(self).release.wait(30), "the test never released the step"
        return super().step(state, turn_ids)


class HangingToolEnv(ReverseTurnsEnv):
    """The tool hangs (until `unblock`) for prompts whose first chunk starts with '0'; on_failure ends the
    episode with a marker reward so the test can tell a timeout from a normal end."""

    unblock = threading.Event()

    def step(self, state, turn_ids):
        if state["chunks"][0].startswith("0"):
            type(self).unblock.wait(60)
        return super().step(state, turn_ids)

    def on_failure(self, state, turn_ids, error):
        assert "timed out" in error
        return Step(np.zeros(0, np.int64), -1.0, True, state)


class NotAnEnv:
    pass
