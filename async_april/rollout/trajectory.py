"""Trajectory types shared by engines, the rollout store and the learner.

A `Sample` is one response to one prompt. Every response token carries the
behaviour logprob recorded by the engine that sampled it and the policy
version of the weights that engine held, so a response resumed across
several weight updates keeps the true provenance of each segment. Arrays are
numpy (cheap to pickle through Ray), never lists.

Multi-turn rollouts (actors/agents/) interleave model turns with environment
observations in one response: `loss_mask` is 1 on every token the model
sampled and 0 on every token the environment appended. Environment tokens have
no behaviour logprob (0) and no policy version of their own (they repeat the
previous token's, so `versions` never decreases); everything that trains on or
measures tokens reads them through `loss_mask`.
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
    loss_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8))
    """Per response token: 1 sampled by the model (trained), 0 appended by an environment (never trained)."""
    env_state: dict | None = None
    """Multi-turn: the environment's state after the last applied step (plain data); None before reset."""
    env_pending: bool = False
    """Multi-turn: the last model turn ended but its environment step has not been applied yet
    (interrupted while the step ran); a resume runs that step first."""
    turns: int = 0
    """Multi-turn: model turns whose environment step has been applied."""
    env_reward: float = 0.0
    """Multi-turn: sum of the environment's step rewards so far (the sample's reward when it ends)."""
    turn_begin: int | None = None
    """Multi-turn: response index where the current model turn began, recorded by every applied step
    (an empty observation ends a turn too). None until the first step (the first turn began at 0) and in
    samples checkpointed before it was recorded; `turn_start` then reads it from the mask."""

    @property
    def uid(self) -> str:
        return f"p{self.prompt_index}-s{self.sample_index}"

    @property
    def done(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def num_tokens(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def model_mask(self) -> np.ndarray:
        """`loss_mask` as bool; all True for a response without one (single-turn, or restored from a
        checkpoint written before multi-turn rollouts)."""
        m = getattr(self, "loss_mask", None)
        if m is None or len(m) != self.num_tokens:
            return np.ones(self.num_tokens, bool)
        return m.astype(bool)

    @property
    def num_model_tokens(self) -> int:
        return int(self.model_mask.sum())

    @property
    def model_versions(self) -> np.ndarray:
        """Versions of the model's tokens only (what staleness is measured on). Without a loss mask, the
        versions themselves (not a copy: the store reads this for every open group on every push)."""
        m = getattr(self, "loss_mask", None)
        if m is None or len(m) != self.num_tokens:
            return self.versions
        return self.versions[m.astype(bool)]

    @property
    def turn_start(self) -> int:
        """Response index where the current model turn began: as recorded (`turn_begin`), else just
        after the last environment token (right unless an observation was empty)."""
        if self.turn_begin is not None:
            return self.turn_begin
        env = np.nonzero(~self.model_mask)[0]
        return int(env[-1]) + 1 if len(env) else 0

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
        mask = self._mask_so_far()
        self.response_ids = np.concatenate([self.response_ids, np.asarray(ids, np.int64)])
        self.behavior_logprobs = np.concatenate([self.behavior_logprobs, np.asarray(logprobs, np.float32)])
        self.versions = np.concatenate([self.versions, np.asarray(versions, np.int64)])
        self.loss_mask = np.concatenate([mask, np.ones(len(ids), np.int8)])
        self.finish_reason = finish_reason

    def observe(self, ids: np.ndarray) -> None:
        """Append environment tokens: loss mask 0, logprob 0, the previous token's version (no meaning
        of their own; repeating it keeps `versions` monotone and the oldest model token the minimum)."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        last = self.versions[-1:] if len(self.versions) else np.zeros(1, np.int64)
        mask = self._mask_so_far()
        self.response_ids = np.concatenate([self.response_ids, ids])
        self.behavior_logprobs = np.concatenate([self.behavior_logprobs, np.zeros(len(ids), np.float32)])
        self.versions = np.concatenate([self.versions, np.repeat(last, len(ids))])
        self.loss_mask = np.concatenate([mask, np.zeros(len(ids), np.int8)])

    def _mask_so_far(self) -> np.ndarray:
        """The mask of the tokens held now (called before appending)."""
        return self.model_mask.astype(np.int8)

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
        vs = [int(v.min()) for s in self.samples if len(v := s.model_versions)]
        return min(vs) if vs else -1
