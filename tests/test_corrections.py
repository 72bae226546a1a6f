"""The correction family inside `policy_loss`, against a plain-loop reference in float64.

CISPO, the product sequence IS weight, the lower clamp of truncated weights and
rejection sampling (each divergence and aggregation, rejected tokens in or out of
the normaliser), on stale inputs that reach every bound. The reference loops over
sequences and tokens with `math`; it shares no code with `async_april.algorithms`.
"""

import math

import pytest
import torch

from async_april.algorithms.losses import LossSettings, merge_metrics, policy_loss
from async_april.algorithms.rejection import DIVERGENCES, REJECT_LEVELS, RejectionSettings

F64 = torch.float64


def clamp20(x):
    return max(-20.0, min(20.0, x))


def stale_data(seed=1):
    """Four sequences (lengths 6, 4, 5, 3) sampled 0-3 versions ago: behaviour drifts from the
    proximal policy by sequence, so weights exceed the cap, fall under the floor, and the
    divergences spread over a wide range."""
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    lp = -2.0 * torch.rand(B, T, generator=g, dtype=F64) - 0.05
    prox = lp + 0.1 * torch.randn(B, T, generator=g, dtype=F64)
    beh = prox + torch.tensor([[0.05], [-0.25], [0.5], [-0.02]], dtype=F64) + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    beh[0, 1] = prox[0, 1] + 1.6  # w = e^-1.6 = 0.2: under a 0.5 floor
    beh[1, 2] = prox[1, 2] - 1.2  # w = e^1.2 = 3.3: over a 2.0 cap
    lp[2, 3] = beh[2, 3] + 1.0  # direct ratio e^1 > clip and > a CISPO max of 1.5... (A < 0: dual clip)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0], [1] * 3 + [0] * 3], dtype=torch.bool)
    adv = torch.tensor([0.9, -0.6, -1.1, 0.4], dtype=F64)
    ref = lp + 0.3 * torch.randn(B, T, generator=g, dtype=F64)  # a reference policy for the k3 KL term
    return dict(lp=lp, beh=beh, prox=prox, mask=mask, adv=adv, ref=ref)


def ref_divergence(d, kind):
    return {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1.0}[kind]


def ref_keep(data, s, lpd):
    """{(b, t): kept} by loops (True everywhere when rejection is off)."""
    r, mask = s.rejection, data["mask"]
    keep = {}
    for b in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if mask[b, t]]
        target = data["prox"][b] if r.against == "proximal" else lpd[b]
        if r.divergence == "none":
            keep.update({(b, t): True for t in toks})
            continue
        per = {t: ref_divergence(clamp20(float(target[t]) - float(data["beh"][b, t])), r.divergence) for t in toks}
        if r.level == "token":
            stat = per
        else:
            vals = list(per.values())
            seq = {"sequence_sum": sum(vals), "sequence_mean": sum(vals) / len(vals), "sequence_max": max(vals)}[r.level]
            stat = {t: seq for t in toks}
        for t in toks:
            ok = (r.low is None or stat[t] >= r.low) and (r.high is None or stat[t] <= r.high)
            keep[(b, t)] = ok or (r.negative_advantages_only and float(data["adv"][b]) >= 0)
    return keep


def ref_weights(prox, beh, toks, s):
    """Raw and bounded decoupled weight per token of one sequence; and which were bounded."""
    logs = {t: clamp20(float(prox[t]) - float(beh[t])) for t in toks}
    if s.weight_level == "sequence_product":
        raw = {t: math.exp(clamp20(sum(logs.values()))) for t in toks}
    elif s.weight_level == "sequence":
        raw = {t: math.exp(sum(logs.values()) / len(toks)) for t in toks}
    else:
        raw = {t: math.exp(logs[t]) for t in toks}
    w, bounded = {}, {}
    for t in toks:
        if s.weight_bound == "truncate":
            w[t] = min(max(raw[t], s.weight_floor), s.weight_cap)
            bounded[t] = raw[t] > s.weight_cap or raw[t] < s.weight_floor
        elif s.weight_bound == "mask":
            ok = s.mask_low <= raw[t] <= s.mask_high
            w[t], bounded[t] = (raw[t] if ok else 0.0), not ok
        else:
            w[t], bounded[t] = raw[t], False
    return w, bounded


