"""Packed micro-batches and the chunked logprob head equal the padded, full-logits path.

float64 on CPU to 1e-10 for the pure maths and a tiny random Qwen2 (tied embeddings): values and
gradients. Then the FSDP2 learner (world size 1, gloo) packed vs padded and against a plain
full-logits loop; tests/test_learner.py's two-rank tests cover 2 ranks = 1 rank on this path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_april.algorithms.losses import LossSettings, policy_loss
from async_april.config import config_from_dict
from learners import packed_attention
from learners.chunked_logprobs import chunked_logprobs
from learners.logprobs import collate, response_logprobs, token_entropy, token_logprobs
from learners.update import pack_micro_batches
from tests.test_learner import (  # noqa: F401
    TEMPERATURE,
    free_port,
    local_worker,
    make_batch,
    make_cfg,
    model_path,
)

TOL = 1e-10


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_full_logits_in_values_and_gradients(temperature):
    g = torch.Generator().manual_seed(0)
    n, h, v = 45, 8, 23  # 45 positions in chunks of 7: a ragged last chunk
    hidden = torch.randn(n, h, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, dtype=torch.float64, generator=g)
    lp, ent = chunked_logprobs(hidden, weight, targets, temperature, with_entropy=True, chunk=7)
    got = torch.autograd.grad((lp * upstream).sum(), (hidden, weight))
    logits = hidden @ weight.t()
    ref = token_logprobs(logits, targets, temperature)
    want = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    assert lp.dtype == torch.float64 and not ent.requires_grad
    torch.testing.assert_close(lp, ref, atol=TOL, rtol=0)
    torch.testing.assert_close(ent, token_entropy(logits, temperature), atol=TOL, rtol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_the_head_accumulates_a_narrower_weight_gradient_slice_by_slice_in_place():
    """bf16 weights (GPU): dz^T h is added into the fp32 accumulator VOCAB_SLICE rows at a time; the result is
    the one [V, H] product of before, cast to fp32 (learners/chunked_logprobs.py `_accumulate_weight_grad`)."""
    from learners.chunked_logprobs import _accumulate_weight_grad

    g = torch.Generator().manual_seed(0)
    dz, h = torch.randn(7, 23, generator=g).bfloat16(), torch.randn(7, 8, generator=g).bfloat16()
    start = torch.randn(23, 8, generator=g)
    acc = start.clone()
    _accumulate_weight_grad(acc, dz, h, vocab_slice=5)  # a ragged last slice
    torch.testing.assert_close(acc, start + (dz.t() @ h).float(), atol=0, rtol=0)
    acc64, dz64, h64 = start.double(), dz.double(), h.double()
    before = acc64.data_ptr()
    _accumulate_weight_grad(acc64, dz64, h64)  # same dtypes: one addmm_ into the accumulator itself
    assert acc64.data_ptr() == before
    torch.testing.assert_close(acc64, start.double() + dz64.t() @ h64, atol=TOL, rtol=0)


def tiny_model(path: str, dtype=torch.float64, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    if attn == "sdpa_packed":
        packed_attention.register()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).train()


BUDGET = 24


def ragged_rows(vocab: int, seed: int = 0):
    """1-token responses, a row exactly at the budget, a multi-turn row with environment tokens."""
    rng = np.random.default_rng(seed)
    shapes = [(3, 1), (1, 1), (5, 9), (4, BUDGET - 4), (2, 13), (6, 1), (BUDGET - 2, 2), (3, 7)]
    ids = [rng.integers(1, vocab, p + r).astype(np.int64) for p, r in shapes]
    plens = np.array([p for p, _ in shapes], np.int64)
    blp = [rng.normal(-2.0, 0.3, r).astype(np.float32) for _, r in shapes]
    prox = [(b + rng.normal(0, 0.05, len(b))).astype(np.float32) for b in blp]
    masks = [np.ones(r, np.float32) for _, r in shapes]
    masks[4][3:8] = 0.0  # tool output inside the response: not trained on
    versions = [rng.integers(0, 3, r).astype(np.int64) for _, r in shapes]
    adv = rng.normal(size=len(shapes)).astype(np.float32)
    return ids, plens, blp, adv, prox, masks, versions


@pytest.mark.parametrize(("aggregation", "attn"), [("token_mean", "sdpa"), ("seq_mean_token_mean", "sdpa"),
                                                    ("constant", "sdpa"), ("token_mean", "sdpa_packed")])
def test_packed_equals_padded_in_logprobs_loss_metrics_and_gradients(model_path, aggregation, attn):  # noqa: F811
    """`sdpa`: transformers' block-diagonal mask; `sdpa_packed` (the learner's): per-row attention, and
    the same padded path (its mask function keeps transformers' padding mask)."""
    model = tiny_model(model_path, attn=attn)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: both uses get gradient
    ids, plens, blp, adv, prox, masks, versions = ragged_rows(model.config.vocab_size)
    cfg = config_from_dict({"algorithm": {"correction": "decoupled", "aggregation": aggregation, "kl_coef": 0.0}})
    settings = LossSettings.from_config(cfg.algorithm, 32)
    groups = pack_micro_batches(np.array([len(x) for x in ids]), BUDGET, packed=True)
    assert [len(ids[i]) for i in groups[0]] == [BUDGET] and [len(ids[i]) for i in groups[1]] == [BUDGET]
    results = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        lps, ents, metrics, loss_sum = [], [], [], 0.0
        for g in groups:
            mb = collate([ids[i] for i in g], plens[g], [blp[i] for i in g], adv[g], proximal_logprobs=[prox[i] for i in g],
                         loss_masks=[masks[i] for i in g], versions=[versions[i] for i in g], policy_version=2, packed=packed)
            assert mb.packed == packed
            lp, ent = response_logprobs(model, mb, TEMPERATURE, with_entropy=True)
            loss, m = policy_loss(lp, mb.behavior_logprobs.double(), mb.advantages.double(), mb.response_mask, settings,
                                  float(sum(m.sum() for m in masks)), float(len(ids)),
                                  proximal_logprobs=mb.proximal_logprobs.double(), token_lags=mb.token_lags, max_lag=2)
            loss.backward()
            loss_sum += loss.item()
            lps.append(lp.detach())
            ents.append(ent)
            metrics.append({k: float(v) for k, v in m.items()})
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        results[packed] = lps, ents, metrics, loss_sum, grads
    (lp0, e0, m0, l0, g0), (lp1, e1, m1, l1, g1) = results[False], results[True]
    assert lp1[0].dtype == torch.float64
    for a, b in zip(lp0 + e0, lp1 + e1):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)
    assert l1 == pytest.approx(l0, abs=TOL) and l0 != 0.0
    for a, b in zip(m0, m1):
        assert a.keys() == b.keys() and any(k.startswith("mismatch/") for k in a)
        for k in a:
            assert b[k] == pytest.approx(a[k], abs=TOL, nan_ok=True), k
    assert any(float(g.abs().max()) > 0 for g in g0.values())
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=TOL, rtol=0, msg=lambda s, k=k: f"{k}: {s}")


