"""Mismatch metrics against values worked out by hand, and exact across micro-batch splits."""

import math

import pytest
import torch

from async_april.algorithms.losses import merge_metrics
from async_april.algorithms.mismatch import finalize_mismatch, mismatch_metrics

F64 = torch.float64
LN2 = math.log(2.0)


def hand_batch():
    """d = log pi_theta - log pi_behav: row 0 [0, ln2, -ln2] at lags [0, 1, 1]; row 1 [ln2, 0] at lags
    [0, 2] (then padding). Token weights w = e^d = [1, 2, 1/2, 2, 1]."""
    behav = torch.tensor([[-1.0, -1.5, -0.7], [-2.0, -0.3, 0.0]], dtype=F64)
    d = torch.tensor([[0.0, LN2, -LN2], [LN2, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    lags = torch.tensor([[0, 1, 1], [0, 2, 0]])
    bounded = torch.tensor([[False, True, False], [True, False, False]])
    rejected = torch.tensor([[False, False, False], [True, False, False]])
    return behav + d, behav, mask, lags, bounded, rejected


def finalize_one(*args, **kw):
    raw = {k: float(v) for k, v in mismatch_metrics(*args, **kw).items()}
    return finalize_mismatch(raw)


def test_kl_and_ess_equal_hand_computed_values():
    lp, behav, mask, lags, bounded, rejected = hand_batch()
    out = finalize_one(lp, behav, mask, lags, 2, bounded, rejected)
    # k1 = -d = [0, -ln2, ln2, -ln2, 0]; k3 = e^d - d - 1 = [0, 1 - ln2, ln2 - 1/2, 1 - ln2, 0]
    assert out["mismatch/k1"] == pytest.approx(-LN2 / 5, rel=1e-12)
    assert out["mismatch/k3"] == pytest.approx((1.5 - LN2) / 5, rel=1e-12)
    # ESS = (sum w)^2 / (N sum w^2) = 6.5^2 / (5 * 10.25)
    assert out["mismatch/ess"] == pytest.approx(6.5**2 / (5 * 10.25), rel=1e-12)
    # by lag: 0 -> tokens d = 0, ln2; 1 -> ln2, -ln2; 2 -> 0
    assert out["mismatch/token_frac_lag0"] == pytest.approx(0.4)
    assert out["mismatch/k1_lag0"] == pytest.approx(-LN2 / 2, rel=1e-12)
    assert out["mismatch/k3_lag0"] == pytest.approx((1 - LN2) / 2, rel=1e-12)
    assert out["mismatch/k1_lag1"] == pytest.approx(0.0, abs=1e-15)
    assert out["mismatch/k3_lag1"] == pytest.approx(0.25, rel=1e-12)  # (1 - ln2 + ln2 - 1/2) / 2
    assert out["mismatch/token_frac_lag2"] == pytest.approx(0.2)
    assert out["mismatch/k3_lag2"] == pytest.approx(0.0, abs=1e-15)
    # lag 0 alone: w = [1, 2] -> ESS 9 / (2 * 5); one of its two tokens bounded, one rejected
    assert out["mismatch/ess_lag0"] == pytest.approx(0.9, rel=1e-12)
    assert out["mismatch/bounded_frac_lag0"] == pytest.approx(0.5)
    assert out["mismatch/rejected_frac_lag0"] == pytest.approx(0.5)
    assert not any(k.startswith("_mm/") for k in out)


def test_lags_beyond_max_lag_fold_into_the_last_bucket_and_empty_lags_have_no_kl():
    lp, behav, mask, lags, _, _ = hand_batch()
    out = finalize_one(lp, behav, mask, lags, 1)
    assert out["mismatch/token_frac_lag1"] == pytest.approx(0.6)
    assert out["mismatch/k3_lag1"] == pytest.approx(0.5 / 3, rel=1e-12)
    out = finalize_one(lp, behav, mask, torch.ones_like(lags), 3)  # every token at lag 1
    assert out["mismatch/token_frac_lag0"] == 0.0 and "mismatch/k1_lag0" not in out and "mismatch/ess_lag0" not in out
    assert out["mismatch/token_frac_lag3"] == 0.0 and "mismatch/k3_lag3" not in out
    assert "mismatch/bounded_frac_lag0" not in out  # no masks given


def test_on_policy_tokens_read_zero_kl_and_full_ess():
    _, behav, mask, lags, _, _ = hand_batch()
    out = finalize_one(behav.clone(), behav, mask, lags, 2)
    assert out["mismatch/k1"] == 0.0 and out["mismatch/k3"] == 0.0
    assert out["mismatch/ess"] == pytest.approx(1.0) and out["mismatch/ess_lag0"] == pytest.approx(1.0)


def test_split_into_micro_batches_gives_the_same_step_values():
    """Each row alone, combined by the _tokens-weighted mean the learner uses, then finalised."""
    lp, behav, mask, lags, bounded, rejected = hand_batch()
    whole = finalize_one(lp, behav, mask, lags, 2, bounded, rejected)
    parts = []
    for r in (0, 1):
        part = mismatch_metrics(lp[r:r + 1], behav[r:r + 1], mask[r:r + 1], lags[r:r + 1], 2, bounded[r:r + 1], rejected[r:r + 1])
        part["_tokens"] = mask[r].sum().to(F64)
        parts.append(part)
    merged = finalize_mismatch({k: float(v) for k, v in merge_metrics(parts).items()})
    for key, value in whole.items():
        assert merged[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key


def test_a_lag_seen_only_in_a_later_mini_batch_is_still_reported():
    """mean_over_mini_batches takes every key of every mini-batch: a lag whose tokens all fell in the
    second mini-batch has KL keys there only (was: the keys of the first mini-batch alone)."""
    from learners.update import mean_over_mini_batches

    out = mean_over_mini_batches([{"mismatch/k1": 0.1}, {"mismatch/k1": 0.3, "mismatch/k1_lag2": 0.5}])
    assert out == {"mismatch/k1": pytest.approx(0.2), "mismatch/k1_lag2": 0.5}