def reference(data, s, lp):
    """(loss with autograd through lp, global tokens, global sequences, metrics) by loops."""
    mask, adv = data["mask"], data["adv"]
    lpd = lp.detach()
    keep = ref_keep(data, s, lpd)
    counted = {k for k, v in keep.items() if v or s.rejection.keep_in_normalizer}  # in the normaliser
    g_tok = float(len(counted))
    g_seq = float(len({b for b, _ in counted}))
    total = lp.new_zeros(())
    stats = {"rejected": [], "bounded": [], "clip": []}
    for b in range(mask.shape[0]):
        toks = [t for t in range(mask.shape[1]) if mask[b, t]]
        base = data["prox"][b] if s.correction == "decoupled" else data["beh"][b]
        if s.correction == "decoupled":
            w, bounded = ref_weights(data["prox"][b], data["beh"][b], toks, s)
        else:
            w, bounded = {t: 1.0 for t in toks}, {t: False for t in toks}
        terms = []
        for t in toks:
            a = float(adv[b])
            r = torch.exp(lp[b, t] - float(base[t]))
            if s.loss == "cispo":
                rv = float(r.detach())
                lo = -math.inf if s.cispo_weight_min is None else s.cispo_weight_min
                obj = min(max(rv, lo), s.cispo_weight_max) * a * lp[b, t]
                clipped = rv > s.cispo_weight_max or rv < lo
            else:
                rv = float(r.detach())
                r_clip = min(max(rv, 1 - s.clip_low), 1 + s.clip_high)
                obj = r * a if rv * a <= r_clip * a else r_clip * a + 0 * r
                clipped = r_clip * a < rv * a
                if s.dual_clip is not None and a < 0 and float(obj.detach()) < s.dual_clip * a:
                    obj, clipped = s.dual_clip * a + 0 * r, True
            stats["rejected"].append(float(not keep[(b, t)]))
            stats["bounded"].append(float(bounded[t]))
            stats["clip"].append(float(clipped))
            term = -obj * w[t] if keep[(b, t)] else 0 * obj
            if s.kl_coef > 0 and keep[(b, t)]:  # a rejected token gets no loss at all: no KL either
                d = float(data["ref"][b, t]) - lp[b, t]
                term = term + s.kl_coef * (torch.exp(d) - d - 1.0)
            if (b, t) in counted:
                terms.append(term)
        if s.aggregation == "seq_mean_token_mean":
            total = total + (sum(terms) / len(terms) if terms else 0.0)
        else:
            total = total + sum(terms)
    denom = {"seq_mean_token_mean": g_seq, "constant": (s.constant_normalizer or 0.0) * g_seq}.get(s.aggregation, g_tok)
    n = len(stats["rejected"])
    metrics = {"is/rejected_frac": sum(stats["rejected"]) / n, "is/bounded_frac": sum(stats["bounded"]) / n,
               "loss/clip_frac": sum(stats["clip"]) / n}
    return total / denom, g_tok, g_seq, metrics


def run_both(s, data=None):
    data = data or stale_data()
    lp_ref = data["lp"].clone().requires_grad_(True)
    want, g_tok, g_seq, want_metrics = reference(data, s, lp_ref)
    want.backward()
    lp = data["lp"].clone().requires_grad_(True)
    loss, metrics = policy_loss(lp, data["beh"], data["adv"], data["mask"], s, g_tok, g_seq,
                                proximal_logprobs=data["prox"], ref_logprobs=data["ref"], batch_tokens=float(data["mask"].sum()))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-12, atol=1e-14)
    for key, value in want_metrics.items():
        assert float(metrics[key]) == pytest.approx(value, abs=1e-12), key
    # loss/policy (+ kl_coef x loss/kl) is reported so that the _tokens-weighted mean is the batch's loss
    reported = float(metrics["loss/policy"]) + (s.kl_coef * float(metrics["loss/kl"]) if s.kl_coef > 0 else 0.0)
    assert reported == pytest.approx(float(want.detach()), rel=1e-12, abs=1e-14)
    return want_metrics, g_tok, g_seq, lp.grad


