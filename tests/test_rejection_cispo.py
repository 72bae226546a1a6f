"""Rejection sampling and CISPO as pure functions, against plain-loop references in float64.

The references walk sequences and tokens with Python loops and `math`; they
share no code with `async_april.algorithms`.
"""

import math

import pytest
import torch

from async_april.algorithms.cispo import cispo_objective
from async_april.algorithms.rejection import DIVERGENCES, REJECT_LEVELS, rejection_keep

F64 = torch.float64


def stale_batch(seed=0):
    """Four right-padded sequences (lengths 6, 4, 5, 2) whose target / behaviour log-ratios span
    both signs and reach |d| > 1, so every divergence is large somewhere and small elsewhere."""
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    target = -2.0 * torch.rand(B, T, generator=g, dtype=F64) - 0.05
    behav = target + 0.5 * torch.randn(B, T, generator=g, dtype=F64)
    behav[0, 2] = target[0, 2] + 1.7  # pi_target << pi_behav: k1 = +1.7
    behav[2, 1] = target[2, 1] - 1.4  # pi_target >> pi_behav: k1 = -1.4, k3 large
    behav[1, :4] = target[1, :4] + 0.3 + 0.1 * torch.randn(4, generator=g, dtype=F64)  # drifted: mean k1 ~ 0.3
    behav[3, :2] = target[3, :2] - 0.01  # a nearly on-policy short sequence
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0], [1] * 2 + [0] * 4], dtype=torch.bool)
    target[~mask], behav[~mask] = float("nan"), 0.0  # padding must be ignored whatever it holds
    adv = torch.tensor([0.5, -1.0, -0.3, 0.8], dtype=F64)
    return target, behav, mask, adv


def ref_stats(target, behav, mask, divergence, level):
    """{(b, t): statistic} for real tokens, by loops."""
    out = {}
    for b in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if mask[b, t]]
        per = {}
        for t in toks:
            d = max(-20.0, min(20.0, float(target[b, t]) - float(behav[b, t])))
            per[t] = {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1.0}[divergence]
        if level == "token":
            out.update({(b, t): v for t, v in per.items()})
            continue
        vals = list(per.values())
        seq = {"sequence_sum": sum(vals), "sequence_mean": sum(vals) / len(vals), "sequence_max": max(vals)}[level]
        out.update({(b, t): seq for t in toks})
    return out


def ref_keep(stats, low, high, adv=None):
    keep = {}
    for (b, t), v in stats.items():
        ok = (low is None or v >= low) and (high is None or v <= high)
        keep[(b, t)] = ok or (adv is not None and float(adv[b]) >= 0)
    return keep


