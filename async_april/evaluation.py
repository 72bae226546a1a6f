"""Held-out evaluation during training: what is evaluated, when, and the numbers reported.

    every eval.every steps (and before the first / after the last step, if asked):
      controller ── Evaluator.after_step(step, learner) ──> learner.weight_buckets()  (one bucketed export)
                         │ refs + version, returns at once                 │
                         v                                                 v
                  EvalActor.evaluate(refs, version)   (actors/evaluation.py: its own engine, low CPU priority)
                         │ loads that version, samples every prompt `samples` times + once greedily, scores
                         v
                  metrics eval/<name>/... logged with the step at which they arrive, never waited for

The learner never waits for an evaluation: one runs at a time, and one that falls due while the
previous is still running is skipped and counted (`eval/skipped`). Only the last step waits (nothing
is left to train); an evaluation still running at an older version is then superseded by the final one.
Training never dies with an evaluation: one that raises or whose actor dies is logged as
`eval/<name>/failed` (counted in `eval/failed`), and the next one gets a new actor.
Every evaluation loads one version before its first request and nothing else loads weights into its
engine until it ends, so its samples never mix versions (checked on every token). Evaluation prompts
never enter the rollout store: they cannot be trained or counted as training prompts.

This module holds the pure parts (tested without Ray): `pass_at_k`, `summarize`, `EvalSchedule`,
`load_eval_sets`. The driver (`Evaluator`) is async_april/launch/evaluator.py; the actor
actors/evaluation.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from async_april.config import Config, DataConfig
from async_april.data import DataError, PromptDataset, PromptRow, load_prompts

log = logging.getLogger(__name__)

BUILTIN_OVERDRAW = 4
"""A builtin held-out set draws this many times `num_prompts` rows, to still have `num_prompts` once the
rows that also appear in the training data are left out (short digit strings often do)."""


# ------------------------------------------------------------------------------------ maths


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimator of pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k), as their stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


@dataclass
class SetResult:
    """Raw outcome of one evaluated set: per prompt, the `samples` sampled responses (and a greedy one)."""

    name: str
    version: int
    rewards: np.ndarray
    """[prompts, samples] rewards of the sampled responses."""
    lengths: np.ndarray
    """[prompts, samples] response lengths in tokens (model tokens of a multi-turn episode)."""
    truncated: np.ndarray
    """[prompts, samples] True where the response hit max_new_tokens (finish reason `length`)."""
    greedy_rewards: np.ndarray | None = None
    """[prompts] rewards of the greedy responses, if asked for."""


def summarize(r: SetResult, k: int, threshold: float) -> dict[str, float]:
    """The `eval/<name>/...` metrics of one set: rewards and lengths averaged over sampled responses,
    pass@1 and pass@k (unbiased, correct = reward >= threshold) averaged over prompts."""
    n = r.rewards.shape[1]
    correct = (r.rewards >= threshold).sum(axis=1)
    p = f"eval/{r.name}/"
    out = {
        p + "mean_reward": float(r.rewards.mean()),
        p + "pass@1": float(np.mean([pass_at_k(n, int(c), 1) for c in correct])),
        p + "pass@k": float(np.mean([pass_at_k(n, int(c), k) for c in correct])),
        p + "mean_length": float(r.lengths.mean()),
        p + "truncation_rate": float(r.truncated.mean()),
        p + "version": float(r.version),
        p + "prompts": float(r.rewards.shape[0]),
    }
    if r.greedy_rewards is not None:
        out[p + "greedy_reward"] = float(r.greedy_rewards.mean())
        out[p + "greedy_pass"] = float((r.greedy_rewards >= threshold).mean())
    return out


# ------------------------------------------------------------------------------------ data


@dataclass
class EvalSet:
    name: str
    rows: list[PromptRow]
    in_training: int = 0
    """Rows left out because their prompt is also a training prompt."""


def load_eval_sets(cfg: Config, tokenizer, train: PromptDataset | None, limit: int | None = None) -> list[EvalSet]:
    """Each `eval.datasets` entry read through the same loader as `data` (sources, columns, templates,
    long-prompt and bad-row rules), with every prompt that is also a training prompt left out (counted),
    so the set is held out. `limit` caps the rows read (`async-april check`)."""
    seen = {tuple(r.prompt_ids.tolist()) for r in train.rows} if train is not None else set()
    out = []
    for i, d in enumerate(cfg.eval.datasets):
        sub = cfg.model_copy(deep=True)
        sub.data = DataConfig(**d.model_dump(exclude={"name", "seed", "limit", "num_prompts", "shuffle"}),
                              num_prompts=d.num_prompts * BUILTIN_OVERDRAW, shuffle=False)
        sub.run.seed = d.seed if d.seed is not None else cfg.run.seed + 1
        builtin = d.source.startswith("builtin:")
        want = d.num_prompts if builtin else d.limit
        want = min(want, limit) if want is not None and limit is not None else (want or limit)
        try:
            ds = load_prompts(sub, tokenizer, limit=None if builtin else want)
        except DataError as e:
            raise DataError(f"eval.datasets[{i}] ({d.name}): {e}") from None
        rows, in_training = [], 0
        for r in ds.rows:
            if want is not None and len(rows) >= want:
                break
            if tuple(r.prompt_ids.tolist()) in seen:
                in_training += 1
            else:
                rows.append(r)
        if not rows:
            raise DataError(f"eval.datasets[{i}] ({d.name}): every one of its {len(ds.rows)} prompts is also a "
                            "training prompt; give a held-out source (or, for builtin tasks, another seed)")
        out.append(EvalSet(d.name, rows, in_training))
    return out


# ------------------------------------------------------------------------------------ schedule


@dataclass
class EvalSchedule:
    """When evaluations fall due, and the counters a checkpoint carries so a resumed run continues them."""

    every: int
    steps: int
    at_end: bool
    requested: int = 0
    completed: int = 0
    skipped: int = 0
    failed: int = 0
    """Evaluations that raised or whose actor died (each logged as `eval/<name>/failed`); training went on."""
    last_version: int = -1
    """Policy version of the latest evaluation started (-1: none); a version is never evaluated twice."""

    def due(self, step: int) -> bool:
        return (self.every > 0 and step % self.every == 0) or (self.at_end and step == self.steps)

    def any_due(self, after: int) -> bool:
        """Whether a step in (after, steps] is due."""
        return after < self.steps and (self.at_end or (self.every > 0 and (after // self.every + 1) * self.every <= self.steps))

    def state(self) -> dict[str, int]:
        return {"eval/requested": self.requested, "eval/completed": self.completed, "eval/skipped": self.skipped,
                "eval/failed": self.failed, "eval/last_version": self.last_version}

    def restore(self, state: dict[str, Any]) -> None:
        """Counters from a checkpoint's controller state; an evaluation in flight when it was saved is lost
        with the process, so it counts as skipped."""
        self.requested = int(state.get("eval/requested", 0))
        self.completed = int(state.get("eval/completed", 0))
        self.last_version = int(state.get("eval/last_version", -1))
        self.failed = int(state.get("eval/failed", 0))  # absent from checkpoints written before it was counted
        self.skipped = self.requested - self.completed - self.failed
