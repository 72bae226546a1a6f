"""From completed groups to the learner's input.

The learner is algorithm-blind: advantages are computed here, before it, from
each group's rewards. A `TrainBatch` holds one row per response with the
behaviour logprobs and per-token versions exactly as the engines recorded them;
the learner never replaces them with recomputed values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from async_april.rollout.trajectory import Group


@dataclass
class TrainBatch:
    input_ids: list[np.ndarray]
    """Prompt followed by response, one array per sequence."""
    prompt_lens: np.ndarray
    """Prompt length of each sequence; response tokens start there."""
    behavior_logprobs: list[np.ndarray]
    """Per response token, from the engine (and policy version) that sampled it."""
    versions: list[np.ndarray]
    """Per response token, the policy version that sampled it."""
    advantages: np.ndarray
    """One advantage per sequence, broadcast over its response tokens."""
    policy_version: int
    """Learner version the batch is trained at; staleness = policy_version - versions."""
    proximal_logprobs: list[np.ndarray] | None = None
    """Per response token, the learner's pre-update policy (decoupled correction with several
    mini-batches): filled in by the learner, never by the rollout side."""
    loss_masks: list[np.ndarray] | None = None
    """Per response token, 1 for model tokens and 0 for environment tokens (multi-turn rollouts);
    None: every response token is the model's. Loss, normalisers and staleness read only 1s."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def response_lens(self) -> np.ndarray:
        return np.array([len(x) for x in self.behavior_logprobs], np.int64)

    @property
    def num_response_tokens(self) -> int:
        """Trained response tokens: the model's (environment tokens count in no normaliser)."""
        return int(self.model_lens.sum())

    @property
    def model_lens(self) -> np.ndarray:
        """Model tokens per row (= response_lens without environment tokens)."""
        if self.loss_masks is None:
            return self.response_lens
        return np.array([int(np.asarray(m).sum()) for m in self.loss_masks], np.int64)

    def model_versions(self) -> list[np.ndarray]:
        """Per row, the versions of the model's tokens only."""
        if self.loss_masks is None:
            return self.versions
        return [v[np.asarray(m).astype(bool)] for v, m in zip(self.versions, self.loss_masks)]

    def select(self, rows: list[int] | np.ndarray) -> "TrainBatch":
        rows = list(rows)
        return TrainBatch(
            input_ids=[self.input_ids[i] for i in rows],
            prompt_lens=self.prompt_lens[rows],
            behavior_logprobs=[self.behavior_logprobs[i] for i in rows],
            versions=[self.versions[i] for i in rows],
            advantages=self.advantages[rows],
            policy_version=self.policy_version,
            proximal_logprobs=None if self.proximal_logprobs is None else [self.proximal_logprobs[i] for i in rows],
            loss_masks=None if self.loss_masks is None else [self.loss_masks[i] for i in rows],
        )

    def shard(self, rank: int, world_size: int) -> "TrainBatch":
        """Rows for one learner rank, balanced by token count (greedy longest-first)."""
        lengths = np.array([len(x) for x in self.input_ids])
        loads = np.zeros(world_size, np.int64)
        owner = np.empty(len(lengths), np.int64)
        for i in np.argsort(-lengths, kind="stable"):
            r = int(np.argmin(loads))
            owner[i] = r
            loads[r] += lengths[i]
        return self.select(np.nonzero(owner == rank)[0])


def build_train_batch(groups: list[Group], advantages: np.ndarray, policy_version: int) -> TrainBatch:
    """Flatten groups (row-major: group, then sample) with their [groups x n] advantages."""
    samples = [s for g in groups for s in g.samples]
    if len(samples) != advantages.size:
        raise ValueError(f"{len(samples)} samples but {advantages.size} advantages")
    return TrainBatch(
        input_ids=[np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64) for s in samples],
        prompt_lens=np.array([len(s.prompt_ids) for s in samples], np.int64),
        behavior_logprobs=[s.behavior_logprobs.astype(np.float32) for s in samples],
        versions=[s.versions.astype(np.int64) for s in samples],
        advantages=advantages.reshape(-1).astype(np.float32),
        policy_version=policy_version,
        # Only multi-turn responses hold environment tokens; single-turn batches keep None (all model).
        loss_masks=[s.model_mask.astype(np.float32) for s in samples]
        if any(not s.model_mask.all() for s in samples) else None,
    )