def midpoint(data, divergence, level, q):
    """A bound halfway between two values of the statistic (against pi_prox), about quantile q."""
    vals = set()
    for b in range(data["mask"].shape[0]):
        toks = [t for t in range(data["mask"].shape[1]) if data["mask"][b, t]]
        per = [ref_divergence(clamp20(float(data["prox"][b, t]) - float(data["beh"][b, t])), divergence) for t in toks]
        if level == "token":
            vals.update(per)
        else:
            vals.add({"sequence_sum": sum(per), "sequence_mean": sum(per) / len(per), "sequence_max": max(per)}[level])
    vals = sorted(vals)
    i = min(max(1, round(q * len(vals))), len(vals) - 1)
    return 0.5 * (vals[i - 1] + vals[i])


@pytest.mark.parametrize("keep_in_normalizer", [True, False])
@pytest.mark.parametrize("level", REJECT_LEVELS)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_rejection_by_each_divergence_and_level(divergence, level, keep_in_normalizer):
    data = stale_data()
    base = LossSettings(loss="ppo", correction="direct", aggregation="seq_mean_token_mean" if level == "token" else "token_mean")
    high = midpoint(data, divergence, level, 0.7)
    low = midpoint(data, divergence, level, 0.2) if divergence == "k1" else None  # k1 is signed: both bounds
    r = RejectionSettings(divergence=divergence, level=level, low=low, high=high, keep_in_normalizer=keep_in_normalizer)
    metrics, g_tok, _, _ = run_both(LossSettings(**{**base.__dict__, "rejection": r}), data)
    assert 0 < metrics["is/rejected_frac"] < 1
    assert (g_tok < float(data["mask"].sum())) == (not keep_in_normalizer)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
@pytest.mark.parametrize("keep_in_normalizer", [True, False])
def test_a_rejected_token_carries_no_kl_gradient_in_either_normaliser_mode(keep_in_normalizer, aggregation):
    """docs/algorithms.md: a rejected token gets no loss, so with kl_coef > 0 none of its k3 KL either,
    whether it stays in the normaliser (slime) or leaves it (verl 0.9.1 removes it from response_mask,
    and verl/workers/utils/losses.py `ppo_loss` aggregates the KL over that same mask). The gradient
    at every rejected token is exactly 0; before the fix, kept in the normaliser, it was the KL's."""
    data = stale_data()
    r = RejectionSettings(divergence="k3", level="token", high=midpoint(data, "k3", "token", 0.6),
                          keep_in_normalizer=keep_in_normalizer)
    s = LossSettings(correction="decoupled", rejection=r, kl_coef=0.5, aggregation=aggregation, constant_normalizer=6.0)
    metrics, _, _, grad = run_both(s, data)
    keep = ref_keep(data, s, data["lp"])
    rejected = torch.tensor([[not keep.get((b, t), True) for t in range(6)] for b in range(4)])
    assert 0 < metrics["is/rejected_frac"] < 1 and rejected.any()
    assert torch.equal(grad[rejected], torch.zeros_like(grad[rejected]))
    assert (grad[data["mask"] & ~rejected] != 0).all()  # kept tokens carry the policy and the KL gradient


@pytest.mark.parametrize("correction", ["direct", "decoupled"])
def test_rejection_against_the_current_policy_and_only_negative_advantages(correction):
    r = RejectionSettings(divergence="k1", level="sequence_mean", high=0.05, against="current", negative_advantages_only=True)
    metrics, _, _, _ = run_both(LossSettings(correction=correction, rejection=r))
    assert 0 < metrics["is/rejected_frac"] < 1


