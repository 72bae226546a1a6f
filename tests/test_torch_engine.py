"""Torch engine exactness: every recorded logprob equals a teacher-forced forward of the weights that produced it.

fp32, tolerance 1e-4, with many concurrent requests of different lengths joining
at different decode steps, and across abort -> weight update -> resume and a
weight update in the middle of decoding. An in-flight update that keeps the KV
cache is checked against a replay of the engine's own forwards over the mixed
cache (weights 0 for the tokens fed before the load, weights 1 after).
"""

from __future__ import annotations

import asyncio
import inspect

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.engine import GenerateRequest, SamplingParams
from actors.engines.torch_engine import TorchEngine
pytest.importorskip("aiohttp", reason="the SGLang client and its stand-in server need aiohttp")
from tests.sglang_standin import make_test_model_dir

torch.set_num_threads(1)
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_test_model_dir(tmp_path_factory.getbasetemp() / "tiny-engine-model"))


@pytest.fixture(scope="module")
def weights(model_dir):
    """Version 0 (the saved model) and version 1 (perturbed) state dicts."""
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    v0 = {k: v.clone() for k, v in m.state_dict().items()}
    v1 = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in v0.items()}
    return {0: v0, 1: v1}


_MODELS: dict[int, torch.nn.Module] = {}


def teacher_forced(model_dir, state, prompt, out_ids, temperature=1.0) -> np.ndarray:
    m = _model(model_dir, state)
    ids = torch.as_tensor(np.concatenate([prompt, out_ids]), dtype=torch.long)[None]
    with torch.no_grad():
        lp = torch.log_softmax(m(ids).logits[0].float() / temperature, -1)
    n = len(prompt)
    return lp[n - 1 : -1].gather(-1, torch.as_tensor(out_ids, dtype=torch.long)[:, None])[:, 0].numpy()


def req(rid, prompt, max_new, seed, **kw):
    return GenerateRequest(rid, np.asarray(prompt, np.int64), SamplingParams(max_new_tokens=max_new, seed=seed, **kw))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_logprobs_exact_with_staggered_joins(model_dir, weights, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(1)
    reqs = [req(f"x{i:03d}#", rng.integers(4, 14, size=int(rng.integers(2, 25))), int(rng.integers(1, 50)), seed=i,
                temperature=float(rng.choice([0.7, 1.0, 1.3])))
            for i in range(24)]

    async def main():
        eng = TorchEngine(model_dir, device=device, max_running=8, max_batch_tokens=256, eos_token_ids=())
        await eng.start()

        async def one(i, r):
            await asyncio.sleep(0.004 * i)  # join at different decode steps
            return await eng.generate(r)

        try:
            return await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))), eng.stats()
        finally:
            await eng.shutdown()

    results, stats = asyncio.run(main())
    for r, res in zip(reqs, results):
        assert len(res.output_ids) == r.sampling.max_new_tokens and res.finish_reason == "length"
        ref = teacher_forced(model_dir, weights[0], r.input_ids, res.output_ids, r.sampling.temperature)
        np.testing.assert_allclose(res.logprobs, ref, atol=TOL, err_msg=r.request_id)
    assert stats.generated_tokens == sum(r.sampling.max_new_tokens for r in reqs)
    assert stats.busy_s > 0


