"""Policy losses against a hand-written loop reference, plus the invariants the learner relies on.

The reference below walks sequences and tokens with Python loops and scalar
maths; it shares no code with `async_april.algorithms.losses`. Over 400 lines because that
reference is the spec every test here checks against, and it stays beside them.
"""

import math

import numpy as np
import pytest
import torch

from async_april.algorithms.losses import (
    MAX_LOG_RATIO,
    LossSettings,
    merge_metrics,
    policy_loss,
)
from async_april.algorithms.metrics import staleness_metrics
from async_april.algorithms.rejection import RejectionSettings
from async_april.config import AlgorithmConfig

F64 = torch.float64

# ----------------------------------------------------------------------------- reference


def _t(x, like):
    return x if torch.is_tensor(x) else torch.tensor(float(x), dtype=like.dtype)


def _ref_weights(prox, beh, toks, s):
    """Bounded decoupled weight per token of one sequence, as floats; plus which were bounded."""
    if s.loss == "gspo" or s.weight_level == "sequence":
        lw = sum(float(prox[t]) - float(beh[t]) for t in toks) / len(toks)
        raw = {t: math.exp(lw) for t in toks}
    else:
        raw = {t: math.exp(float(prox[t]) - float(beh[t])) for t in toks}
    w, bounded = {}, {}
    for t in toks:
        if s.weight_bound == "truncate":
            w[t], bounded[t] = min(raw[t], s.weight_cap), raw[t] > s.weight_cap
        elif s.weight_bound == "mask":
            keep = s.mask_low <= raw[t] <= s.mask_high
            w[t], bounded[t] = (raw[t] if keep else 0.0), not keep
        else:
            w[t], bounded[t] = raw[t], False
    return raw, w, bounded


def _ref_objective(r, a, lo, hi, c):
    """min(r a, clip(r) a), then the dual clip for a < 0; returns (obj, clipped, dual)."""
    r_clip = _t(min(max(r, 1.0 - lo), 1.0 + hi), r)
    unclipped, clipped = r * a, r_clip * a
    obj = unclipped if unclipped <= clipped else clipped
    was_clipped = bool(clipped < unclipped)
    dual = False
    if c is not None and a < 0 and obj < c * a:
        obj, dual = _t(c * a, r), True
    return obj, was_clipped or dual, dual


def reference(lp, beh, adv, mask, s, g_tok, g_seq, prox=None, ref=None):
    """Loss (autograd through lp) and metrics, by loops over sequences and tokens."""
    B, T = lp.shape
    lpd = lp.detach()  # plain numbers for the detached parts
    pg_sum, kl_sum = _t(0.0, lp), _t(0.0, lp)
    stats = {"w": [], "bounded": [], "clip": [], "dual": [], "k2": []}
    for b in range(B):
        toks = [t for t in range(T) if mask[b, t] > 0]
        if not toks:
            continue
        base = prox[b] if s.correction == "decoupled" else beh[b]
        if s.correction == "decoupled":
            raw, w, bounded = _ref_weights(prox[b], beh[b], toks, s)
        else:
            w, bounded = {t: 1.0 for t in toks}, {t: False for t in toks}
        if s.loss == "gspo":
            seq_ratio = math.exp(sum(float(lpd[b, t]) - float(base[t]) for t in toks) / len(toks))
            ratio = {t: seq_ratio * torch.exp(lp[b, t] - lp[b, t].detach()) for t in toks}
            lo, hi = s.gspo_clip_low, s.gspo_clip_high
        else:
            ratio = {t: torch.exp(lp[b, t] - base[t]) for t in toks}
            lo, hi = s.clip_low, s.clip_high
        pg_tok, kl_tok = [], []
        for t in toks:
            a = float(adv[b]) if adv.dim() == 1 else float(adv[b, t])
            obj, clipped, dual = _ref_objective(ratio[t], a, lo, hi, s.dual_clip)
            pg_tok.append(-obj * w[t])
            if ref is not None:
                d = ref[b, t] - lp[b, t]
                kl_tok.append(torch.exp(d) - d - 1.0)
            stats["w"].append(raw[t] if s.correction == "decoupled" else float(ratio[t].detach()))
            stats["bounded"].append(float(bounded[t]))
            stats["clip"].append(float(clipped))
            stats["dual"].append(float(dual))
            stats["k2"].append(0.5 * (float(lpd[b, t]) - float(beh[b, t])) ** 2)
        if s.aggregation == "seq_mean_token_mean":
            pg_sum = pg_sum + sum(pg_tok) / len(toks)
            kl_sum = kl_sum + (sum(kl_tok) / len(toks) if kl_tok else 0.0)
        else:
            pg_sum = pg_sum + sum(pg_tok)
            kl_sum = kl_sum + (sum(kl_tok) if kl_tok else 0.0)
    denom = {"token_mean": g_tok, "seq_mean_token_mean": g_seq}.get(s.aggregation)
    if denom is None:
        denom = s.constant_normalizer * g_seq
    pg, kl = pg_sum / denom, kl_sum / denom
    loss = pg + s.kl_coef * kl if s.kl_coef > 0 else pg
    n = len(stats["w"])
    metrics = {
        "is/weight_mean": sum(stats["w"]) / n,
        "is/weight_max": max(stats["w"]),
        "is/bounded_frac": sum(stats["bounded"]) / n,
        "loss/clip_frac": sum(stats["clip"]) / n,
        "loss/dual_clip_frac": sum(stats["dual"]) / n,
        "loss/approx_kl": sum(stats["k2"]) / n,
        "_tokens": float(n),
    }
    return loss, metrics


