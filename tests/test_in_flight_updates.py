"""rollout.on_weight_update=continue outside the torch engine's own tests (tests/test_torch_engine.py)
and the SGLang client's (tests/test_sglang_conformance.py, test_12): the simulated engine's re-prefill
cost, staleness with versions that change mid-response, and a real run through the generation actor."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from actors.engine import GenerateRequest, SamplingParams
from actors.engines.simulated import SimulatedEngine
from async_april.algorithms.metrics import staleness_metrics
from async_april.config import load_config
from async_april.rollout.trajectory import Sample
from tests.test_store import finish, make_store


def _run_simulated(tmp_path, in_flight: bool):
    hist = tmp_path / "h.json"
    hist.write_text('{"300": 1}')
    prompt = np.arange(1, 41, dtype=np.int64)

    async def main():
        eng = SimulatedEngine(str(hist), time_scale=0.02)
        await eng.start()
        try:
            task = asyncio.create_task(eng.generate(GenerateRequest("s#", prompt, SamplingParams(1000, seed=3), prompt_len=40)))
            while eng.stats().generated_tokens < 50:
                await asyncio.sleep(0.002)
            load = eng.update_weights_in_flight if in_flight else eng.update_weights
            await load([{}], version=1)
            res = await task
            return res, eng.stats(), eng.sim_time_s, eng.latency
        finally:
            await eng.shutdown()

    return asyncio.run(main())


def test_simulated_engine_costs_a_rebuilt_cache_and_not_an_in_flight_update(tmp_path):
    kept, kept_stats, kept_s, lat = _run_simulated(tmp_path, in_flight=True)
    rebuilt, rebuilt_stats, rebuilt_s, _ = _run_simulated(tmp_path, in_flight=False)
    for res in (kept, rebuilt):
        assert res.finish_reason == "stop" and len(res.output_ids) == 300
        k = int((res.versions == 0).sum())
        assert 50 <= k < 300 and np.all(res.versions[k:] == 1) and np.all(np.diff(res.versions) >= 0)
    assert kept_stats.reprefill_tokens == 0 and kept_stats.prefill_tokens == 40
    k = int((rebuilt.versions == 0).sum())
    assert rebuilt_stats.reprefill_tokens == 40 + k  # the prompt and every token generated before the load
    assert rebuilt_stats.prefill_tokens == 40 + rebuilt_stats.reprefill_tokens
    # Same decode steps either way; the rebuild adds exactly its prefill time (prefill tokens x per-token time).
    assert rebuilt_s - kept_s == pytest.approx(lat.prefill_s_per_token * rebuilt_stats.reprefill_tokens, rel=1e-6)


def test_staleness_reads_the_oldest_token_when_versions_change_inside_a_response():
    st = make_store(**{"async.max_staleness": 1, "rollout.over_provision": 3})  # B = 2 groups of n = 2
    work = st.lease("a", 4, engine_version=0)
    assert [s.prompt_index for s in work] == [0, 0, 1, 1]
    # Group 0: one response crossed two in-flight updates inside one segment (0 -> 1 -> 2), never resumed.
    work[0].extend(np.arange(5), -np.ones(5), np.array([0, 0, 1, 2, 2]), "stop")
    work[0].reward = 0.0
    finish(work[1], version=2)
    finish(work[2], version=1)  # group 1: oldest token version 1
    finish(work[3], version=2)
    st.push("a", work)
    g0 = next(g for g in st.completed if g.prompt_index == 0)
    assert g0.min_version() == 0 and work[0].num_resumes == 0
    assert staleness_metrics([s.versions for s in g0.samples], 2)["staleness/token_lag_max"] == 2
    st.set_version(2)
    # At version 2 group 0's oldest token lags 2 > eta = 1 (its last and newest tokens do not), so it is requeued;
    # group 1 lags 1 and waits for a second group.
    assert st.try_get_batch() is None
    assert st.counters.requeued_groups == 1 and st.counters.stale_tokens_discarded == 5 + 3
    assert [g.prompt_index for g in st.completed] == [1]
    st.check_accounting()


def test_a_segment_whose_version_decreases_is_refused():
    s = Sample(prompt_index=0, sample_index=0, prompt_ids=np.array([1, 2]))
    s.extend(np.arange(3), np.zeros(3), np.array([0, 1, 1]), "abort")
    with pytest.raises(ValueError, match=r"version went backwards \(2 -> 1\)"):
        s.extend(np.arange(3), np.zeros(3), np.array([1, 2, 1]), "stop")
    with pytest.raises(ValueError, match=r"version went backwards \(1 -> 0\)"):
        s.extend(np.arange(2), np.zeros(2), np.array([0, 1]), "stop")


@pytest.mark.parametrize("policy", ["continue", "interrupt"])
def test_the_generation_actor_continues_or_interrupts_and_counts_reprefill(tmp_path, policy, ray_cluster):
    """A real run (embedded Ray, generation actor, store; simulated engine and learner so that no model
    is loaded): with continue, responses cross weight updates inside one request and nothing is
    re-prefilled; with interrupt they are resumed and every resume's prompt + partial is counted."""
    from learners.simulated import SimulatedLearner

    from async_april.launch.controller import train

    cfg = load_config("configs/presets/async.yaml", [
        f"run.dir={tmp_path}/run", "run.steps=3", "rollout.engine=simulated", "rollout.simulated_lengths=lognormal",
        "rollout.simulated_time_scale=0.05", "rollout.max_new_tokens=2000", "rollout.batch_groups=4", "rollout.n_samples=4",
        "rollout.concurrency=16", f"rollout.on_weight_update={policy}", "run.pin_cpus=false", "logging.wandb=disabled",
        "checkpoint.every=0"])
    seen = []
    train(cfg, on_step=lambda step, batch, learner: seen.append(batch),
          learner_factory=lambda *_: SimulatedLearner(step_s=2.0, time_scale=0.05))
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    versions = [v for b in seen for v in b.versions]
    assert all(np.all(np.diff(v) >= 0) for v in versions)
    assert all(r["staleness/max"] <= cfg.async_.max_staleness for r in rows)
    spanning = sum(v[0] != v[-1] for v in versions)
    resumed = sum(r["rollout/resumed_samples"] for r in rows)
    if policy == "continue":
        assert spanning > 0 and resumed == 0 and rows[-1]["rollout/reprefill_tokens"] == 0
    else:
        assert resumed > 0 and rows[-1]["rollout/reprefill_tokens"] > 0