def test_the_chunked_head_equals_full_logits_and_packing_keeps_rows_apart(model_path):  # noqa: F811
    """The head's logprobs and gradients (tied weight included) equal log_softmax of the model's own
    full logits, row by row; and changing one packed row's tokens leaves the others' logprobs alone."""
    ref_model, model = tiny_model(model_path), tiny_model(model_path)
    ids, plens, blp, adv, *_ = ragged_rows(model.config.vocab_size, seed=1)
    mb = collate(ids, plens, blp, adv, packed=True)
    lp = response_logprobs(model, mb, TEMPERATURE)
    (lp * mb.response_mask).sum().backward()
    total = 0.0
    for i, x in enumerate(ids):
        logits = ref_model(input_ids=torch.from_numpy(x)[None]).logits[0, plens[i] - 1 : -1]
        want = token_logprobs(logits, torch.from_numpy(x[plens[i]:]), TEMPERATURE)
        torch.testing.assert_close(lp[i, : len(want)], want, atol=TOL, rtol=0)
        total = total + want.sum()
    total.backward()
    for (k, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=TOL, rtol=0, msg=lambda s, k=k: f"{k}: {s}")
    changed = [x.copy() for x in ids]
    changed[2][:] = (changed[2] % (model.config.vocab_size - 1)) + 1
    with torch.no_grad():
        other = response_logprobs(model, collate(changed, plens, blp, adv, packed=True), TEMPERATURE)
    keep = [i for i in range(len(ids)) if i != 2]
    torch.testing.assert_close(other[keep], lp.detach()[keep], atol=TOL, rtol=0)
    assert not torch.allclose(other[2], lp.detach()[2])