@pytest.mark.parametrize("weight_min", [None, 0.9])
@pytest.mark.parametrize("correction", ["direct", "decoupled"])
def test_cispo(correction, weight_min):
    s = LossSettings(loss="cispo", correction=correction, cispo_weight_min=weight_min, cispo_weight_max=1.5, weight_floor=0.5)
    metrics, _, _, _ = run_both(s)
    assert metrics["loss/clip_frac"] > 0


@pytest.mark.parametrize("bound", ["truncate", "mask", "none"])
def test_product_sequence_weight(bound):
    s = LossSettings(correction="decoupled", weight_level="sequence_product", weight_bound=bound, weight_cap=1.5,
                     mask_low=0.3, mask_high=1.5)
    metrics, _, _, _ = run_both(s)
    assert (metrics["is/bounded_frac"] > 0) == (bound != "none")


def test_product_weight_is_the_product_not_the_geometric_mean():
    data = stale_data()
    s = LossSettings(correction="decoupled", weight_level="sequence_product", weight_bound="none")
    _, m_prod = policy_loss(data["lp"], data["beh"], data["adv"], data["mask"], s, 18.0, 4.0, proximal_logprobs=data["prox"])
    _, m_geo = policy_loss(data["lp"], data["beh"], data["adv"], data["mask"],
                           LossSettings(**{**s.__dict__, "weight_level": "sequence"}), 18.0, 4.0, proximal_logprobs=data["prox"])
    row2 = data["mask"][2]
    log_w = float((data["prox"][2] - data["beh"][2])[row2].sum())
    assert log_w < -1.0  # sequence 2 drifted: the product is far below the geometric mean
    assert float(m_prod["is/weight_max"]) != pytest.approx(float(m_geo["is/weight_max"]))


def test_weight_floor_clamps_truncated_weights_from_below():
    s = LossSettings(correction="decoupled", weight_bound="truncate", weight_cap=2.0, weight_floor=0.5)
    metrics, _, _, _ = run_both(s)
    no_floor, _, _, _ = run_both(LossSettings(**{**s.__dict__, "weight_floor": 0.0}))
    assert metrics["is/bounded_frac"] > no_floor["is/bounded_frac"]  # token (0, 1), w = 0.2, now bounded


def test_rejected_tokens_out_of_the_normaliser_stay_exact_across_micro_batches():
    """Rows split over two calls, each given the batch's kept counts: the losses and gradients sum
    to the single call's."""
    data = stale_data()
    r = RejectionSettings(divergence="k3", level="token", high=0.05, keep_in_normalizer=False)
    s = LossSettings(correction="decoupled", rejection=r, aggregation="seq_mean_token_mean")
    lp_ref = data["lp"].clone().requires_grad_(True)
    want, g_tok, g_seq, _ = reference(data, s, lp_ref)
    lp = data["lp"].clone().requires_grad_(True)
    total, parts = 0.0, []
    for rows in ([0, 2], [1, 3]):
        sub = {k: v[rows] for k, v in data.items()}
        loss, m = policy_loss(lp[rows], sub["beh"], sub["adv"], sub["mask"], s, g_tok, g_seq,
                              proximal_logprobs=sub["prox"], batch_tokens=float(data["mask"].sum()))
        loss.backward()
        total, parts = total + float(loss.detach()), parts + [m]
    want.backward()
    assert total == pytest.approx(float(want.detach()), rel=1e-12)
    torch.testing.assert_close(lp.grad, lp_ref.grad, rtol=1e-12, atol=1e-14)
    assert float(merge_metrics(parts)["loss/policy"]) == pytest.approx(float(want.detach()), rel=1e-12)


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="algorithm.rejection.keep_in_normalizer"):
        LossSettings(rejection=RejectionSettings(divergence="k3", high=1.0, against="current", keep_in_normalizer=False))
    with pytest.raises(ValueError, match="algorithm.rejection"):
        LossSettings(rejection=RejectionSettings(divergence="k3"))  # no bound: rejects nothing
    with pytest.raises(ValueError, match="algorithm.weight_floor"):
        LossSettings(weight_floor=3.0, weight_cap=2.0)
    with pytest.raises(ValueError, match="algorithm.cispo_weight_min"):
        LossSettings(loss="cispo", cispo_weight_min=2.0, cispo_weight_max=1.5)
    data = stale_data()
    with pytest.raises(ValueError, match="proximal_logprobs"):
        policy_loss(data["lp"], data["beh"], data["adv"], data["mask"],
                    LossSettings(rejection=RejectionSettings(divergence="k2", high=0.1)), 18.0, 4.0)


