"""StalenessController: pure admission arithmetic, with a fake version source."""

import pytest

from async_april.rollout.staleness import StalenessController


def test_eta_zero_is_synchronous():
    c = StalenessController(batch_groups=4, max_staleness=0)
    assert c.capacity(version=0, admitted=0, untrained=0) == 4
    assert c.capacity(version=0, admitted=4, untrained=0) == 0  # batch 0 done, learner not yet
    assert c.capacity(version=1, admitted=4, untrained=0) == 4


def test_eta_lets_generation_run_ahead_by_eta_batches():
    c = StalenessController(batch_groups=4, max_staleness=2, over_provision=100)
    assert c.capacity(0, 0, 0) == 12
    assert c.capacity(0, 12, 3) == 0
    assert c.capacity(3, 12, 3) == 12


def test_over_provision_launches_that_many_groups_per_batch():
    c = StalenessController(batch_groups=4, max_staleness=4, over_provision=2.0)
    assert c.max_groups_in_flight == 8
    assert c.capacity(0, 0, 0) == 8
    assert c.capacity(0, 8, 8) == 0  # 4 complete and waiting + 4 running: no refill within the round
    assert c.capacity(1, 8, 4) == 4  # batch taken: 4 leftovers + 4 new = 8 launched for step 1


def test_is_stale():
    c = StalenessController(batch_groups=1, max_staleness=2)
    assert not c.is_stale(3, 5)
    assert c.is_stale(2, 5)
    assert not c.is_stale(-1, 5)  # no tokens


def test_bad_settings_raise():
    with pytest.raises(ValueError):
        StalenessController(batch_groups=0, max_staleness=0)
