"""Engine contract: one suite over every backend.

Backends: `torch` (built-in engine), `sglang-standin` (the SGLang HTTP client
against tests/sglang_standin.py, a STAND-IN server backed by the torch engine,
because real SGLang needs a GPU), `simulated`, and `sglang-real-gpu` (a real
SGLang server; skipped unless sglang and CUDA are present).

Every engine runs with EOS ignored so responses run to max_new_tokens unless aborted. Just over
400 lines: one contract, parametrised over the backends, reads best as one suite.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

from actors.engine import Engine, GenerateRequest, SamplingParams
from actors.engines.simulated import SimulatedEngine
pytest.importorskip("aiohttp", reason="the SGLang client and its stand-in server need aiohttp")
from actors.engines.sglang_engine import SGLangEngine
from actors.engines.torch_engine import TorchEngine
from tests.sglang_standin import make_test_model_dir

torch.set_num_threads(1)

BACKENDS = [
    "torch",
    "sglang-standin",
    "simulated",
    pytest.param("sglang-real-gpu", marks=[pytest.mark.gpu, pytest.mark.sglang]),
]


@dataclass
class Harness:
    engine: Engine
    has_weights: bool
    tokens_so_far: Callable[[], int]
    """Tokens the backend has generated so far (to abort mid-generation)."""
    model_path: str


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_test_model_dir(tmp_path_factory.getbasetemp() / "tiny-engine-model"))


@pytest.fixture
def harness(request, model_dir, tmp_path) -> Harness:
    kind = request.param
    if kind == "torch":
        eng = TorchEngine(model_dir, max_running=64, eos_token_ids=())
        return Harness(eng, True, lambda: eng.stats().generated_tokens, model_dir)
    if kind == "sglang-standin":
        srv = request.getfixturevalue("standin")
        eng = SGLangEngine(url=srv.url, sampling_overrides={"ignore_eos": True}, retries=1)
        return Harness(eng, True, lambda: srv.engine.stats().generated_tokens, model_dir)
    if kind == "simulated":
        hist = tmp_path / "lengths.json"
        hist.write_text(json.dumps({"100000": 1}))  # every response longer than any max_new_tokens here
        eng = SimulatedEngine(str(hist), time_scale=0.1, vocab_size=19)
        return Harness(eng, False, lambda: eng.stats().generated_tokens, model_dir)
    pytest.importorskip("sglang")
    if not torch.cuda.is_available():
        pytest.skip("a real SGLang server needs a CUDA GPU")
    eng = SGLangEngine(model_dir, sampling_overrides={"ignore_eos": True})
    return Harness(eng, True, lambda: 10**9, model_dir)  # no token counter: abort after a fixed delay


def run(coro_fn: Callable[[Harness], Any], h: Harness) -> Any:
    async def main():
        await h.engine.start()
        try:
            return await asyncio.wait_for(coro_fn(h), 60)
        finally:
            await h.engine.shutdown()

    return asyncio.run(main())


def req(rid: str, prompt, max_new: int, seed: int = 0, **kw) -> GenerateRequest:
    return GenerateRequest(rid, np.asarray(prompt, np.int64), SamplingParams(max_new_tokens=max_new, seed=seed, **kw))


async def wait_tokens(h: Harness, n: int, timeout: float = 20.0) -> None:
    start, t0 = h.tokens_so_far(), time.monotonic()
    await asyncio.sleep(0.05)
    while h.tokens_so_far() - start < n and time.monotonic() - t0 < timeout:
        await asyncio.sleep(0.005)


def perturbed_state(model_path: str, scale: float = 0.5) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(7)
    sd = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in sd.items()}


def two_buckets(sd: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    names = sorted(sd)
    return [{k: sd[k] for k in names[: len(names) // 2]}, {k: sd[k] for k in names[len(names) // 2 :]}]


PROMPT = [1, 5, 6, 7, 8, 9, 15]
MAX = 300


async def _abort_partial(h: Harness):
    task = asyncio.create_task(h.engine.generate(req("abort-0#", PROMPT, MAX, seed=3)))
    await wait_tokens(h, 10)
    await h.engine.abort_all()
    res = await asyncio.wait_for(task, 5)
    after = await h.engine.generate(req("after-0#", PROMPT, 4, seed=3))
    return res, after


@pytest.mark.parametrize("harness", BACKENDS, indirect=True)
def test_abort_returns_partial_tokens_and_logprobs(harness):
    res, after = run(_abort_partial, harness)
    assert res.finish_reason == "abort"
    assert 0 < len(res.output_ids) < MAX
    assert len(res.logprobs) == len(res.versions) == len(res.output_ids)
    assert np.all(res.logprobs <= 0) and np.all(np.isfinite(res.logprobs))
    assert after.finish_reason == "length" and len(after.output_ids) == 4, "engine must keep serving after abort"


async def _resume(h: Harness):
    task = asyncio.create_task(h.engine.generate(req("resume-0#", PROMPT, MAX, seed=5)))
    await wait_tokens(h, 10)
    await h.engine.abort_all()
    part = await task
    resumed_req = req("resume-1#", np.concatenate([PROMPT, part.output_ids]), MAX - len(part.output_ids), seed=6)
    resumed_req.prompt_len = len(PROMPT)
    rest = await h.engine.generate(resumed_req)
    return part, rest


@pytest.mark.parametrize("harness", BACKENDS, indirect=True)
def test_resume_generates_only_the_remainder(harness):
    part, rest = run(_resume, harness)
    assert part.finish_reason == "abort" and 0 < len(part.output_ids) < MAX
    assert rest.prompt_tokens == len(PROMPT) + len(part.output_ids), "resume input is prompt + partial"
    assert rest.finish_reason == "length"
    assert len(part.output_ids) + len(rest.output_ids) == MAX


async def _weights(h: Harness):
    before = await h.engine.generate(req("w-0#", PROMPT, 24, seed=11))
    buckets = two_buckets(perturbed_state(h.model_path)) if h.has_weights else [{}]
    await h.engine.update_weights(buckets, version=1)
    after = await h.engine.generate(req("w-1#", PROMPT, 24, seed=11))
    if h.has_weights:  # restore, so a shared server is left as found
        await h.engine.update_weights(two_buckets(perturbed_state(h.model_path, scale=0.0)), version=2)
    return before, after, h.engine.version


@pytest.mark.parametrize("harness", BACKENDS, indirect=True)
def test_weight_update_changes_outputs_and_version(harness):
    before, after, version = run(_weights, harness)
    assert set(before.versions.tolist()) == {0}
    assert set(after.versions.tolist()) == {1}
    assert version == (2 if harness.has_weights else 1)
    if harness.has_weights:
        changed = not np.array_equal(before.output_ids, after.output_ids) or not np.allclose(before.logprobs, after.logprobs)
        assert changed, "same seed, new weights: tokens or logprobs must change"


async def _many(h: Harness):
    rng = np.random.default_rng(0)
    lens = [int(x) for x in rng.integers(1, 40, size=32)]
    prompts = [rng.integers(4, 14, size=int(rng.integers(2, 12))) for _ in lens]
    reqs = [req(f"many-{i:03d}#", p, n, seed=i) for i, (p, n) in enumerate(zip(prompts, lens))]
    return reqs, await asyncio.gather(*(h.engine.generate(r) for r in reqs))


@pytest.mark.parametrize("harness", BACKENDS, indirect=True)
def test_many_concurrent_requests_all_finish(harness):
    reqs, results = run(_many, harness)
    for r, res in zip(reqs, results):
        assert res.request_id == r.request_id
        assert res.finish_reason == "length"
        assert len(res.output_ids) == len(res.logprobs) == len(res.versions) == r.sampling.max_new_tokens
        assert res.prompt_tokens == len(r.input_ids)


async def _stop(h: Harness):
    r = req("stop-0#", PROMPT, 200, seed=1, stop_token_ids=(4, 5, 6, 7))
    return await h.engine.generate(r)


@pytest.mark.parametrize("harness", ["torch", "sglang-standin"], indirect=True)
def test_stop_token_ends_with_stop_and_is_included(harness):
    res = run(_stop, harness)
    assert res.finish_reason == "stop"
    assert int(res.output_ids[-1]) in (4, 5, 6, 7)
    assert not set(res.output_ids[:-1].tolist()) & {4, 5, 6, 7}


def test_standin_disk_weight_update_and_a_distributed_load_without_a_group_refused(standin, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    m.load_state_dict(perturbed_state(model_dir))
    m.save_pretrained(tmp_path / "v5")

    async def main():
        eng = SGLangEngine(url=standin.url, sampling_overrides={"ignore_eos": True})
        await eng.start()
        try:
            a = await eng.generate(req("d-0#", PROMPT, 16, seed=2))
            await eng.update_weights_from_disk(str(tmp_path / "v5"), version=5)
            b = await eng.generate(req("d-1#", PROMPT, 16, seed=2))
            await eng.update_weights_from_disk(model_dir, version=6)
            c = await eng.generate(req("d-2#", PROMPT, 16, seed=2))
            with pytest.raises(Exception, match="Please call `init_weights_update_group` first"):
                await eng.update_weights_from_distributed([(["x"], ["float32"], [[1]])], version=7)
            return a, b, c
        finally:
            await eng.shutdown()

    a, b, c = asyncio.run(main())
    assert set(b.versions.tolist()) == {5} and set(c.versions.tolist()) == {6}
    assert not np.allclose(a.logprobs, b.logprobs)
    np.testing.assert_allclose(a.logprobs, c.logprobs, atol=1e-5)


def test_sglang_client_clear_error_when_server_is_down():
    async def main():
        eng = SGLangEngine(url="http://127.0.0.1:9", startup_timeout_s=1.5, retries=1, backoff_s=0.01)
        with pytest.raises(Exception, match="not healthy"):
            await eng.start()
        await eng.shutdown()

    asyncio.run(main())


def test_simulated_resume_reaches_the_same_total_as_uninterrupted():
    async def main():
        eng = SimulatedEngine("lognormal", time_scale=0.02)
        await eng.start()
        try:
            full = await eng.generate(req("s-0#", PROMPT, 4096, seed=42))
            task = asyncio.create_task(eng.generate(req("s-1#", PROMPT, 4096, seed=42)))
            while eng.stats().generated_tokens < len(full.output_ids) + 5:
                await asyncio.sleep(0.002)
            await eng.abort_all()
            part = await task
            r2 = req("s-2#", np.concatenate([PROMPT, part.output_ids]), 4096 - len(part.output_ids), seed=42)
            r2.prompt_len = len(PROMPT)
            rest = await eng.generate(r2)
            return full, part, rest
        finally:
            await eng.shutdown()

    full, part, rest = asyncio.run(main())
    assert full.finish_reason == "stop" and len(full.output_ids) > 20
    assert part.finish_reason == "abort"
    assert len(part.output_ids) + len(rest.output_ids) == len(full.output_ids)
    assert rest.finish_reason == "stop"


def test_simulated_histogram_csv_and_update_mid_generation(tmp_path):
    hist = tmp_path / "h.csv"
    hist.write_text("length,count\n50,1\n")

    async def main():
        eng = SimulatedEngine(str(hist), time_scale=0.05)
        await eng.start()
        try:
            task = asyncio.create_task(eng.generate(req("u-0#", PROMPT, 100, seed=1)))
            while eng.stats().generated_tokens < 10:
                await asyncio.sleep(0.002)
            await eng.update_weights([{}], version=3)
            return await task
        finally:
            await eng.shutdown()

    res = asyncio.run(main())
    assert res.finish_reason == "stop" and len(res.output_ids) == 50
    v = res.versions.tolist()
    assert v[0] == 0 and v[-1] == 3 and v == sorted(v)


def test_make_engine_picks_backend(model_dir):
    from actors.engines import make_engine
    from async_april.config import Config

    cfg = Config()
    cfg.rollout.engine = "simulated"
    assert isinstance(make_engine(cfg, model_dir), SimulatedEngine)
    cfg.rollout.engine = "torch"
    eng = make_engine(cfg, model_dir, device="cpu")
    assert isinstance(eng, TorchEngine) and eng.max_running == cfg.rollout.concurrency
    cfg.rollout.engine = "sglang"
    cfg.rollout.sglang.url = "http://127.0.0.1:1"
    assert isinstance(make_engine(cfg, model_dir), SGLangEngine)


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class ScriptedStore:
    """STAND-IN for the RolloutStore actor handle (`lease_async.remote(...)` / `push_async.remote(...)`
    are awaitable, as Ray's ObjectRefs are). The first lease gets `first`; the next one is answered
    only once the engine has applied the early stop's abort, with `late`: the race in which a lease
    lands after the abort. Every push is recorded with the time it arrived."""

    def __init__(self, first: list, late, aborted: asyncio.Event):
        self.first, self.late, self.aborted = list(first), late, aborted
        self.pushes: list[tuple[float, bool, list]] = []
        self.lease_async, self.push_async = _Remote(self._lease), _Remote(self._push)

    async def _lease(self, actor_id, max_items, engine_version):
        if self.first:
            out, self.first = self.first[:max_items], self.first[max_items:]
            return out
        if self.late is not None:
            await self.aborted.wait()
            out, self.late = [self.late], None
            return out
        return []

    async def _push(self, actor_id, samples, early_stop=False):
        self.pushes.append((time.monotonic(), early_stop, samples))


class AbortSignalling:
    """Delegates to an engine. Its abort_all sets `aborted` once the abort is applied and returns
    only after a request sent after the abort has reached the engine: the race made certain.
    Requests run to max_new_tokens (stop token -1 never matches), like the harness's ignore_eos."""

    def __init__(self, engine, aborted: asyncio.Event):
        self.inner, self.aborted = engine, aborted
        self.late_sent = asyncio.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request: GenerateRequest):
        request.sampling = dataclasses.replace(request.sampling, stop_token_ids=(-1,))
        if self.aborted.is_set():
            asyncio.get_running_loop().call_later(0.05, self.late_sent.set)  # once its request is on its way
        return await self.inner.generate(request)

    async def abort_all(self):
        await self.inner.abort_all()
        self.aborted.set()
        await asyncio.wait_for(self.late_sent.wait(), 10)


