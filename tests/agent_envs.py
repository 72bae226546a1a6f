"""Environments of the tests' own (tests/test_agents.py), named in configs as `tests.agent_envs:Class`,
the way a user names theirs. A module of its own so the class the runner imports and the one the test
holds (with its events) are the same object."""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

from async_april.environment import Environment, Reset, Step
from async_april.tasks.reverse_turns import ReverseTurnsEnv

STEP_NOTE = "not an environment: a module attribute that is no class"


class SlowReverseEnv(ReverseTurnsEnv):
    """The built-in task with a tool that takes STEP_S per call; `stepping` counts the calls running now,
    so a test can act while one is (an interrupt that lands between two model turns)."""

    STEP_S = 0.05
    stepping = 0
    _lock = threading.Lock()

    def step(self, state, turn_ids):
        cls = type(self)
        with cls._lock:
            cls.stepping += 1
        try:
            time.sleep(self.STEP_S)
            return super().step(state, turn_ids)
        finally:
            with cls._lock:
                cls.stepping -= 1


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


class ChattyEnv(ReverseTurnsEnv):
    """Observations longer than any sensible limit after the first turn; a step raises on the third turn;
    on_failure records what it was told and ends nothing (the limits must)."""

    errors: list[str] = []

    def step(self, state, turn_ids):
        if state["turn"] == 2:
            raise RuntimeError("tool crashed")
        out = super().step(state, turn_ids)
        if state["turn"] == 1:
            out.observation_ids = np.concatenate([out.observation_ids] * 10)
        return out

    def on_failure(self, state, turn_ids, error):
        type(self).errors.append(error)
        return Step(np.array([5, 6, 14]), 0.0, False, dict(state, turn=state["turn"] + 1))


class ExitingEnv(ReverseTurnsEnv):
    """A step that calls sys.exit on the second turn, as a careless tool script does; on_failure records it."""

    errors: list[str] = []

    def step(self, state, turn_ids):
        if state["turn"] == 1:
            sys.exit(5)
        return super().step(state, turn_ids)

    def on_failure(self, state, turn_ids, error):
        type(self).errors.append(error)
        return Step(np.array([5, 6, 14]), 0.0, True, dict(state, turn=state["turn"] + 1))


# ------------------------------------------------------------------ agent loops (module:function)


async def reverse_turns_loop(ctx, row):
    """The built-in reverse_turns task written as an agent loop: the episodes of ReverseTurnsEnv."""
    from async_april.rewards.reverse import reverse_match

    chunks = row.answer.split(",")
    for i, chunk in enumerate(chunks):
        turn = await ctx.generate()
        ctx.add_reward(reverse_match("", ctx.decode(turn), chunk[::-1]) / len(chunks))
        if i + 1 < len(chunks):
            ctx.observe(ctx.tokenizer(chunks[i + 1] + "=", add_special_tokens=False)["input_ids"])
    return 0.0


class GatedLookup:
    """A tool the test holds: each run announces itself (`entered`), waits for `release`, and is counted."""

    entered = threading.Event()
    release = threading.Event()
    runs: list[str] = []

    @classmethod
    def reversed_chunk(cls, chunk: str) -> str:
        cls.runs.append(chunk)
        cls.entered.set()
        assert cls.release.wait(30), "the test never released the tool"
        return chunk[::-1]


async def gated_tool_loop(ctx, row):
    """reverse_turns whose scoring asks a (gated, counted) tool for the reversed chunk; the reward comes at the end."""
    from async_april.rewards.reverse import reverse_match

    chunks, score = row.answer.split(","), 0.0
    for i, chunk in enumerate(chunks):
        turn = await ctx.generate()
        want = await ctx.call(GatedLookup.reversed_chunk, chunk)
        score += reverse_match("", ctx.decode(turn), want) / len(chunks)
        if i + 1 < len(chunks):
            ctx.observe(ctx.tokenizer(chunks[i + 1] + "=", add_special_tokens=False)["input_ids"])
    return score


async def unseeded_loop(ctx, row):
    """Observes ids drawn without the row's seed: its replay cannot repeat its record."""
    while True:
        await ctx.generate()
        ctx.observe(np.random.default_rng().integers(4, 14, size=3))


def plain_loop(ctx, row):
    return 0.0


async def one_argument_loop(ctx):
    return 0.0


async def object_result_loop(ctx, row):
    """Its tool returns an object that no checkpoint can hold."""
    await ctx.generate()
    await ctx.call(lambda: {"answer": [1, object()]})
    return 0.0


class FlakyTool:
    """Turn 1: answers. Turn 2: hangs (until `unblock`). Turn 3: raises. Every run is counted."""

    unblock = threading.Event()
    runs: list[int] = []

    @classmethod
    def run(cls, turn: int) -> str:
        cls.runs.append(turn)
        if turn == 2:
            cls.unblock.wait(60)
        if turn == 3:
            raise ConnectionError("sandbox unreachable")
        return f"ok {turn}"


async def flaky_tool_loop(ctx, row):
    """Observes what the tool answered, or the failure it chose to show: one id per character class."""
    from actors.agents.loop import ToolFailed

    for turn in range(1, 5):
        await ctx.generate()
        try:
            answer = await ctx.call(FlakyTool.run, turn, timeout_s=0.2)
            ctx.observe([5, turn])  # "ok"
        except ToolFailed as failure:
            ctx.observe([6, 7 if "timed out" in str(failure) else 8])
            ctx.add_reward(-0.25)
            answer = str(failure)
        assert answer
    return 1.0


class QuietEnv(Environment):
    """Says nothing after the first turn (an empty observation, done=False), one token after the second;
    the episode ends at the third step. Every turn it is handed is recorded."""

    handed: list[list[int]] = []

    def reset(self, row):
        return Reset(state={"turn": 0})

    def step(self, state, turn_ids):
        type(self).handed.append([int(t) for t in turn_ids])
        turn = state["turn"] + 1
        return Step(np.zeros(0, np.int64) if turn == 1 else np.array([14]), 0.0, turn == 3, {"turn": turn})


class Ledger:
    """A tool with a side effect that must happen once per episode step: every charge is recorded."""

    charges: list[int] = []

    @classmethod
    def charge(cls, turn: int) -> str:
        cls.charges.append(turn)
        return f"receipt {turn}"


async def charge_then_lookup_loop(ctx, row):
    """Each step charges a card (Ledger), then asks the gated lookup tool for the reversed chunk: an abort
    during the lookup must not charge the card again on resume."""
    from async_april.rewards.reverse import reverse_match

    chunks, score = row.answer.split(","), 0.0
    for i, chunk in enumerate(chunks):
        turn = await ctx.generate()
        await ctx.call(Ledger.charge, i)
        want = await ctx.call(GatedLookup.reversed_chunk, chunk)
        score += reverse_match("", ctx.decode(turn), want) / len(chunks)
        if i + 1 < len(chunks):
            ctx.observe(ctx.tokenizer(chunks[i + 1] + "=", add_special_tokens=False)["input_ids"])
    return score