# ----------------------------------------------------------------------------- data


def make_batch(seed=0):
    """Three right-padded sequences (lengths 5, 3, 4) chosen so that every clip and bound acts somewhere."""
    g = torch.Generator().manual_seed(seed)
    B, T = 3, 5
    lp = -2.0 * torch.rand(B, T, generator=g, dtype=F64) - 0.05
    beh = lp + 0.4 * torch.randn(B, T, generator=g, dtype=F64)
    prox = lp + 0.15 * torch.randn(B, T, generator=g, dtype=F64)
    beh[1, 0] = lp[1, 0] - 1.5  # direct: r = e^1.5 > 3 with A < 0 -> dual clip
    prox[1, 1] = lp[1, 1] - 1.3  # decoupled: u = e^1.3 > 3 with A < 0 -> dual clip
    beh[2] = prox[2] - 0.9  # sequence 2: w = e^0.9 = 2.46 at both levels -> truncated / masked
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=F64)
    adv = torch.tensor([0.7, -1.3, 0.4], dtype=F64)
    ref = lp + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    return dict(lp=lp, beh=beh, prox=prox, mask=mask, adv=adv, ref=ref)


def run_both(s, data, adv=None, g_tok=None, g_seq=None, with_prox=True, with_ref=False):
    """Loss, gradient and metrics from the implementation and from the reference."""
    adv = data["adv"] if adv is None else adv
    g_tok = float(data["mask"].sum()) if g_tok is None else g_tok
    g_seq = float(data["mask"].shape[0]) if g_seq is None else g_seq
    prox = data["prox"] if with_prox else None
    ref = data["ref"] if with_ref else None
    lp1 = data["lp"].clone().requires_grad_(True)
    loss, metrics = policy_loss(
        logprobs=lp1, behavior_logprobs=data["beh"], advantages=adv, mask=data["mask"], settings=s,
        global_tokens=g_tok, global_sequences=g_seq, proximal_logprobs=prox, ref_logprobs=ref,
    )
    loss.backward()
    lp2 = data["lp"].clone().requires_grad_(True)
    ref_loss, ref_metrics = reference(lp2, data["beh"], adv, data["mask"], s, g_tok, g_seq, prox, ref)
    ref_loss.backward()
    return (loss, lp1.grad, metrics), (ref_loss, lp2.grad, ref_metrics)