EARLY_MAX = 200


async def _early_stop_with_a_late_lease(h: Harness):
    from actors.generation import GenerationActor
    from async_april.config import config_from_dict
    from async_april.rollout.trajectory import Sample

    cfg = config_from_dict({"rollout": {"concurrency": 8, "max_new_tokens": EARLY_MAX}})
    mk = lambda p: Sample(prompt_index=p, sample_index=0, prompt_ids=np.asarray(PROMPT, np.int64), answer="1")  # noqa: E731
    aborted = asyncio.Event()
    store = ScriptedStore([mk(p) for p in range(4)], mk(99), aborted)
    actor = GenerationActor(cfg, "gen0", store, h.model_path, engine=AbortSignalling(h.engine, aborted))
    loop = asyncio.create_task(actor.run())
    try:
        await wait_tokens(h, 20)
        await actor.early_stop()
        returned = time.monotonic()
        late_task = actor.inflight.get("p99-s0")
        late_running = late_task is not None and not late_task.done()
        t0 = time.monotonic()
        while not any(s.uid == "p99-s0" for _, _, ss in store.pushes for s in ss) and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.02)
    finally:
        await actor.stop()
        loop.cancel()
    return returned, late_running, store.pushes


@pytest.mark.parametrize("harness", ["torch", "sglang-standin"], indirect=True)
def test_early_stop_never_waits_for_a_request_started_after_the_abort(harness):
    """Regression: early_stop aborted what was in flight, then waited `while self.inflight`, while
    run() kept leasing; a lease landing after the abort added a request that early stop then waited
    for, to its end, with old weights (the long-tail stall APRIL exists to remove). Now it waits
    for exactly the requests it aborted, and leasing is closed meanwhile."""
    returned, late_running, pushes = run(_early_stop_with_a_late_lease, harness)
    assert late_running, "early_stop returned only after the late request had finished"
    aborted = [(t, early, s) for t, early, ss in pushes for s in ss if s.prompt_index < 4]
    assert len(aborted) == 4 and all(early and s.finish_reason == "abort" and t <= returned for t, early, s in aborted)
    late = [(t, early, s) for t, early, ss in pushes for s in ss if s.prompt_index == 99]
    assert len(late) == 1
    t, early, s = late[0]
    assert t > returned and not early, "the late request is not the early stop's: it is pushed as ordinary work"
    assert s.finish_reason == "length" and s.num_tokens == EARLY_MAX, "the late request was not aborted"
