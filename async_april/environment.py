"""The environment interface a user implements for multi-turn rollouts (plain data in, plain data out).

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
run again on resume (from the last state it reported through `progress`, if its
`step` takes that keyword). So `step` must be a function of (state, turn ids):
the same inputs give the same observation, reward and state.
One instance serves all of an actor's episodes, and its steps run in several
threads at once: keep no per-episode data on it, and guard anything shared.

Steps run in threads off the generation loop (actors/agents/runner.py), with a
timeout; a step that raises, times out or returns an observation over the
limit goes to `on_failure`, which chooses what the model sees next.

The loader of `rollout.env` (built-ins, `module:Class`, agent loops) is actors/agents/env.py; the
protocol lives in the core so that tasks (async_april/tasks/) implement it without importing actors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


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
        """The model's turn -> observation ids, reward, done, new state. A subclass may add a keyword
        `progress=None`: the runner then passes a callable to report, from the step's thread, the state
        a rerun of this step must start from once a side effect is done (kept if the step is aborted)."""
        raise NotImplementedError

    def on_failure(self, state: dict, turn_ids: np.ndarray, error: str) -> Step:
        """The step raised, timed out or overflowed: by default the episode ends with no reward for the turn."""
        return Step(np.zeros(0, np.int64), 0.0, True, state)


def on_failure(env: Any, state: dict, turn_ids: np.ndarray, error: str) -> Step:
    """The environment's own `on_failure` when it has one, else the base class's (episode over)."""
    hook = getattr(env, "on_failure", None)
    if hook is None:
        return Environment.on_failure(env, state, turn_ids, error)
    return hook(state, turn_ids, error)
