"""The rollout store: the one place that knows where every prompt and token is.

Generation actors lease work (one sample = one request) and push back finished
or aborted samples; the controller takes batches of complete groups. Order of
work: partial responses first (oldest tokens first), then fresh samples of
groups already started, then new prompts as groups of n, the last only as far
as the `StalenessController` admits. Every prompt taken from the dataset is in
exactly one state -- in flight, partial, completed (waiting for a batch),
trained, filtered, dropped or skipped (its learner step was skipped) -- and
`accounting()` proves it.

`RolloutStore` is plain Python (tested without Ray); `RolloutStoreActor`
(rollout/store_actor.py) wraps it as an async Ray actor whose `get_batch` waits
without blocking pushes. Everything here, leases included, is saved by
`state_dict()`. Admission, work order, batching and the state changes behind
the accounting stay in this one file: they are one state machine over the same
groups, and splitting it would spread each invariant over two files. What the
store reports (`accounting()`, `metrics()`) only reads that state:
rollout/store_report.py.
"""

from __future__ import annotations

import copy
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from async_april.config import Config
from async_april.data import PromptDataset
from async_april.rollout import store_report
from async_april.rollout.staleness import StalenessController
from async_april.rollout.trajectory import Group, Sample

PUSH_FINISHED = "finished"


@dataclass
class _Counters:
    started_groups: int = 0
    trained_groups: int = 0
    filtered_groups: int = 0
    dropped_groups: int = 0
    skipped_groups: int = 0
    requeued_groups: int = 0
    partial_resumed: int = 0
    aborted_tokens: int = 0
    aborted_tokens_reused: int = 0
    aborted_tokens_discarded: int = 0
    stale_tokens_discarded: int = 0
    requeue_limit_groups: int = 0
    actor_failures: int = 0
    wasted_tokens: Counter = field(default_factory=Counter)
    """Generated tokens that will never be trained, by reason: stale (requeued or dropped past eta), filtered."""
    extra: Counter = field(default_factory=Counter)