def test_abort_update_resume_each_token_matches_its_version(model_dir, weights):
    prompt = np.array([1, 5, 9, 6, 15], np.int64)

    async def main():
        eng = TorchEngine(model_dir, max_running=4, eos_token_ids=())
        await eng.start()
        try:
            others = [asyncio.create_task(eng.generate(req(f"o{i}#", prompt[: 2 + i], 400, seed=100 + i))) for i in range(3)]
            task = asyncio.create_task(eng.generate(req("a0#", prompt, 400, seed=9)))
            while eng.stats().generated_tokens < 40:
                await asyncio.sleep(0.002)
            await eng.abort_all()
            part = await task
            await asyncio.gather(*others)
            await eng.update_weights([{k: v} for k, v in weights[1].items()], version=1)
            rest = await eng.generate(req("a1#", np.concatenate([prompt, part.output_ids]), 400 - len(part.output_ids), seed=10))
            return part, rest
        finally:
            await eng.shutdown()

    part, rest = asyncio.run(main())
    assert part.finish_reason == "abort" and 0 < len(part.output_ids) < 400
    assert set(part.versions.tolist()) == {0} and set(rest.versions.tolist()) == {1}
    assert len(part.output_ids) + len(rest.output_ids) == 400
    np.testing.assert_allclose(part.logprobs, teacher_forced(model_dir, weights[0], prompt, part.output_ids), atol=TOL)
    np.testing.assert_allclose(
        rest.logprobs, teacher_forced(model_dir, weights[1], np.concatenate([prompt, part.output_ids]), rest.output_ids),
        atol=TOL)


def test_update_between_decode_steps_tags_each_token(model_dir, weights):
    prompt = np.array([1, 7, 7, 8], np.int64)

    async def main():
        eng = TorchEngine(model_dir, eos_token_ids=())
        await eng.start()
        try:
            task = asyncio.create_task(eng.generate(req("m0#", prompt, 300, seed=4)))
            while eng.stats().generated_tokens < 20:
                await asyncio.sleep(0.002)
            await eng.update_weights([weights[1]], version=1)
            return await task, eng.stats()
        finally:
            await eng.shutdown()

    res, stats = asyncio.run(main())
    v = res.versions
    k = int(np.argmax(v == 1))
    assert v[0] == 0 and v[-1] == 1 and 0 < k < 300 and np.all(v[:k] == 0) and np.all(v[k:] == 1)
    assert stats.reprefill_tokens == len(prompt) + k - 1  # the row's cache was rebuilt with weights 1 (counted)
    for ver in (0, 1):
        ref = teacher_forced(model_dir, weights[ver], prompt, res.output_ids)
        np.testing.assert_allclose(res.logprobs[v == ver], ref[v == ver], atol=TOL)


def test_same_seed_same_tokens_whatever_the_batch(model_dir):
    target = req("t#", [1, 4, 5, 6], 40, seed=1234, top_k=8, top_p=0.9)

    async def main():
        eng = TorchEngine(model_dir, eos_token_ids=())
        await eng.start()
        try:
            alone = await eng.generate(target)
            crowd = [req(f"c{i}#", np.arange(4, 4 + 3 + i) % 14, 30 + i, seed=i) for i in range(12)]
            *_, crowded = await asyncio.gather(*(eng.generate(r) for r in crowd), eng.generate(target))
            return alone, crowded
        finally:
            await eng.shutdown()

    alone, crowded = asyncio.run(main())
    np.testing.assert_array_equal(alone.output_ids, crowded.output_ids)
    np.testing.assert_allclose(alone.logprobs, crowded.logprobs, atol=TOL)


def test_batch_occupancy_counts_running_rows_per_decode_step(model_dir):
    """perf/engine_batch_occupancy's counters: 4 requests of 10 tokens on an engine with 8 slots. Each
    request's first token comes from its prefill, the other 9 from decode steps of at most 4 rows."""

    async def main():
        eng = TorchEngine(model_dir, eos_token_ids=(), max_running=8)
        await eng.start()
        try:
            await asyncio.gather(*(eng.generate(req(f"o{i}#", [1, 4 + i, 5], 10, seed=i)) for i in range(4)))
            return eng.stats()
        finally:
            await eng.shutdown()

    st = asyncio.run(main())
    assert st.generated_tokens == 40 and st.batch_rows == 36
    assert st.batch_capacity % 8 == 0 and st.batch_capacity >= 9 * 8  # 9 decode steps if all four joined at once
    assert st.batch_rows / st.batch_capacity <= 0.5