def test_a_biased_head_and_mismatched_targets_are_clear_errors():
    from torch import nn

    from learners.chunked_logprobs import LogprobHead

    with pytest.raises(ValueError, match="bias-free"):
        LogprobHead(nn.Linear(4, 5, bias=True))
    with pytest.raises(ValueError, match="do not match"):
        chunked_logprobs(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))


def test_packed_micro_batches_fill_the_budget():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.0, 1.0, 200), 8, 700).astype(np.int64)
    lengths[:2] = [2000, 1024]  # one over the budget, one exactly at it
    packed = pack_micro_batches(lengths, 1024, packed=True)
    padded = pack_micro_batches(lengths, 1024)
    assert sorted(i for g in packed for i in g) == list(range(200))
    assert all(len(g) == 1 or lengths[g].sum() <= 1024 for g in packed)
    assert [0] in packed and [1] in packed  # over the budget, at the budget: alone
    # Near the bound: every micro-batch but the two lone rows and the last is (almost) full.
    assert len(packed) <= int(np.ceil(lengths[2:].sum() / 1024)) + 3 <= len(padded)
    assert pack_micro_batches(np.array([5, 2000, 3]), 1024, packed=True) == [[1], [0, 2]]


def test_fsdp_learner_packed_equals_padded_and_the_full_logits_loop(model_path):  # noqa: F811
    """FSDP2 (world size 1, gloo, fp32), several micro-batches, 2 mini-batches (proximal forward),
    entropy metric: packed and padded steps give the same loss, metrics and weights; the loss equals
    a plain full-logits computation on the initial model."""
    batch = make_batch(model_path, seed=3)
    algo = {"correction": "decoupled"}
    out = {}
    for packed in (False, True):
        with local_worker(make_cfg(algo, max_tokens_per_microbatch=24, mini_batches=2, packing=packed), model_path) as w:
            m = w.train_step(batch)
            out[packed] = m, w.full_state_dict()
    (m0, sd0), (m1, sd1) = out[False], out[True]
    assert m1["train/micro_batches"] >= 2
    assert m1["train/micro_batches"] <= m0["train/micro_batches"]
    for k in ("loss/total", "loss/policy", "train/grad_norm", "loss/entropy", "is/weight_max", "loss/tokens"):
        assert m1[k] == pytest.approx(m0[k], abs=1e-5), k
    for k in sd0:
        torch.testing.assert_close(sd1[k], sd0[k], atol=1e-5, rtol=0, msg=lambda s, k=k: f"{k}: {s}")



def test_fsdp_learner_loss_and_gradient_norm_equal_a_plain_full_logits_computation(model_path):  # noqa: F811
    """The chunked head under FSDP2 (its weight is sharded outside the forward, and tied): one packed
    step's loss and gradient norm equal the full-logits path's on the initial model (pi_prox = pi_theta)."""
    batch = make_batch(model_path, seed=4)
    cfg = make_cfg({"correction": "decoupled"}, max_tokens_per_microbatch=24)
    with local_worker(cfg, model_path) as w:
        m = w.train_step(batch)
    ref = tiny_model(model_path, torch.float32)
    mb = collate(batch.input_ids, batch.prompt_lens, batch.behavior_logprobs, batch.advantages)
    first = int(mb.prompt_lens.min()) - 1
    logits = ref(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, first:-1]
    full = token_logprobs(logits, mb.input_ids[:, first + 1 :], TEMPERATURE)
    offs = (mb.prompt_lens - 1 - first)[:, None] + torch.arange(mb.response_mask.shape[1])[None]
    lp = full.gather(1, offs.clamp(max=full.shape[1] - 1)) * mb.response_mask
    settings = LossSettings.from_config(cfg.algorithm, cfg.rollout.max_new_tokens)
    loss, _ = policy_loss(lp, mb.behavior_logprobs, mb.advantages, mb.response_mask, settings,
                          float(batch.num_response_tokens), float(len(batch)), proximal_logprobs=lp.detach())
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    assert m["train/micro_batches"] >= 2 and grad_norm > 0
    assert m["loss/total"] == pytest.approx(loss.item(), abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(grad_norm, rel=1e-5)


def test_packed_sdpa_attends_row_by_row_without_a_full_mask(model_path, monkeypatch):  # noqa: F811
    """learners/packed_attention.py: a packed forward runs one unmasked causal attention per row (the
    measured reason: a masked [T, T] sdpa doubled the tiny learner's peak memory), none over all T."""
    model = tiny_model(model_path, attn="sdpa_packed")
    ids, plens, blp, adv, *_ = ragged_rows(model.config.vocab_size, seed=2)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape[2], attn_mask is None, kw.get("is_causal")))
        return real(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        response_logprobs(model, collate(ids, plens, blp, adv, packed=True), TEMPERATURE)
    layers = model.config.num_hidden_layers
    assert sorted(q for q, *_ in seen) == sorted([len(x) for x in ids] * layers)  # each row once per layer
    assert max(q for q, *_ in seen) < sum(len(x) for x in ids)
    assert all(unmasked for _, unmasked, _ in seen)
    assert packed_attention.segment_lengths(torch.tensor([[0, 1, 2, 0, 0, 1]])) == [3, 1, 2]


HOST_SYNCS = ("tolist", "item", "__int__", "__bool__", "__index__", "__float__")
"""Tensor methods that read a value back to the host (a device sync on GPU)."""


def test_packed_sdpa_reads_the_row_lengths_once_per_forward_not_per_layer(model_path, tmp_path, monkeypatch):  # noqa: F811
    """The row lengths of a packed micro-batch are known on the host when it is collated: every layer gets
    them from the forward's kwargs (packed_attention.forward_kwargs), so a packed forward reads nothing
    back from the device per layer (before: one `.tolist()` of the segment lengths per layer)."""
    from async_april.models import build_random_tiny_model

    deeper = build_random_tiny_model(tmp_path / "deeper", seed=0, hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                                     num_attention_heads=4, num_key_value_heads=2)
    counts: dict[str, int] = {}
    for name in HOST_SYNCS:
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    per_depth = {}
    for path in (model_path, deeper):
        model = tiny_model(str(path), attn="sdpa_packed")
        ids, plens, blp, adv, *_ = ragged_rows(model.config.vocab_size, seed=2)
        mb = collate(ids, plens, blp, adv, packed=True)
        counts.clear()
        with torch.no_grad():
            response_logprobs(model, mb, TEMPERATURE)
        per_depth[model.config.num_hidden_layers] = dict(counts)
    assert per_depth[2] == per_depth[4] and per_depth[4].get("tolist", 0) == 0, per_depth


def test_packed_sdpa_refuses_a_sliding_window_model(tmp_path):
    """sdpa_packed runs plain causal attention within each row, so a sliding-window model is refused when the
    learner starts, as sequence parallelism refuses it (learners/sequence_parallel.py), naming the fix."""
    import torch.distributed as dist

    from async_april.errors import UserError
    from async_april.models import build_random_tiny_model
    from learners.worker import LearnerWorker

    path = build_random_tiny_model(tmp_path / "swa", seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=4, max_window_layers=0)
    try:
        with pytest.raises(UserError, match=r"sliding window.*learner.packing=false") as e:
            LearnerWorker(make_cfg(), str(path), 0, 1, "127.0.0.1", free_port())
    finally:
        if dist.is_initialized():  # the refusal comes after the rank joined its group
            dist.destroy_process_group()
    assert "\n" not in str(e.value)