class RolloutStore:
    def __init__(self, cfg: Config, dataset: PromptDataset):
        self.dataset = dataset
        self.n = cfg.rollout.n_samples
        self.batch_groups = cfg.rollout.batch_groups
        self.dynamic_sampling = cfg.rollout.dynamic_sampling
        self.stale_policy = cfg.async_.stale_policy
        self.max_requeues = cfg.async_.max_requeues
        self.auto_eta = cfg.async_.max_staleness == "auto"
        self.auto_over_provision = cfg.rollout.over_provision == "auto"
        self.over_provision = cfg.initial_over_provision
        """Over-provisioning now: fixed, or moved by the controller (`set_over_provision`)."""
        self.max_staleness = cfg.async_.initial_staleness
        """eta now: fixed, or moved by the controller (`async.max_staleness: auto`, `set_max_staleness`)."""
        self.controller = StalenessController(self.batch_groups, self.max_staleness, self.over_provision)
        self.group_eta: dict[int, int] = {}
        """eta each untrained group was admitted under: after eta is lowered it keeps that bound, so
        no admitted group becomes too stale to train (async_april/rollout/auto_staleness.py)."""
        self.version = 0
        self.cursor = 0
        self.open_groups: dict[int, Group] = {}
        """Started, not complete: every sample is fresh, leased, partial or done."""
        self.fresh: deque[tuple[int, int]] = deque()
        """(prompt_index, sample_index) never generated yet, oldest group first."""
        self.partials: dict[str, Sample] = {}
        self.hold_until: dict[str, int] = {}
        """Partials aborted by an early stop wait for weights newer than this version."""
        self.leases: dict[str, dict[str, Sample]] = {}
        self.aborted_len: dict[str, int] = {}
        """Tokens a response had at its latest abort: all of them are resumed, then trained."""
        self.completed: deque[Group] = deque()
        self.trained: list[int] = []
        self.filtered: list[int] = []
        self.dropped: list[int] = []
        self.skipped: list[int] = []
        """Batched, but the learner skipped the step (non-finite loss/gradient): consumed, not trained."""
        self.requeues: dict[int, int] = {}
        """Times each prompt was regenerated for staleness (bounded by async.max_requeues)."""
        self.counters = _Counters()

    # -- work out ---------------------------------------------------------
    def lease(self, actor_id: str, max_items: int, engine_version: int) -> list[Sample]:
        """Up to `max_items` samples for `actor_id`, partials first, then fresh, then new groups."""
        out: list[Sample] = []
        self.counters.extra["store_calls"] += 1
        doomed = self._retire_stale_open_groups()
        for uid in sorted(self.partials, key=self._partial_order):
            if len(out) == max_items:
                break
            if self.hold_until.get(uid, -1) >= engine_version or self.partials[uid].prompt_index in doomed:
                continue  # held for newer weights, or of a group to regenerate once its last lease is back
            s = self.partials.pop(uid)
            self.hold_until.pop(uid, None)
            s.num_resumes += 1
            self.counters.partial_resumed += 1
            out.append(s)
        waiting: list[tuple[int, int]] = []  # fresh samples of a group past eta, kept for its requeue
        while len(out) < max_items:
            if not self.fresh and not self._start_group():
                break
            p, i = self.fresh.popleft()
            if p in doomed:
                waiting.append((p, i))
                continue
            out.append(self.open_groups[p].samples[i])
        self.fresh.extendleft(reversed(waiting))
        held = self.leases.setdefault(actor_id, {})
        for s in out:
            held[s.uid] = s
        return copy.deepcopy(out)

    def _partial_order(self, uid: str) -> tuple[int, int]:
        s = self.partials[uid]
        v = s.model_versions  # environment tokens carry no version of their own
        return (int(v.min()) if len(v) else self.version, s.prompt_index)

    def _start_group(self) -> bool:
        untrained = len(self.open_groups) + len(self.completed)
        c = self.counters
        admitted = c.started_groups - c.filtered_groups - c.dropped_groups - c.skipped_groups
        if self.controller.capacity(self.version, admitted, untrained) <= 0:
            return False
        p = self.cursor
        self.group_eta[p] = self.max_staleness
        self.open_groups[p] = self._new_group(p)
        self.fresh.extend((p, i) for i in range(self.n))
        self.cursor += 1
        self.counters.started_groups += 1
        return True

    def _new_group(self, p: int) -> Group:
        """The n samples of prompt `p` as never generated, built from its dataset row: never from an
        earlier attempt's samples, whose prompt ids an environment's reset may have extended."""
        row = self.dataset.row(p)
        return Group(prompt_index=p, samples=[Sample(prompt_index=p, sample_index=i, prompt_ids=row.prompt_ids,
                                                     answer=row.answer, extra=row.extra) for i in range(self.n)])

    # -- work back --------------------------------------------------------
    def push(self, actor_id: str, samples: list[Sample], early_stop: bool = False) -> None:
        """Finished samples (scored) or aborted partials from `actor_id`."""
        held = self.leases.setdefault(actor_id, {})
        self.counters.extra["store_calls"] += 1
        for s in samples:
            if held.pop(s.uid, None) is None:
                # A lease already returned to the pool (its actor was declared dead) or
                # trained: the store's copy wins, so nothing is counted twice.
                self.counters.extra["late_pushes_ignored"] += 1
                continue
            group = self.open_groups[s.prompt_index]
            group.samples[s.sample_index] = s
            if s.done:
                if group.done:
                    self._complete(group)
            else:
                self._to_partial(s, hold=self.version if early_stop else None)
        self._retire_stale_open_groups()

    def _to_partial(self, s: Sample, hold: int | None = None) -> None:
        if s.num_tokens == 0:
            self.fresh.appendleft((s.prompt_index, s.sample_index))
            return
        self.partials[s.uid] = s
        # Count each aborted token once, however often its response is interrupted.
        self.counters.aborted_tokens += s.num_tokens - self.aborted_len.get(s.uid, 0)
        self.aborted_len[s.uid] = s.num_tokens
        if hold is not None:
            self.hold_until[s.uid] = max(hold, int(s.versions.max()))

    def _complete(self, group: Group) -> None:
        del self.open_groups[group.prompt_index]
        rewards = group.rewards
        if self.dynamic_sampling and self.n > 1 and np.ptp(rewards) <= 1e-6:
            self.filtered.append(group.prompt_index)
            self.group_eta.pop(group.prompt_index, None)
            self.counters.filtered_groups += 1
            self._waste(group, "filtered")
            return
        self.completed.append(group)

    def release_actor(self, actor_id: str) -> int:
        """Return a dead actor's leases to the pool as the store last saw them."""
        held = self.leases.pop(actor_id, {})
        for s in held.values():
            self._to_partial(s)
        self.counters.actor_failures += 1
        self.counters.extra["samples_released"] += len(held)
        return len(held)

    def leased_by(self, actor_id: str) -> list[str]:
        """Sample uids `actor_id` holds right now (observability, fault drills)."""
        return sorted(self.leases.get(actor_id, {}))

    # -- batches ------------------------------------------------------------
    def try_get_batch(self) -> list[Group] | None:
        """B complete groups within the staleness bound, or None if not enough yet."""
        self._apply_stale_policy()
        if len(self.completed) < self.batch_groups or self._waiting_for_due_groups():
            return None
        # Earliest deadline (oldest token) first, completion order among equals: a group that
        # finished late because one of its responses was long is trained before it crosses eta,
        # instead of being overtaken by newer short groups and regenerated.
        chosen = {id(g) for g in sorted(self.completed, key=self._group_age_key)[: self.batch_groups]}  # stable sort
        batch = [g for g in self.completed if id(g) in chosen]
        self.completed = deque(g for g in self.completed if id(g) not in chosen)
        for g in batch:
            self.trained.append(g.prompt_index)
            self.group_eta.pop(g.prompt_index, None)
            self.counters.aborted_tokens_reused += sum(self.aborted_len.pop(s.uid, 0) for s in g.samples)
        self.counters.trained_groups += len(batch)
        return batch

    def _waiting_for_due_groups(self) -> bool:
        """Earliest deadline first, across unfinished groups too: while a started group is due exactly
        at this version (trained now, or past eta at the next) and can still finish, the batch waits
        for it instead of training newer complete groups, unless B due groups are complete already.
        Generation continues meanwhile (partials resume first, oldest first), so the wait is the
        group's remaining tail; regenerating it would cost its whole length again. A group already
        past eta is never waited for: it could not be trained, and is regenerated instead."""
        v = self.version
        if not any(self.controller.is_due(g.min_version(), v, self._eta(g)) and self._can_finish(g) for g in self.open_groups.values()):
            return False
        return sum(self.controller.is_due(g.min_version(), v, self._eta(g)) for g in self.completed) < self.batch_groups

    def _eta(self, g: Group) -> int:
        """The bound group `g` is held to: the eta it was admitted under, or today's if larger."""
        return max(self.group_eta.get(g.prompt_index, self.max_staleness), self.max_staleness)

    def _can_finish(self, g: Group) -> bool:
        """False while one of its partials is held for weights newer than the current version (an
        early stop's partial after a skipped learner step): waiting for it would wait forever."""
        return all(self.hold_until.get(s.uid, -1) < self.version for s in g.samples)

    def _group_age_key(self, g: Group) -> int:
        v = g.min_version()
        return v if v >= 0 else self.version

    def _apply_stale_policy(self) -> None:
        self._retire_stale_open_groups()
        keep: deque[Group] = deque()
        for g in self.completed:
            if self._past_eta(g):
                self._stale(g)
            else:
                keep.append(g)
        self.completed = keep

    def _past_eta(self, g: Group) -> bool:
        return self.controller.is_stale(g.min_version(), self.version, self._eta(g))

    def _retire_stale_open_groups(self) -> set[int]:
        """A started group whose oldest token is past eta can never be trained: finishing it only wastes
        generation (its partials would even be resumed first). Take it out now and apply the stale
        policy, once none of its responses is leased: an actor may still push one, and a fresh sample
        of the same uid must not be leased while the old one is in flight. Returns the prompts of the
        stale groups still waiting for a lease: `lease` hands out none of their work."""
        leased = {uid for held in self.leases.values() for uid in held}
        waiting: set[int] = set()
        for g in [g for g in self.open_groups.values() if self._past_eta(g)]:
            if any(s.uid in leased for s in g.samples):
                waiting.add(g.prompt_index)
                continue
            del self.open_groups[g.prompt_index]
            self.fresh = deque(x for x in self.fresh if x[0] != g.prompt_index)
            for s in g.samples:
                self.partials.pop(s.uid, None)
                self.hold_until.pop(s.uid, None)
            self._stale(g)
        return waiting

    def _stale(self, g: Group) -> None:
        """`async.stale_policy` for a group past eta (no longer open or completed)."""
        if self.stale_policy == "drop":
            self._drop(g)
        elif self.requeues.get(g.prompt_index, 0) >= self.max_requeues:
            self.counters.requeue_limit_groups += 1
            self._drop(g)
        else:
            self._requeue(g)

    def _drop(self, g: Group) -> None:
        self.dropped.append(g.prompt_index)
        self.group_eta.pop(g.prompt_index, None)
        self.counters.dropped_groups += 1
        self.counters.stale_tokens_discarded += sum(s.num_tokens for s in g.samples)
        self._waste(g, "stale")

    def _requeue(self, g: Group) -> None:
        """Regenerate a too-stale group from its dataset row, first in line, so hard prompts are not
        starved (at most async.max_requeues times per prompt, then it is dropped)."""
        self.counters.requeued_groups += 1
        self.requeues[g.prompt_index] = self.requeues.get(g.prompt_index, 0) + 1
        self.counters.stale_tokens_discarded += sum(s.num_tokens for s in g.samples)
        self._waste(g, "stale")
        self.open_groups[g.prompt_index] = self._new_group(g.prompt_index)
        self.fresh.extendleft((g.prompt_index, i) for i in reversed(range(self.n)))

    def _waste(self, g: Group, reason: str) -> None:
        """A group that will not be trained (filtered, dropped, requeued): its tokens are wasted, its
        aborted tokens discarded."""
        self.counters.wasted_tokens[reason] += sum(s.num_tokens for s in g.samples)
        self.counters.aborted_tokens_discarded += sum(self.aborted_len.pop(s.uid, 0) for s in g.samples)

    def mark_skipped(self, prompt_indices: list[int]) -> None:
        """The learner skipped the step that trained these prompts: move them from trained to
        skipped and give their admission slots back, so generation does not wait for a version
        that this batch will never produce."""
        for p in prompt_indices:
            self.trained.remove(p)
            self.skipped.append(p)
        self.counters.skipped_groups += len(prompt_indices)
        self.counters.trained_groups -= len(prompt_indices)

    def set_max_staleness(self, eta: int) -> None:
        """Change eta (auto-tuning). Admission follows at once: a higher eta opens it, a lower one
        closes it until the learner catches up. Groups admitted before keep the bound they were
        admitted under (`group_eta`), so lowering eta never strands one."""
        if eta < 0:
            raise ValueError(f"max_staleness must be >= 0, got {eta}")
        self.max_staleness = int(eta)
        self.controller = StalenessController(self.batch_groups, self.max_staleness, self.over_provision)

    def set_over_provision(self, ratio: float) -> None:
        """Change the cap on groups in flight (auto-tuning). Lowering it admits nothing new until the
        groups in flight drain below the new cap; none of them is affected."""
        self.over_provision = float(ratio)
        self.controller = StalenessController(self.batch_groups, self.max_staleness, self.over_provision)

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} -> {version}")
        self.version = version
        self._retire_stale_open_groups()

    # -- observability (async_april/rollout/store_report.py) -------------------
    def accounting(self) -> dict[str, list[int]]:
        """Every prompt index taken from the dataset, by state; each appears exactly once."""
        return store_report.accounting(self)

    def check_accounting(self) -> None:
        """Raise if any prompt is lost, duplicated or trained twice."""
        store_report.check_accounting(self)

    def metrics(self) -> dict[str, float]:
        return store_report.metrics(self)

    # -- checkpointing --------------------------------------------------------
    _NOT_SAVED = ("dataset", "controller", "dynamic_sampling", "stale_policy", "max_requeues", "n", "batch_groups",
                  "auto_eta", "auto_over_provision", "_changed")

    def state_dict(self) -> dict:
        """Everything needed to continue. Leased samples are saved as the store last saw
        them, as partials (or fresh), since their actors will not exist after a restart."""
        state = copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in self._NOT_SAVED})
        partials, fresh = state["partials"], state["fresh"]
        for held in state.pop("leases").values():
            for s in held.values():
                if s.num_tokens:
                    partials[s.uid] = s
                else:
                    fresh.appendleft((s.prompt_index, s.sample_index))
        state["leases"] = {}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()`'s output; ValueError naming the entry for anything else (a checkpoint
        edited by hand would otherwise set any attribute to anything: async_april/run/checkpoints.py)."""
        unknown = sorted(str(k) for k in state if k not in self.__dict__ or k in self._NOT_SAVED)
        if unknown:
            raise ValueError(f"the store state holds entries a store does not have: {', '.join(unknown[:5])}")
        for k, v in state.items():  # one saved by an older version may lack newer entries: they keep their defaults
            want = type(self.__dict__[k])
            number = isinstance(v, (int, float)) and want in (int, float) and not isinstance(v, bool)
            if not (isinstance(v, want) or number):
                raise ValueError(f"the store state's {k!r} is a {type(v).__name__}, not a {want.__name__}")
        configured = self.max_staleness, self.over_provision
        self.__dict__.update(copy.deepcopy(state))
        # Tuned settings continue from the checkpoint; fixed ones are the config's (it may have been changed).
        self.over_provision = self.over_provision if self.auto_over_provision else configured[1]
        self.set_max_staleness(self.max_staleness if self.auto_eta else configured[0])
