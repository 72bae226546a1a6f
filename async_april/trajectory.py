"""Trajectory types shared by engines, the rollout store and the learner.

A `Sample` is one response to one prompt. Every response token carries the
behaviour logprob recorded by the engine that sampled it and the policy
version of the weights that engine held, so a response resumed across
several weight updates keeps the true provenance of each segment. Arrays are
numpy (cheap to pickle through Ray), never lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Sample:
    prompt_index: int
    """Index of the prompt in the dataset stream (epoch * len(dataset) + position)."""
    sample_index: int
    """Position of this response within its group, 0..n-1."""
    prompt_ids: np.ndarray
    response_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    behavior_logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """log pi_behaviour(token) per response token, from the engine that sampled it."""
    versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Policy version that sampled each response token."""
    finish_reason: FinishReason | None = None
    """None while unfinished; `abort` marks a partial response waiting to be resumed."""
    num_resumes: int = 0
    reward: float | None = None
    answer: str | None = None
    """Reference answer for the reward function."""
    extra: dict = field(default_factory=dict)
    """Other dataset columns, passed to the reward functions as keyword arguments."""
    reward_parts: dict = field(default_factory=dict)
    """Value of each configured reward function, before weighting."""

    @property
    def uid(self) -> str:
        return f"p{self.prompt_index}-s{self.sample_index}"

    @property
    def done(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def num_tokens(self) -> int:
        return int(self.response_ids.shape[0])

    def extend(self, ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, finish_reason: FinishReason) -> None:
        """Append a generated segment (from a first attempt or a resume)."""
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"segment lengths differ: ids {len(ids)}, logprobs {len(logprobs)}, versions {len(versions)}")
        # Versions may change inside a segment (an in-flight update, `on_weight_update: continue`),
        # but never decrease along the response: staleness is read from the oldest token.
        joined = np.concatenate([self.versions[-1:], np.asarray(versions, np.int64)])
        if np.any(np.diff(joined) < 0):
            i = int(np.argmax(np.diff(joined) < 0))
            raise ValueError(f"{self.uid}: version went backwards ({joined[i]} -> {joined[i + 1]})")
        self.response_ids = np.concatenate([self.response_ids, np.asarray(ids, np.int64)])
        self.behavior_logprobs = np.concatenate([self.behavior_logprobs, np.asarray(logprobs, np.float32)])
        self.versions = np.concatenate([self.versions, np.asarray(versions, np.int64)])
        self.finish_reason = finish_reason

    def resume_input_ids(self) -> np.ndarray:
        """What an engine prefills to continue this response: prompt plus the partial response."""
        return np.concatenate([self.prompt_ids, self.response_ids])


@dataclass
class Group:
    """The n samples of one prompt; advantages are computed within a group."""

    prompt_index: int
    samples: list[Sample]

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def rewards(self) -> np.ndarray:
        return np.array([np.nan if s.reward is None else s.reward for s in self.samples], np.float32)

    def min_version(self) -> int:
        """Oldest policy version of any token in the group (its staleness bound)."""
        vs = [int(s.versions.min()) for s in self.samples if len(s.versions)]
        return min(vs) if vs else -1
