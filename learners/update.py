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

from async_april.algorithms.rejection import rejection_keep
from learners.logprobs import collate

if TYPE_CHECKING:
    from async_april.algorithms.losses import LossSettings
    from async_april.rollout.batch import TrainBatch


def split_mini_batches(batch: "TrainBatch", mini_batches: int) -> list["TrainBatch"]:
    """`mini_batches` consecutive parts of the rows, sizes differing by at most one; rows are in group
    order, so each part holds whole groups when the row count divides evenly."""
    if not 1 <= mini_batches <= len(batch):
        raise ValueError(f"cannot split {len(batch)} rows into {mini_batches} mini-batches; set learner.mini_batches <= {len(batch)}")
    return [batch.select(rows) for rows in np.array_split(np.arange(len(batch)), mini_batches)]


def needs_proximal_forward(settings: "LossSettings", mini_batches: int) -> bool:
    """Whether the step needs the pre-update policy's logprobs from a separate no-grad forward: with
    several mini-batches whenever the loss reads them (decoupled, none, rejection against pi_prox);
    with one, only to count the tokens rejection keeps before the step (rejected tokens out of the
    normaliser), since otherwise the training forward's own values, detached, are pi_prox."""
    reads_prox = settings.correction == "none" or settings.needs_proximal
    return (reads_prox and mini_batches > 1) or settings.rejection.counts_before_step


def kept_counts(local: "TrainBatch", settings: "LossSettings") -> tuple[int, int]:
    """(tokens, sequences) of `local` that rejection keeps, judged against its proximal logprobs:
    the normaliser when rejected tokens leave it (sum over ranks). A sequence counts if any of its
    tokens is kept. A rank with no rows of this mini-batch keeps nothing."""
    if len(local) == 0:
        return 0, 0
    r = settings.rejection
    mb = collate(local.input_ids, local.prompt_lens, local.behavior_logprobs, local.advantages,
                 proximal_logprobs=local.proximal_logprobs, loss_masks=local.loss_masks)
    mask = mb.response_mask.bool()
    adv = mb.advantages.double().unsqueeze(-1).expand(mask.shape) if r.negative_advantages_only else None
    keep = rejection_keep(mb.proximal_logprobs.double(), mb.behavior_logprobs.double(), mask, r.divergence, r.level,
                          r.low, r.high, adv)
    return int(keep.sum()), int(keep.any(dim=-1).sum())


def mean_over_mini_batches(per_mini: list[dict[str, float]]) -> dict[str, float]:
    """One value per key for the whole step: `_max` keys by max, counts (`loss/tokens`) by sum,
    every other key by the plain mean over mini-batches (each already exact for its own part)."""
    if not per_mini:
        return {}
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_mini for k in m):  # a lag may have tokens in some mini-batches only
        values = [m[key] for m in per_mini if key in m]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key == "loss/tokens":
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def pack_micro_batches(lengths: np.ndarray, max_tokens: int, packed: bool = False) -> list[list[int]]:
    """Greedy grouping of row indices (longest first) so each micro-batch's cost stays within
    `max_tokens`: rows x longest row when right-padded; with `packed`, the summed lengths (first fit:
    each row joins the first micro-batch with room, so short rows fill the long ones' leftovers).

    A row longer than the budget goes alone in its own micro-batch.
    """
    if packed:
        return _first_fit(np.asarray(lengths), max_tokens)
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


def _first_fit(lengths: np.ndarray, max_tokens: int) -> list[list[int]]:
    groups: list[list[int]] = []
    room: list[int] = []
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        j = next((k for k, r in enumerate(room) if r >= n), None)
        if j is None:
            groups.append([int(i)])
            room.append(max_tokens - n)
        else:
            groups[j].append(int(i))
            room[j] -= n
    return groups


def merge_rank_metrics(metrics: list[dict[str, float]]) -> dict[str, float]:
    """Combine per-micro-batch loss metrics from all ranks: `_tokens`-weighted means, max for `_max`."""
    if not metrics:
        return {}
    tokens = [m.get("_tokens", 0.0) for m in metrics]
    total = sum(tokens)
    out: dict[str, float] = {"loss/tokens": total}
    for key in metrics[0]:
        if key == "_tokens":
            continue
        if key.endswith("_max"):
            out[key] = max(m[key] for m in metrics)
        else:
            out[key] = sum(m[key] * n for m, n in zip(metrics, tokens)) / max(total, 1.0)
    return out