def test_kv_slots_count_every_attended_position_and_the_padding_among_them(model_dir):
    """A request with a P-token prompt and m tokens attends to P + i real positions at the decode step
    that samples token i + 1 (i = 1 .. m-1). Alone it attends to nothing else; joining rows of other
    lengths at other steps, its share of the batch's left-padded cache is padding."""

    async def main(staggered):
        eng = TorchEngine(model_dir, eos_token_ids=(), max_running=8)
        await eng.start()
        try:
            async def one(i, r):
                await asyncio.sleep(0.01 * i if staggered else 0)
                return await eng.generate(r)

            reqs = [req(f"k{i}#", [1] + [4 + i] * (2 + 3 * i), 12 + 5 * i, seed=i) for i in range(4 if staggered else 1)]
            await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
            return reqs, eng.stats()
        finally:
            await eng.shutdown()

    for staggered in (False, True):
        reqs, st = asyncio.run(main(staggered))
        real = sum(len(r.input_ids) + i for r in reqs for i in range(1, r.sampling.max_new_tokens))
        assert st.kv_slots - st.kv_pad_slots == real
        assert (st.kv_pad_slots > 0) == staggered


def test_stop_token_and_weight_update_errors(model_dir, weights):
    async def main():
        eng = TorchEngine(model_dir)  # default stop: the model's eos
        await eng.start()
        try:
            res = await eng.generate(req("s#", [1, 4], 500, seed=0))
            partial = {k: v for k, v in list(weights[1].items())[:3]}
            with pytest.raises(ValueError, match="left .* parameters unchanged"):
                await eng.update_weights([partial], version=1)
            with pytest.raises(KeyError, match="not a parameter"):
                await eng.update_weights([{"nope.weight": torch.zeros(1)}], version=1)
            return res, eng.eos_token_ids, eng.version
        finally:
            await eng.shutdown()

    res, eos, version = asyncio.run(main())
    assert res.finish_reason == "stop" and int(res.output_ids[-1]) in eos
    assert version == 0


def test_failed_weight_update_changes_nothing(model_dir, weights):
    """Regression: each bucket was validated only after the buckets before it were copied, so an update
    that failed on a later bucket left a half-new model still tagged with the old version. Now every
    bucket is checked (names, shapes, dtypes, coverage) before any weight is touched."""
    names = list(weights[1])
    first, rest = {k: weights[1][k] for k in names[:2]}, {k: weights[1][k] for k in names[2:]}
    last = names[-1]

    def broken_stream():
        yield first
        raise ConnectionError("object store lost the second bucket")

    bad_updates = {
        "missing": [first],
        "shape": [first, {**rest, last: torch.zeros(3)}],
        "name": [first, {**rest, "nope.weight": torch.zeros(1)}],
        "dtype": [first, {**rest, last: weights[1][last].to(torch.int64)}],
        "stream": broken_stream(),
    }

    async def main():
        eng = TorchEngine(model_dir)
        await eng.start()
        try:
            before = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
            outcomes = {}
            for why, buckets in bad_updates.items():
                try:
                    await eng.update_weights(buckets, version=1)
                    outcomes[why] = "accepted"
                except (ValueError, KeyError, TypeError, ConnectionError) as e:
                    outcomes[why] = type(e).__name__
                after = eng.model.state_dict()
                outcomes[why] += f" equal={all(torch.equal(before[k], after[k]) for k in before)} version={eng.version}"
            own = dict(eng.model.named_parameters())  # tied lm_head travels once, as the learner sends it
            good = {k: v for k, v in weights[1].items() if k in own}
            await eng.update_weights([good], version=1)  # a good update still lands
            landed = all(torch.equal(own[k], v) for k, v in good.items())
            return outcomes, landed, eng.version
        finally:
            await eng.shutdown()

    outcomes, landed, version = asyncio.run(main())
    for why, outcome in outcomes.items():
        assert outcome.endswith("equal=True version=0") and not outcome.startswith("accepted"), (why, outcome)
    assert landed and version == 1


def mixed_cache_logprobs(model_dir, weights, prompt, out_ids, k, temperature=1.0) -> np.ndarray:
    """Replay of what the engine computes for a row whose first k tokens were sampled with weights 0
    and the rest after an in-flight load of weights 1 that kept the cache: prompt + out[:k-1] go
    through weights 0 into a KV cache (out[k-1] is sampled but not yet fed at the load), then every
    later token is fed through weights 1 on top of that cache. k = 0: the row started after the load."""
    from transformers import DynamicCache

    m0, m1 = (_model(model_dir, weights[v]) for v in (0, 1))
    seq = torch.as_tensor(np.concatenate([prompt, out_ids]), dtype=torch.long)[None]
    split = len(prompt) + k - 1 if k > 0 else 0
    cache = DynamicCache(config=m0.config)
    kw = "cache" if "cache" in inspect.signature(m0.forward).parameters else "past_key_values"
    with torch.no_grad():
        parts = [m0(seq[:, :split], use_cache=True, **{kw: cache}).logits[0]] if split else []
        parts.append(m1(seq[:, split:-1], use_cache=True, **{kw: cache}).logits[0])
    lp = torch.log_softmax(torch.cat(parts).float() / temperature, -1)
    return lp[len(prompt) - 1 :].gather(-1, torch.as_tensor(out_ids, dtype=torch.long)[:, None])[:, 0].numpy()


def _model(model_dir, state):
    if id(state) not in _MODELS:
        _MODELS[id(state)] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _MODELS[id(state)].load_state_dict(state)
    return _MODELS[id(state)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_in_flight_update_keeps_the_cache_and_records_the_engines_own_logprobs(model_dir, weights, device):
    """on_weight_update=continue: rows keep their KV cache across the load (nothing re-prefilled),
    versions switch exactly at the load, and each logprob is the engine's forward over the mixed cache
    (replayed on CPU)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(5)
    reqs = [req(f"k{i}#", rng.integers(4, 14, size=int(rng.integers(2, 12))), int(rng.integers(80, 140)), seed=50 + i)
            for i in range(6)]

    async def main():
        eng = TorchEngine(model_dir, device=device, max_running=4, max_batch_tokens=256, eos_token_ids=())
        await eng.start()
        try:
            async def one(i, r):
                await asyncio.sleep(0.003 * i)
                return await eng.generate(r)

            tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(reqs)]
            while eng.stats().generated_tokens < 30:
                await asyncio.sleep(0.002)
            await eng.pause()  # hold the engine at a step boundary to count the tokens sampled before the load
            before = eng.stats().generated_tokens
            await eng.update_weights_in_flight([weights[1]], version=1)
            await eng.resume()
            return await asyncio.gather(*tasks), before, eng.stats()
        finally:
            await eng.shutdown()

    results, before, stats = asyncio.run(main())
    assert stats.reprefill_tokens == 0
    assert stats.prefill_tokens == sum(len(r.input_ids) for r in reqs)  # every prompt prefilled once, nothing again
    ks, kept = [], 0
    for r, res in zip(reqs, results):
        v = res.versions
        assert len(res.output_ids) == r.sampling.max_new_tokens and set(v.tolist()) <= {0, 1}
        assert np.all(np.diff(v) >= 0), "versions decreased along a response"
        k = int((v == 0).sum())
        ks.append(k)
        np.testing.assert_allclose(res.logprobs, mixed_cache_logprobs(model_dir, weights, r.input_ids, res.output_ids, k),
                                   atol=TOL, err_msg=r.request_id)
        if 0 < k < len(v):  # a re-prefilled row would match weights 1 teacher-forced instead
            rebuilt = teacher_forced(model_dir, weights[1], r.input_ids, res.output_ids)
            kept += np.abs(res.logprobs[k:] - rebuilt[k:]).max() > 1e-3
    assert sum(ks) == before  # the switch is exactly at the load: every token before it is version 0
    assert kept >= 2 and any(k == 0 for k in ks)  # rows running across the load, and rows started after it