VARIANTS = {
    "ppo-direct": dict(),
    "ppo-direct-nodual": dict(dual_clip=None),
    "ppo-direct-seqmean": dict(aggregation="seq_mean_token_mean"),
    "ppo-direct-constant": dict(aggregation="constant", constant_normalizer=8.0),
    **{
        f"ppo-decoupled-{bound}-{level}": dict(correction="decoupled", weight_bound=bound, weight_level=level)
        for bound in ("truncate", "mask", "none")
        for level in ("token", "sequence")
    },
    "ppo-decoupled-seqmean": dict(correction="decoupled", aggregation="seq_mean_token_mean"),
    "gspo-direct": dict(loss="gspo", aggregation="seq_mean_token_mean"),
    "gspo-direct-wide": dict(loss="gspo", gspo_clip_low=0.1, gspo_clip_high=0.15, aggregation="seq_mean_token_mean"),
    "gspo-direct-tokenmean": dict(loss="gspo", gspo_clip_low=0.1, gspo_clip_high=0.15),
    "gspo-decoupled-truncate": dict(loss="gspo", correction="decoupled", gspo_clip_low=0.1, gspo_clip_high=0.15,
                                    aggregation="seq_mean_token_mean"),
    "gspo-decoupled-mask": dict(loss="gspo", correction="decoupled", weight_bound="mask", gspo_clip_low=0.1,
                                gspo_clip_high=0.15, aggregation="constant", constant_normalizer=6.0),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_loop_reference(name):
    s = LossSettings(**VARIANTS[name])
    (loss, grad, metrics), (ref_loss, ref_grad, ref_metrics) = run_both(s, make_batch())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    for key, value in ref_metrics.items():
        assert metrics[key].item() == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert torch.equal(grad[data_mask_zero()], torch.zeros_like(grad[data_mask_zero()]))


def data_mask_zero():
    return make_batch()["mask"] == 0


def test_variants_exercise_every_branch():
    """The batch is built so the reference comparisons above are not vacuous."""
    data = make_batch()
    _, (_, _, m) = run_both(LossSettings(), data)
    assert 0 < m["loss/clip_frac"] < 1 and m["loss/dual_clip_frac"] > 0
    _, (_, _, m) = run_both(LossSettings(correction="decoupled"), data)
    assert m["loss/dual_clip_frac"] > 0
    for bound in ("truncate", "mask"):
        for level in ("token", "sequence"):
            _, (_, _, m) = run_both(LossSettings(correction="decoupled", weight_bound=bound, weight_level=level), data)
            assert 0 < m["is/bounded_frac"] < 1, (bound, level)
    _, (_, _, m) = run_both(LossSettings(**VARIANTS["gspo-direct-wide"]), data)
    assert 0 < m["loss/clip_frac"] < 1


def test_per_token_advantages_match_reference():
    data = make_batch()
    adv = torch.linspace(-1.0, 1.0, 15, dtype=F64).reshape(3, 5)
    for s in (LossSettings(), LossSettings(correction="decoupled", weight_level="sequence")):
        (loss, grad, _), (ref_loss, ref_grad, _) = run_both(s, data, adv=adv)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
def test_kl_term_matches_reference(aggregation):
    s = LossSettings(kl_coef=0.1, aggregation=aggregation, constant_normalizer=7.0, correction="decoupled")
    (loss, grad, metrics), (ref_loss, ref_grad, _) = run_both(s, make_batch(), with_ref=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(metrics["loss/policy"] + 0.1 * metrics["loss/kl"], loss.detach())
    assert metrics["loss/kl"] > 0


def test_gspo_equals_sequence_level_objective():
    """With per-sequence advantages and seq-mean aggregation, GSPO-token has GSPO's value and gradient."""
    data = make_batch()
    s = LossSettings(**VARIANTS["gspo-direct-wide"])
    lp = data["lp"].clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs=lp, behavior_logprobs=data["beh"], advantages=data["adv"], mask=data["mask"],
                          settings=s, global_tokens=12, global_sequences=3)
    loss.backward()
    lp2 = data["lp"].clone().requires_grad_(True)
    total = 0.0
    for b in range(3):
        toks = [t for t in range(5) if data["mask"][b, t] > 0]
        s_i = torch.exp(sum(lp2[b, t] - data["beh"][b, t] for t in toks) / len(toks))  # gradient through s_i
        obj, _, _ = _ref_objective(s_i, float(data["adv"][b]), s.gspo_clip_low, s.gspo_clip_high, s.dual_clip)
        total = total - obj
    (total / 3).backward()
    torch.testing.assert_close(loss, total / 3, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, lp2.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["ppo-decoupled-truncate-token", "ppo-direct-constant", "gspo-decoupled-truncate"])
def test_gradcheck(name):
    data = make_batch(seed=3)
    s = LossSettings(**VARIANTS[name])

    def fn(lp):
        return policy_loss(logprobs=lp, behavior_logprobs=data["beh"], advantages=data["adv"], mask=data["mask"],
                           settings=s, global_tokens=12, global_sequences=3, proximal_logprobs=data["prox"])[0]

    assert torch.autograd.gradcheck(fn, (data["lp"].clone().requires_grad_(True),))


# ----------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("loss_kind", ["ppo", "gspo"])
def test_trap_recomputed_behavior_turns_correction_off(loss_kind):
    """behavior = current logprobs (recomputed) gives ratio 1 and a different loss than the sampler's logprobs."""
    data = make_batch()
    s = LossSettings(loss=loss_kind)
    kw = dict(advantages=data["adv"], mask=data["mask"], settings=s, global_tokens=12, global_sequences=3)
    lp = data["lp"].clone().requires_grad_(True)
    good, good_m = policy_loss(logprobs=lp, behavior_logprobs=data["beh"], **kw)
    bad, bad_m = policy_loss(logprobs=lp, behavior_logprobs=lp.detach(), **kw)
    assert not torch.allclose(good, bad)
    assert bad_m["is/weight_mean"].item() == 1.0 and bad_m["is/weight_max"].item() == 1.0
    assert bad_m["loss/clip_frac"].item() == 0.0 and bad_m["loss/approx_kl"].item() == 0.0
    assert good_m["is/weight_max"].item() > 1.5 and good_m["loss/approx_kl"].item() > 0


ON_POLICY = [
    dict(correction="direct"),
    *[dict(correction="decoupled", weight_bound=b, weight_level=l)
      for b in ("truncate", "mask", "none") for l in ("token", "sequence")],
]


@pytest.mark.parametrize("loss_kind", ["ppo", "gspo"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_on_policy_every_mode_is_plain_clip(loss_kind, aggregation):
    data = make_batch()
    results = []
    for kw in ON_POLICY:
        s = LossSettings(loss=loss_kind, aggregation=aggregation, **kw)
        lp = data["lp"].clone().requires_grad_(True)
        loss, m = policy_loss(logprobs=lp, behavior_logprobs=lp.detach(), advantages=data["adv"], mask=data["mask"],
                              settings=s, global_tokens=12, global_sequences=3, proximal_logprobs=lp.detach())
        loss.backward()
        assert m["is/bounded_frac"].item() == 0.0 and m["is/weight_mean"].item() == 1.0
        results.append((loss.detach(), lp.grad))
    # Plain PPO-clip at r = 1: loss = -agg(A), gradient = -A / normaliser on every real token.
    mask, adv = data["mask"], data["adv"]
    if aggregation == "token_mean":
        expected_loss, expected_grad = -(adv[:, None] * mask).sum() / 12, -(adv[:, None] * mask) / 12
    else:
        lengths = mask.sum(1, keepdim=True)
        expected_loss, expected_grad = -adv.sum() / 3, -(adv[:, None] * mask) / lengths / 3
    for loss, grad in results:
        torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "constant"])
@pytest.mark.parametrize("variant", ["ppo-direct", "ppo-decoupled-mask-sequence", "gspo-decoupled-truncate"])
def test_microbatches_sum_to_full_batch(aggregation, variant):
    data = make_batch()
    s = LossSettings(**{**VARIANTS[variant], "aggregation": aggregation, "constant_normalizer": 5.0, "kl_coef": 0.05})
    g_tok, g_seq = float(data["mask"].sum()), 3.0

    def call(rows):
        lp = data["lp"][rows].clone().requires_grad_(True)
        loss, m = policy_loss(logprobs=lp, behavior_logprobs=data["beh"][rows], advantages=data["adv"][rows],
                              mask=data["mask"][rows], settings=s, global_tokens=g_tok, global_sequences=g_seq,
                              proximal_logprobs=data["prox"][rows], ref_logprobs=data["ref"][rows])
        loss.backward()
        return loss.detach(), lp.grad, m

    full_loss, full_grad, full_m = call([0, 1, 2])
    loss_a, grad_a, m_a = call([0, 2])
    loss_b, grad_b, m_b = call([1])
    torch.testing.assert_close(loss_a + loss_b, full_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([grad_a[:1], grad_b, grad_a[1:]]), full_grad, rtol=1e-12, atol=1e-12)
    merged = merge_metrics([m_a, m_b])
    assert merged.keys() == full_m.keys()
    for key in full_m:
        torch.testing.assert_close(merged[key], full_m[key], rtol=1e-12, atol=1e-12, msg=key)


@pytest.mark.parametrize("name", ["ppo-direct", "ppo-decoupled-truncate-token", "ppo-decoupled-mask-sequence",
                                  "gspo-direct", "gspo-decoupled-truncate"])
@pytest.mark.parametrize("bad", [-1e4, -math.inf])
def test_clamp_keeps_extreme_behavior_finite(name, bad):
    data = make_batch()
    data["beh"][0, 1] = bad
    s = LossSettings(**VARIANTS[name], kl_coef=0.1)
    lp = data["lp"].clone().requires_grad_(True)
    loss, m = policy_loss(logprobs=lp, behavior_logprobs=data["beh"], advantages=data["adv"], mask=data["mask"],
                          settings=s, global_tokens=12, global_sequences=3, proximal_logprobs=data["prox"],
                          ref_logprobs=data["ref"])
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in m.values())
    assert m["is/weight_max"] <= math.exp(MAX_LOG_RATIO) * (1 + 1e-12)