@pytest.mark.parametrize("level", REJECT_LEVELS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("bounds", ["upper", "lower", "both"])
def test_rejection_equals_the_loop_reference(divergence, level, bounds):
    target, behav, mask, _ = stale_batch()
    stats = ref_stats(target, behav, mask, divergence, level)
    values = sorted(set(stats.values()))
    # Bounds picked from the data, halfway between two values (sums in another order may differ
    # in the last bit), so each case keeps some tokens and rejects others.
    mid = lambda i: 0.5 * (values[i] + values[i + 1])  # noqa: E731
    low = mid(len(values) // 4) if bounds in ("lower", "both") else None
    high = mid((3 * len(values)) // 4 - 1) if bounds in ("upper", "both") else None
    keep = rejection_keep(target, behav, mask, divergence, level, low, high)
    want = ref_keep(stats, low, high)
    assert keep.dtype == torch.bool and not keep[~mask].any()
    assert {(b, t): bool(keep[b, t]) for (b, t) in want} == want
    assert 0 < sum(want.values()) < len(want)  # both branches reached
    if level != "token":  # a sequence statistic keeps or drops whole sequences
        for b in range(mask.shape[0]):
            assert len({want[(bb, t)] for (bb, t) in want if bb == b}) == 1


def test_bounds_are_inclusive():
    target, behav, mask, _ = stale_batch()
    k1 = float(behav[0, 2] - target[0, 2])
    assert bool(rejection_keep(target, behav, mask, "k1", "token", None, k1)[0, 2])
    assert not bool(rejection_keep(target, behav, mask, "k1", "token", None, k1 - 1e-9)[0, 2])
    assert bool(rejection_keep(target, behav, mask, "k1", "token", k1, None)[0, 2])


def test_sequence_aggregations_differ_on_the_same_data():
    """sum, mean and max rank sequences differently: the level is not a no-op."""
    target, behav, mask, _ = stale_batch()
    kept = {lvl: rejection_keep(target, behav, mask, "k3", lvl, None, 0.3).any(dim=-1).tolist() for lvl in REJECT_LEVELS[1:]}
    assert len({tuple(v) for v in kept.values()}) > 1, kept


def test_negative_advantages_only_is_trls_off_policy_sequence_mask():
    """TRL get_off_policy_mask: keep if A >= 0 or mean_t(log pi_behav - log pi_theta) <= delta."""
    target, behav, mask, adv = stale_batch()
    delta = 0.05
    keep = rejection_keep(target, behav, mask, "k1", "sequence_mean", None, delta, advantages=adv[:, None].expand_as(target))
    for b in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if mask[b, t]]
        seq_kl = sum(float(behav[b, t]) - float(target[b, t]) for t in toks) / len(toks)
        want = float(adv[b]) >= 0 or seq_kl <= delta
        assert all(bool(keep[b, t]) == want for t in toks), (b, seq_kl)
    assert not keep[1].any() and keep[0].all()  # sequence 1 (A < 0, drifted) dropped; 0 (A > 0) kept


def test_unknown_divergence_or_level_names_the_key():
    target, behav, mask, _ = stale_batch()
    with pytest.raises(ValueError, match="algorithm.rejection.divergence"):
        rejection_keep(target, behav, mask, "k4", "token", None, 1.0)
    with pytest.raises(ValueError, match="algorithm.rejection.level"):
        rejection_keep(target, behav, mask, "k1", "sequence_median", None, 1.0)


@pytest.mark.parametrize("weight_min", [None, 0.8])
def test_cispo_objective_and_gradient_equal_the_loop_reference(weight_min):
    g = torch.Generator().manual_seed(3)
    lp = (-2.0 * torch.rand(3, 4, generator=g, dtype=F64) - 0.1).requires_grad_(True)
    base = lp.detach() + 0.6 * torch.randn(3, 4, generator=g, dtype=F64)
    base[0, 0] = lp[0, 0].detach() - 2.0  # r = e^2 > weight_max
    base[1, 1] = lp[1, 1].detach() + 1.0  # r = e^-1 < 0.8
    adv = torch.tensor([[0.7], [-1.2], [0.3]], dtype=F64).expand(3, 4)
    weight_max = 1.5
    ratio = torch.exp(lp - base)
    obj, clipped = cispo_objective(ratio, lp, adv, weight_min, weight_max)
    obj.sum().backward()
    for b in range(3):
        for t in range(4):
            r = math.exp(float(lp.detach()[b, t]) - float(base[b, t]))
            w = min(r, weight_max) if weight_min is None else min(max(r, weight_min), weight_max)
            a = float(adv[b, t])
            assert float(obj.detach()[b, t]) == pytest.approx(w * a * float(lp.detach()[b, t]), rel=1e-12)
            # d/d lp of sg[w] * a * lp is w * a: the clip scales the gradient, never removes it
            assert float(lp.grad[b, t]) == pytest.approx(w * a, rel=1e-12)
            assert bool(clipped[b, t]) == (r > weight_max or (weight_min is not None and r < weight_min))
    assert bool(clipped[0, 0]) and bool(clipped[1, 1]) == (weight_min is not None)