def test_gspo_takes_the_product_weight_when_asked_and_the_geometric_mean_otherwise():
    data = stale_data()
    mask = data["mask"]
    logs = [[clamp20(float(data["prox"][b, t]) - float(data["beh"][b, t])) for t in range(6) if mask[b, t]] for b in range(4)]
    for level, want in (("sequence_product", max(math.exp(clamp20(sum(x))) for x in logs)),
                        ("token", max(math.exp(sum(x) / len(x)) for x in logs))):
        s = LossSettings(loss="gspo", correction="decoupled", weight_level=level, weight_bound="none")
        _, m = policy_loss(data["lp"], data["beh"], data["adv"], mask, s, 18.0, 4.0, proximal_logprobs=data["prox"])
        assert float(m["is/weight_max"]) == pytest.approx(want, rel=1e-12), level


def test_which_steps_need_the_proximal_forward():
    from learners.update import needs_proximal_forward

    out_of_normaliser = RejectionSettings(divergence="k3", high=0.1, keep_in_normalizer=False)
    in_normaliser = RejectionSettings(divergence="k3", high=0.1)
    assert not needs_proximal_forward(LossSettings(correction="decoupled"), 1)  # the training forward's values
    assert needs_proximal_forward(LossSettings(correction="decoupled"), 2)
    assert not needs_proximal_forward(LossSettings(rejection=in_normaliser), 1)
    assert needs_proximal_forward(LossSettings(rejection=in_normaliser), 3)  # rejection against pi_prox
    assert needs_proximal_forward(LossSettings(rejection=out_of_normaliser), 1)  # kept counts before the step
    current = RejectionSettings(divergence="k3", high=0.1, against="current")
    assert not needs_proximal_forward(LossSettings(rejection=current), 4)


def test_kept_counts_of_a_rank_without_rows_are_zero():
    """A rank whose shard of a mini-batch is empty still joins the all-reduce of the kept counts."""
    import numpy as np

    from async_april.rollout.batch import TrainBatch
    from learners.update import kept_counts

    empty = TrainBatch([], np.zeros(0, np.int64), [], [], np.zeros(0, np.float32), 0, proximal_logprobs=[])
    s = LossSettings(rejection=RejectionSettings(divergence="k3", high=0.1, keep_in_normalizer=False))
    assert kept_counts(empty, s) == (0, 0)
    two = TrainBatch([np.array([1, 2, 3]), np.array([1, 4, 5, 6])], np.array([1, 1]),
                     [np.array([-1.0, -1.0], np.float32), np.array([-1.0, -1.0, -1.0], np.float32)], [np.zeros(2), np.zeros(3)],
                     np.array([1.0, -1.0], np.float32), 0,
                     proximal_logprobs=[np.array([-1.0, -3.0], np.float32), np.array([-1.0, -1.05, -1.0], np.float32)])
    # row 0: k3 of d = -2 is e^-2 + 1 = 1.14 > 0.1 (rejected), d = 0 kept; row 1: all within 0.1
    assert kept_counts(two, s) == (4, 2)
