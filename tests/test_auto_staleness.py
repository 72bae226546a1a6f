"""The auto-eta controller on scripted metric sequences, and admission exact through each change."""

import pytest

from async_april.auto_staleness import AutoEta, StepSignals
from async_april.staleness import StalenessController


def sig(ess=0.95, k3=0.001, wait=0.5):
    return StepSignals(ess=ess, k3=k3, wait_frac=wait)


def run(tuner, eta, script):
    etas, streak = [], 0
    for s in script:
        eta, streak, _ = tuner.decide(eta, streak, s)
        etas.append(eta)
    return etas


def test_raises_while_the_budget_holds_and_generation_is_the_bottleneck_then_lowers_when_broken():
    tuner = AutoEta(low=0, high=3, min_ess=0.9, raise_wait_frac=0.2, raise_after=2)
    script = [
        sig(), sig(),                # budget holds, learner waits half the step: raise after 2 steps
        sig(), sig(),                # again
        sig(wait=0.05), sig(),       # the learner barely waited: the streak restarts
        sig(),                       # second bottlenecked step in a row -> 3 = high
        sig(), sig(), sig(),         # at the upper bound: hold
        sig(ess=0.8),                # budget broken: lower at once
        sig(ess=0.7),                # still broken: lower again
        sig(ess=0.5), sig(ess=0.5),  # at the lower bound... not yet: 1 -> 0, then hold at 0
        sig(),                       # holds again: first bottlenecked step
    ]
    assert run(tuner, 0, script) == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 2, 1, 0, 0, 0]


def test_k3_budget_and_missing_signal():
    tuner = AutoEta(low=1, high=4, min_ess=None, max_k3=0.01, raise_wait_frac=0.1, raise_after=1)
    assert run(tuner, 1, [sig(k3=0.005), sig(k3=0.02), sig(k3=0.009, wait=0.0)]) == [2, 1, 1]
    # Without a measurement the controller never raises (it cannot know the budget holds).
    assert run(tuner, 2, [StepSignals(ess=0.99, k3=None, wait_frac=0.9)] * 3) == [2, 2, 2]


def test_signals_from_step_metrics():
    s = StepSignals.from_metrics({"mismatch/ess": 0.93, "mismatch/k3": 0.002, "timing_s/rollout": 0.5, "timing_s/step": 2.0})
    assert (s.ess, s.k3, s.wait_frac) == (0.93, 0.002, 0.25)
    assert StepSignals.from_metrics({}).wait_frac == 0.0


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="budget"):
        AutoEta(low=0, high=2, min_ess=None, max_k3=None)
    with pytest.raises(ValueError, match="low"):
        AutoEta(low=3, high=2)


def test_scripted_run_never_admits_past_the_current_eta():
    """Admission under a changing eta (the store's arithmetic): every group admitted while eta = e at
    version v is within the first (e + v + 1) batches, so it is trained by version v + e."""
    B = 4
    tuner = AutoEta(low=0, high=3, min_ess=0.9, raise_wait_frac=0.1, raise_after=1)
    script = [sig()] * 4 + [sig(ess=0.5)] * 3 + [sig()] * 3 + [sig(ess=0.5)] * 4
    eta, streak, version, admitted = 0, 0, 0, 0
    deadline: dict[int, int] = {}  # group index -> last version it may be trained at
    trained = 0
    seen_etas = []
    for s in script:
        ctl = StalenessController(B, eta, over_provision=100)
        while ctl.capacity(version, admitted, admitted - trained) > 0:
            assert admitted < (eta + version + 1) * B  # never past the current eta
            deadline[admitted] = version + eta
            admitted += 1
        for g in range(trained, trained + B):  # the learner trains the oldest B groups at `version`
            assert version <= deadline[g], (g, version, deadline[g])
        trained += B
        version += 1
        eta, streak, _ = tuner.decide(eta, streak, s)
        seen_etas.append(eta)
    assert max(seen_etas) == 3 and seen_etas[-1] == 0  # it did raise to the top and lower to the bottom


# ----------------------------------------------------------------------------- the store through eta changes

from tests.test_store import finish, make_store  # noqa: E402


def test_lowering_eta_strands_no_admitted_group_and_closes_admission():
    """Six groups admitted at eta 2 (B = 2), all sampled at version 0. eta drops to 0 at version 1:
    groups 4 and 5 are then 2 versions old when their turn comes, too stale for the new eta, but
    within the bound they were admitted under: they are trained, not requeued or dropped, and no
    new group starts until the learner has caught up with the new eta."""
    st = make_store(**{"async.max_staleness": "auto", "async.auto.min": 0, "async.auto.max": 2, "rollout.over_provision": 64})
    st.set_max_staleness(2)
    work = st.lease("a", 100, 0)
    assert len(work) == 12  # (eta + v + 1) * B = 6 groups of n = 2
    st.push("a", [finish(s, version=0) for s in work])
    assert [g.prompt_index for g in st.try_get_batch()] == [0, 1]
    st.set_version(1)
    st.set_max_staleness(0)
    assert st.metrics()["async/eta"] == 0
    assert st.lease("a", 100, 1) == []  # admitted 6 > (0 + 1 + 1) * 2: closed
    assert [g.prompt_index for g in st.try_get_batch()] == [2, 3]
    st.set_version(2)
    assert st.lease("a", 100, 2) == []  # 6 == (0 + 2 + 1) * 2: still closed
    assert [g.prompt_index for g in st.try_get_batch()] == [4, 5]  # lag 2 > eta 0, trained all the same
    assert st.counters.requeued_groups == 0 and st.counters.dropped_groups == 0
    st.set_version(3)
    new = st.lease("a", 100, 3)
    assert {s.prompt_index for s in new} == {6, 7}  # (0 + 3 + 1) * 2 = 8: one batch, synchronous again
    st.check_accounting()
    # Groups admitted under the new eta are held to it.
    st.push("a", [finish(s, version=3) for s in new])
    st.set_version(4)
    assert st.try_get_batch() is None and st.counters.requeued_groups == 2


def test_raising_eta_opens_admission_at_once_and_the_tuned_eta_survives_a_checkpoint():
    st = make_store(**{"async.max_staleness": "auto", "async.auto.max": 3, "rollout.over_provision": 64})
    assert st.max_staleness == 0 and len(st.lease("a", 100, 0)) == 4
    st.set_max_staleness(3)
    assert len(st.lease("a", 100, 0)) == 12  # (3 + 0 + 1) * 2 groups admitted in all
    state = st.state_dict()
    again = make_store(**{"async.max_staleness": "auto", "async.auto.max": 3, "rollout.over_provision": 64})
    again.load_state_dict(state)
    assert again.max_staleness == 3 and again.controller.max_staleness == 3
    fixed = make_store(**{"async.max_staleness": 1})
    fixed.load_state_dict(state)
    assert fixed.max_staleness == 1  # a fixed eta is the config's, whatever the checkpoint held
