"""PPO mini-batches: how one rollout batch becomes `learner.mini_batches` optimizer steps.

    batch (B rows, group order) --split_mini_batches--> M consecutive parts of ~B/M rows
    [proximal] one no-grad forward of the pre-update weights over every row, before the first step
    for each part:  micro-batches -> loss normalised by THIS part's tokens and sequences
                    -> clip grad norm -> optimizer step (or skip it if non-finite)

The proximal policy of decoupled PPO is the learner's policy before this batch's
updates. With one mini-batch it IS the current parameters, so the training
forward's logprobs, detached, are its values (no second forward). With several,
later mini-batches train weights that already moved, so u = pi_theta / pi_prox
leaves 1 and the clip bounds the drift from the pre-update policy: the proximal
logprobs are computed once, before the first update (AReaL's recipe:
areal/trainer/ppo/actor.py computes `compute_logp` under no_grad, then
`_ppo_update` splits the batch into `ppo_n_minibatches` and calls `train_batch`
on each). correction=none gets the same proximal base (plain PPO on a
recomputed old policy); direct needs none (its base is the behaviour policy).

Pure functions; the learner worker does the forwards and the steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from async_april.batch import TrainBatch


def split_mini_batches(batch: "TrainBatch", mini_batches: int) -> list["TrainBatch"]:
    """`mini_batches` consecutive parts of the rows, sizes differing by at most one; rows are in group
    order, so each part holds whole groups when the row count divides evenly."""
    if not 1 <= mini_batches <= len(batch):
        raise ValueError(f"cannot split {len(batch)} rows into {mini_batches} mini-batches; set learner.mini_batches <= {len(batch)}")
    return [batch.select(rows) for rows in np.array_split(np.arange(len(batch)), mini_batches)]


def needs_proximal_forward(correction: str, mini_batches: int) -> bool:
    """Whether the step needs the pre-update policy's logprobs from a separate no-grad forward."""
    return correction in ("decoupled", "none") and mini_batches > 1


def mean_over_mini_batches(per_mini: list[dict[str, float]]) -> dict[str, float]:
    """One value per key for the whole step: `_max` keys by max, counts (`loss/tokens`) by sum,
    every other key by the plain mean over mini-batches (each already exact for its own part)."""
    if not per_mini:
        return {}
    out: dict[str, float] = {}
    for key in per_mini[0]:
        values = [m[key] for m in per_mini if key in m]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key == "loss/tokens":
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def pack_micro_batches(lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Greedy packing of row indices (longest first) so rows x longest row stays within `max_tokens`.

    A row longer than the budget goes alone in its own micro-batch.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in np.argsort(-np.asarray(lengths), kind="stable"):
        n = int(lengths[i])
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(int(i))
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups
