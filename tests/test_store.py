"""RolloutStore as plain Python: work order, admission, partials, filtering, accounting, save/load."""

import random

import numpy as np
import pytest

from async_april.config import load_config
from async_april.data import PromptDataset, PromptRow
from async_april.rollout.store import RolloutStore


def make_store(**over):
    args = [f"{k}={v}" for k, v in over.items()]
    cfg = load_config(None, ["rollout.batch_groups=2", "rollout.n_samples=2", *args])
    rows = [PromptRow(prompt=str(i), answer=str(i), prompt_ids=np.array([1, 2 + i % 7])) for i in range(50)]
    return RolloutStore(cfg, PromptDataset(rows=rows, seed=0))


def finish(s, n_tokens=3, version=0, reward=None):
    s.extend(np.arange(n_tokens), -np.ones(n_tokens), np.full(n_tokens, version), "stop")
    s.reward = float(s.sample_index) if reward is None else reward
    return s


def abort(s, n_tokens=2, version=0):
    s.extend(np.arange(n_tokens), -np.ones(n_tokens), np.full(n_tokens, version), "abort")
    return s


def test_sync_admission_one_batch_per_version():
    st = make_store()
    work = st.lease("a", 100, engine_version=0)
    assert len(work) == 4  # B=2 groups x n=2, nothing more at eta=0
    st.push("a", [finish(s) for s in work])
    assert st.lease("a", 100, 0) == []
    batch = st.try_get_batch()
    assert [g.prompt_index for g in batch] == [0, 1]
    assert st.lease("a", 100, 0) == []  # learner has not produced version 1 yet
    st.set_version(1)
    assert len(st.lease("a", 100, 1)) == 4
    st.check_accounting()


def test_partials_resume_first_oldest_first():
    st = make_store(**{"async.max_staleness": 2, "rollout.over_provision": 3})
    work = st.lease("a", 4, 0)
    st.set_version(1)
    st.push("a", [abort(work[3], version=1)])
    st.push("a", [abort(work[1], version=0)])
    nxt = st.lease("c", 3, 1)
    assert [s.uid for s in nxt[:2]] == [work[1].uid, work[3].uid]  # oldest tokens first
    assert nxt[2].prompt_index == 2  # then new work
    assert nxt[0].num_resumes == 1 and nxt[0].num_tokens == 2
    assert st.counters.partial_resumed == 2


def test_early_stop_partials_wait_for_new_weights():
    st = make_store(**{"async.max_staleness": 1, "rollout.over_provision": 2})
    work = st.lease("a", 100, 0)
    assert len(work) == 8  # over-provisioned: 2x the batch
    st.push("a", [finish(s) for s in work[:4]])
    st.push("a", [abort(s) for s in work[4:]], early_stop=True)
    assert st.try_get_batch() is not None
    assert st.lease("a", 100, 0) == []  # same weights: hold
    st.set_version(1)
    resumed = st.lease("a", 100, 1)
    assert {s.uid for s in resumed[:4]} == {s.uid for s in work[4:]}


def test_no_aborted_token_is_lost():
    st = make_store(**{"async.max_staleness": 1, "rollout.over_provision": 2})
    work = st.lease("a", 100, 0)
    st.push("a", [finish(s) for s in work[:4]])
    st.push("a", [abort(s, n_tokens=5) for s in work[4:]], early_stop=True)
    st.try_get_batch()
    st.set_version(1)
    resumed = st.lease("a", 4, 1)
    st.push("a", [finish(s, n_tokens=1, version=1) for s in resumed])
    assert st.try_get_batch() is not None
    assert st.counters.aborted_tokens == 20
    assert st.counters.aborted_tokens_reused == 20


def test_dynamic_sampling_filters_and_replaces():
    st = make_store(**{"rollout.dynamic_sampling": "true"})
    work = st.lease("a", 100, 0)
    st.push("a", [finish(s, reward=1.0) for s in work[:2]])  # group 0: zero variance
    st.push("a", [finish(s) for s in work[2:]])
    assert st.counters.filtered_groups == 1
    repl = st.lease("a", 100, 0)
    assert {s.prompt_index for s in repl} == {2}  # the filtered slot was given back
    st.check_accounting()


def test_dead_actor_leases_return_to_the_pool():
    st = make_store()
    work = st.lease("a", 100, 0)
    st.push("a", [finish(work[0])])
    assert st.release_actor("a") == 3
    again = st.lease("b", 100, 0)
    assert sorted(s.uid for s in again) == sorted(s.uid for s in work[1:])
    st.push("a", [finish(work[1])])  # a late push from the dead actor is ignored
    assert st.counters.extra["late_pushes_ignored"] == 1
    st.check_accounting()


@pytest.mark.parametrize("policy", ["requeue", "drop"])
def test_stale_groups_follow_policy(policy):
    st = make_store(**{"async.max_staleness": 0, "async.stale_policy": policy, "rollout.over_provision": 1})
    work = st.lease("a", 100, 0)
    st.push("a", [finish(s, version=0) for s in work])
    st.set_version(1)  # pretend the learner moved on without this batch
    assert st.try_get_batch() is None
    if policy == "drop":
        assert st.counters.dropped_groups == 2
    else:
        assert st.counters.requeued_groups == 2 and len(st.fresh) == 4
    st.check_accounting()


def test_random_schedule_keeps_accounting_and_staleness():
    """Random leases / finishes / aborts / deaths / batches: every prompt in exactly one state, eta held."""
    rng = random.Random(0)
    eta = 2
    st = make_store(**{"async.max_staleness": eta, "rollout.over_provision": 3, "rollout.dynamic_sampling": "true"})
    held = {"a": [], "b": []}
    version = 0
    trained = []
    for _ in range(600):
        actor = rng.choice("ab")
        op = rng.random()
        if op < 0.35:
            held[actor] += st.lease(actor, rng.randint(1, 4), version)
        elif op < 0.75 and held[actor]:
            s = held[actor].pop(rng.randrange(len(held[actor])))
            if rng.random() < 0.7:
                st.push(actor, [finish(s, n_tokens=1, version=version, reward=rng.choice([0.0, 1.0]))])
            else:
                st.push(actor, [abort(s, n_tokens=1, version=version)], early_stop=rng.random() < 0.5)
        elif op < 0.8:
            st.release_actor(actor)
            held[actor] = []
        else:
            batch = st.try_get_batch()
            if batch:
                lag = max(version - int(s.versions.min()) for g in batch for s in g.samples)
                assert lag <= eta
                trained += [g.prompt_index for g in batch]
                version += 1
                st.set_version(version)
        st.check_accounting()
        c = st.counters  # no aborted token vanishes: trained, still waiting, or counted as discarded
        assert c.aborted_tokens == c.aborted_tokens_reused + sum(st.aborted_len.values()) + c.aborted_tokens_discarded
    assert len(trained) == len(set(trained)) > 4
    assert st.counters.aborted_tokens_reused > 0


def test_state_dict_round_trip_folds_leases_back():
    st = make_store(**{"async.max_staleness": 1})
    work = st.lease("a", 3, 0)
    st.push("a", [abort(work[0])])
    held = st.lease("a", 2, 0)
    held[1].extend(np.arange(4), -np.ones(4), np.zeros(4), "abort")  # actor-side progress, never pushed
    state = st.state_dict()
    fresh = make_store(**{"async.max_staleness": 1})
    fresh.load_state_dict(state)
    fresh.check_accounting()
    assert fresh.leases == {} and fresh.cursor == st.cursor
    assert work[0].uid in fresh.partials
    got = fresh.lease("z", 100, 0)
    assert {s.uid for s in held} <= {s.uid for s in got}


def test_batches_take_the_oldest_groups_first():
    """A group that finished late (one long response) is trained before newer groups overtake it
    past eta: batches take the oldest tokens first, completion order among equals."""
    st = make_store(**{"async.max_staleness": 2, "rollout.over_provision": 3})
    work = st.lease("a", 12, 0)  # groups 0..5, two samples each
    by_group = {}
    for s in work:
        by_group.setdefault(s.prompt_index, []).append(s)
    st.set_version(2)
    # Groups 1, 2 and 4 complete first with tokens of version 2; group 0 last, its tokens of version 0.
    for p, v in [(1, 2), (2, 2), (4, 2), (0, 0), (3, 1)]:
        st.push("a", [finish(s, version=v) for s in by_group[p]])
    first = st.try_get_batch()
    assert [g.prompt_index for g in first] == [0, 3]  # oldest first: versions 0 and 1, not completion order
    second = st.try_get_batch()
    assert [g.prompt_index for g in second] == [1, 2]  # equals keep completion order
    assert st.counters.requeued_groups == 0
    st.check_accounting()


def test_a_due_group_is_waited_for_not_overtaken():
    """Regression (waste): batches were made of the oldest COMPLETE groups, so a long group admitted
    early was overtaken by newer short ones until its oldest token passed eta, then regenerated from
    scratch (the async preset threw away 9.8% of its tokens). Now a started group due at this
    version is waited for; it joins the batch once its last response finishes."""
    st = make_store(**{"async.max_staleness": 1, "rollout.over_provision": 3})
    work = st.lease("a", 6, 0)  # groups 0, 1, 2
    g = {(s.prompt_index, s.sample_index): s for s in work}
    st.push("a", [finish(g[0, 0], version=0), abort(g[0, 1], version=0)])  # group 0: one long response, cut
    st.set_version(1)  # group 0's oldest token is version 0: with eta 1 it must be trained now
    st.push("a", [finish(g[p, i], version=1) for p in (1, 2) for i in (0, 1)])
    assert st.try_get_batch() is None, "a due group was overtaken by newer complete groups"
    (resumed,) = st.lease("a", 1, 1)
    assert resumed.uid == g[0, 1].uid
    resumed.extend(np.arange(2), -np.ones(2), np.full(2, 1), "stop")
    resumed.reward = 1.0
    st.push("a", [resumed])
    assert sorted(grp.prompt_index for grp in st.try_get_batch()) == [0, 1]  # earliest deadline first
    assert st.counters.requeued_groups == 0 and st.metrics()["rollout/wasted_tokens"] == 0
    st.check_accounting()


def test_no_prompt_is_requeued_more_than_max_requeues():
    """A prompt whose responses always outlast eta was regenerated forever; now at most
    async.max_requeues times, then dropped with its reason counted, its tokens counted as wasted."""
    st = make_store(**{"async.max_staleness": 0, "rollout.over_provision": 1, "async.max_requeues": 2})
    requeued_tokens = 0
    for version in range(1, 5):  # each round the learner has moved on before the groups complete
        work = [s for s in st.lease("a", 100, version - 1) if s.prompt_index in (0, 1)]
        assert len(work) == 4
        st.push("a", [finish(s, n_tokens=3, version=version - 1) for s in work])
        st.set_version(version)
        assert st.try_get_batch() is None
        assert max(st.requeues.values()) <= 2
        requeued_tokens += 12
        if version > 2:
            break
    m = st.metrics()
    assert st.requeues == {0: 2, 1: 2} and m["rollout/groups_requeued_stale"] == 4
    assert m["rollout/groups_dropped_requeue_limit"] == 2 and st.dropped == [0, 1]
    assert m["rollout/wasted_tokens/stale"] == m["rollout/wasted_tokens"] == requeued_tokens == 36
    st.check_accounting()


def test_a_requeued_multi_turn_group_starts_again_from_the_dataset_row():
    """Regression (issue 26.1): a stale group was regenerated from its samples' `prompt_ids`, which an
    environment's reset (or an agent loop's ctx.observe before the first turn) had already extended;
    the next reset extended them again, one more copy per requeue. A requeued sample is the
    dataset row's, as new: prompt ids, answer, extra, no episode state."""
    st = make_store(**{"async.max_staleness": 0, "rollout.over_provision": 1})
    work = st.lease("a", 100, engine_version=0)
    for s in work:  # what the turn loop leaves after reset: the prompt extended, the episode's state
        s.prompt_ids = np.concatenate([s.prompt_ids, [7, 8, 9]])
        s.env_state, s.turns, s.env_reward = {"turn": 1}, 1, 0.5
    st.push("a", [finish(s, version=0) for s in work])
    st.set_version(1)  # the learner moved on without these groups: stale, requeued
    assert st.try_get_batch() is None and st.counters.requeued_groups == 2
    again = st.lease("a", 100, engine_version=1)
    assert {s.uid for s in again} == {s.uid for s in work}
    for s in again:
        want = st.dataset.row(s.prompt_index)
        assert s.prompt_ids.tolist() == want.prompt_ids.tolist(), "the requeued prompt kept an earlier episode's extension"
        assert (s.answer, s.extra, s.env_state, s.turns, s.env_reward, s.num_tokens) == (want.answer, want.extra, None, 0, 0.0, 0)
    st.check_accounting()


def test_a_group_already_past_eta_is_not_waited_for_and_is_requeued_at_once():
    """Regression (issue 26.4): earliest-deadline-first batching waited for every started group whose
    deadline had come, stale ones included, so B trainable groups sat ready while the batch waited
    for a group that would be requeued the moment it completed, and its partial was resumed first.
    Only a group due exactly now is waited for; a stale open group is requeued at once."""
    st = make_store(**{"async.max_staleness": 1, "rollout.over_provision": 3})
    work = st.lease("a", 6, 0)  # groups 0, 1, 2
    g = {(s.prompt_index, s.sample_index): s for s in work}
    st.push("a", [finish(g[0, 0], version=0), abort(g[0, 1], version=0)])  # group 0: oldest token version 0, cut
    st.set_version(2)  # version 0 + eta 1 < 2: group 0 can no longer be trained
    st.push("a", [finish(g[p, i], version=2) for p in (1, 2) for i in (0, 1)])
    batch = st.try_get_batch()
    assert batch is not None, "the batch waited for a group already past eta"
    assert sorted(grp.prompt_index for grp in batch) == [1, 2]
    assert st.counters.requeued_groups == 1 and not st.partials  # group 0 is regenerated, not resumed
    nxt = st.lease("a", 2, 2)
    assert [(s.uid, s.num_tokens, s.num_resumes) for s in nxt] == [(g[0, 0].uid, 0, 0), (g[0, 1].uid, 0, 0)]
    assert st.counters.partial_resumed == 0 and st.metrics()["rollout/wasted_tokens/stale"] == 5
    st.check_accounting()


def test_a_stale_group_with_a_response_in_flight_is_requeued_when_it_returns():
    """A stale open group whose response is still leased is not handed out further (its partial is
    not resumed) and is requeued as soon as that response comes back; the late result is not trained."""
    st = make_store(**{"async.max_staleness": 1, "rollout.over_provision": 3})
    work = st.lease("a", 6, 0)
    g = {(s.prompt_index, s.sample_index): s for s in work}
    st.push("a", [abort(g[0, 0], version=0)])  # group 0: a partial of version 0; (0, 1) still in flight
    st.set_version(2)
    assert [s.uid for s in st.lease("b", 1, 2)] != [g[0, 0].uid], "a stale group's partial was resumed"
    assert st.counters.requeued_groups == 0  # (0, 1) is still leased by "a"
    st.push("a", [finish(g[0, 1], version=0)])
    assert st.counters.requeued_groups == 1 and not st.partials
    st.check_accounting()