def test_padding_values_are_ignored():
    data = make_batch()
    s = LossSettings(correction="decoupled", weight_level="sequence", kl_coef=0.1)
    kw = dict(advantages=data["adv"], mask=data["mask"], settings=s, global_tokens=12, global_sequences=3)
    clean, _ = policy_loss(logprobs=data["lp"], behavior_logprobs=data["beh"], proximal_logprobs=data["prox"],
                           ref_logprobs=data["ref"], **kw)
    pad = data["mask"] == 0
    dirty = {k: data[k].masked_fill(pad, v) for k, v in [("lp", math.nan), ("beh", -math.inf), ("prox", math.inf),
                                                         ("ref", math.nan)]}
    lp = dirty["lp"].clone().requires_grad_(True)
    loss, m = policy_loss(logprobs=lp, behavior_logprobs=dirty["beh"], proximal_logprobs=dirty["prox"],
                          ref_logprobs=dirty["ref"], **kw)
    loss.backward()
    torch.testing.assert_close(loss, clean, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(lp.grad).all() and (lp.grad[pad] == 0).all()


def test_float32_bool_mask_and_per_sequence_advantages():
    data = make_batch()
    s = LossSettings(correction="decoupled")
    loss32, _ = policy_loss(logprobs=data["lp"].float(), behavior_logprobs=data["beh"].float(),
                            advantages=data["adv"].float(), mask=data["mask"].bool(), settings=s, global_tokens=12,
                            global_sequences=3, proximal_logprobs=data["prox"].float())
    loss64, _ = policy_loss(logprobs=data["lp"], behavior_logprobs=data["beh"], advantages=data["adv"],
                            mask=data["mask"], settings=s, global_tokens=12, global_sequences=3,
                            proximal_logprobs=data["prox"])
    assert loss32.dtype == torch.float32
    torch.testing.assert_close(loss32.double(), loss64, rtol=1e-5, atol=1e-6)


def test_bfloat16_logprobs_compute_in_float32():
    data = make_batch()
    T = 300  # more tokens than bfloat16 can count exactly
    lp = data["lp"][:1, :1].expand(2, T).contiguous()
    kw = dict(behavior_logprobs=lp - 0.1, advantages=torch.tensor([1.0, -1.0]), mask=torch.ones(2, T),
              settings=LossSettings(), global_tokens=2 * T, global_sequences=2)
    lp16 = lp.to(torch.bfloat16).requires_grad_(True)
    loss, m = policy_loss(logprobs=lp16, **kw)
    loss.backward()
    assert loss.dtype == torch.float32 and lp16.grad.dtype == torch.bfloat16
    assert m["_tokens"].item() == 2 * T


# ----------------------------------------------------------------------------- errors and settings


def test_errors_name_what_to_set():
    data = make_batch()
    kw = dict(logprobs=data["lp"], behavior_logprobs=data["beh"], advantages=data["adv"], mask=data["mask"],
              global_tokens=12, global_sequences=3)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        policy_loss(settings=LossSettings(correction="decoupled"), **kw)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(settings=LossSettings(kl_coef=0.1), **kw)
    with pytest.raises(ValueError, match="constant_normalizer"):
        policy_loss(settings=LossSettings(aggregation="constant"), **kw)
    with pytest.raises(ValueError, match="global_tokens"):
        policy_loss(settings=LossSettings(), **{**kw, "global_tokens": 0})
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(settings=LossSettings(), **{**kw, "advantages": torch.zeros(4)})
    with pytest.raises(ValueError, match="behavior_logprobs"):
        policy_loss(settings=LossSettings(), **{**kw, "behavior_logprobs": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="algorithm.correction"):
        LossSettings(correction="areal")
    with pytest.raises(ValueError, match="mask_low"):
        LossSettings(mask_low=2.0, mask_high=1.5)


def test_from_config_mirrors_algorithm_config():
    cfg = AlgorithmConfig(loss="gspo", correction="decoupled", weight_bound="mask", weight_level="sequence",
                          weight_cap=3.0, mask_low=0.3, mask_high=3.0, clip_low=0.1, clip_high=0.2, dual_clip=None,
                          aggregation="constant", kl_coef=0.01)
    s = LossSettings.from_config(cfg, max_new_tokens=48)
    for name in LossSettings.__dataclass_fields__:
        expected = 48.0 if name == "constant_normalizer" else getattr(cfg, name)
        if name == "rejection":  # a nested section becomes a nested dataclass, field for field
            expected = RejectionSettings(**cfg.rejection.model_dump())
        assert getattr(s, name) == expected, name
    rej = AlgorithmConfig(rejection={"divergence": "k3", "level": "sequence_max", "high": 0.5, "keep_in_normalizer": False})
    assert LossSettings.from_config(rej, 48).rejection == RejectionSettings("k3", "sequence_max", None, 0.5, "proximal", False, False)
    assert LossSettings.from_config(AlgorithmConfig(constant_normalizer=100.0), 48).constant_normalizer == 100.0
    assert LossSettings.from_config(AlgorithmConfig(), 48) == LossSettings(constant_normalizer=48.0)


def test_staleness_metrics():
    versions = [np.array([3, 3, 4]), np.array([5]), np.array([], np.int64)]
    m = staleness_metrics(versions, policy_version=5)
    assert m == {"staleness/token_lag_mean": pytest.approx(5 / 4), "staleness/token_lag_max": 2.0}
    padded = torch.tensor([[3, 3, 4], [5, 0, 0]])
    assert staleness_metrics(padded, 5, mask=padded > 0) == m
    assert staleness_metrics([], 5) == {"staleness/token_lag_mean": 0.0, "staleness/token_lag_max": 0.0}


def test_correction_none_ignores_the_behaviour_policy():
    """The ablation mode: off-policy tokens are treated as on-policy (ratio 1 at the start of the update)."""
    torch.manual_seed(0)
    logprobs = (-torch.rand(2, 5, dtype=torch.float64)).requires_grad_()
    behavior = logprobs.detach() - 0.7
    mask = torch.ones(2, 5)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    s_none = LossSettings(correction="none")
    loss_none, m_none = policy_loss(logprobs, behavior, adv, mask, s_none, 10, 2)
    loss_onp, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, LossSettings(), 10, 2)
    loss_direct, _ = policy_loss(logprobs, behavior, adv, mask, LossSettings(), 10, 2)
    assert torch.allclose(loss_none, loss_onp)
    assert not torch.allclose(loss_none, loss_direct)
    assert float(m_none["is/weight_max"]) == pytest.approx(1.0)
