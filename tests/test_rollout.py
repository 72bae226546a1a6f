"""Real runs through Ray (embedded cluster, torch engine, FSDP2 learner on gloo):
token provenance across interruptions, and the sync preset against a plain synchronous loop."""

import asyncio
import copy

import numpy as np
import pytest
import torch

from async_april.config import load_config
from async_april.launch.controller import train

REPO_CONFIG = "configs/tiny_cpu.yaml"
SMALL = ["rollout.batch_groups=4", "rollout.n_samples=4", "rollout.max_new_tokens=32", "rollout.concurrency=16", "logging.wandb=disabled"]


def run_and_capture(tmp_path, overrides):
    cfg = load_config(REPO_CONFIG, [f"run.dir={tmp_path}/run", *SMALL, *overrides])
    seen = {"batches": [], "weights": {}}

    def on_step(step, batch, learner):
        seen["batches"].append(batch)
        seen["weights"][learner.version] = learner.full_state_dict()

    train(cfg, on_step=on_step)
    return cfg, seen


def load_model(cfg, weights=None):
    from transformers import AutoModelForCausalLM

    from async_april.models.paths import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(cfg.model.path, cfg.model.cache_dir)), dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(weights, strict=False)
    return model.eval()


def learner_logprobs(model, batch, rows, temperature):
    """The learner's own recomputation (learners/logprobs.py) for the given rows."""
    from learners.logprobs import collate, response_logprobs

    sub = batch.select(rows)
    mb = collate(sub.input_ids, sub.prompt_lens, sub.behavior_logprobs, sub.advantages)
    with torch.no_grad():
        return response_logprobs(model, mb, temperature).numpy()


def test_every_token_keeps_the_logprob_and_version_that_sampled_it(tmp_path):
    """Async preset with interrupt-on-update: responses are cut by weight updates and resumed;
    each token's recorded logprob equals the learner's recomputation under that token's version.
    One request in flight keeps generation the slower side on any machine, so every update finds a
    response under way (with 4, a fast machine could finish the admitted groups before the learner's
    step and leave nothing for the update to cut)."""
    cfg, seen = run_and_capture(tmp_path, ["run.steps=4", "async.max_staleness=2", "rollout.on_weight_update=interrupt",
                                          "rollout.concurrency=1", "rollout.max_new_tokens=48"])
    seen["weights"][0] = load_model(cfg).state_dict()
    batches = seen["batches"]
    multi_version = 0
    checked = 0
    for batch in batches:
        for i, versions in enumerate(batch.versions):
            assert np.all(np.diff(versions) >= 0), "versions decreased along a response"
            multi_version += len(np.unique(versions)) > 1
        for v in np.unique(np.concatenate(batch.versions)):
            rows = [i for i, vs in enumerate(batch.versions) if (vs == v).any()]
            recomputed = learner_logprobs(load_model(cfg, seen["weights"][int(v)]), batch, rows, cfg.rollout.temperature)
            for r, i in enumerate(rows):
                mask = batch.versions[i] == v
                got = recomputed[r, : len(mask)][mask]
                np.testing.assert_allclose(got, batch.behavior_logprobs[i][mask], atol=1e-4)
                checked += int(mask.sum())
        lag = batch.policy_version - np.concatenate(batch.versions)
        assert lag.max() <= cfg.async_.max_staleness
    assert multi_version > 0, "no response was interrupted and resumed across a weight update"
    assert checked == sum(b.num_response_tokens for b in batches)


def sync_reference(cfg, steps):
    """The plain synchronous path, no Ray, no store: B prompts in dataset order, generate, score, train."""
    from transformers import AutoTokenizer

    from actors.engine import GenerateRequest, SamplingParams
    from actors.engines.torch_engine import TorchEngine
    from actors.generation import sampling_seed
    from async_april.algorithms.advantages import compute_advantages
    from async_april.rollout.batch import build_train_batch
    from async_april.data import load_prompts
    from async_april.models.paths import resolve_model_path
    from async_april.rewards import get_reward_fn
    from async_april.rollout.trajectory import Group, Sample
    from learners.worker import LearnerWorker

    path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    tok = AutoTokenizer.from_pretrained(path)
    data = load_prompts(cfg, tok)
    reward_fn = get_reward_fn("reverse_match")
    r = cfg.rollout
    from tests.test_learner import free_port

    worker = LearnerWorker(cfg, path, 0, 1, "127.0.0.1", free_port())  # a fixed port collided with other test runs
    engine = TorchEngine(path, max_running=r.concurrency, eos_token_ids=[tok.eos_token_id])
    out = []

    async def generate(groups):
        async def one(s):
            res = await engine.generate(GenerateRequest(
                request_id=f"ref/{s.uid}/", input_ids=s.prompt_ids, prompt_len=len(s.prompt_ids),
                sampling=SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                        stop_token_ids=(tok.eos_token_id,), seed=sampling_seed(cfg.run.seed, s))))
            s.extend(res.output_ids, res.logprobs, res.versions, res.finish_reason)
            s.reward = reward_fn(prompt="", response=tok.decode(s.response_ids, skip_special_tokens=True), answer=s.answer)
        await asyncio.gather(*(one(s) for g in groups for s in g.samples))

    async def main():
        await engine.start()
        for step in range(steps):
            groups = []
            for p in range(step * r.batch_groups, (step + 1) * r.batch_groups):
                row = data.row(p)
                groups.append(Group(p, [Sample(p, i, row.prompt_ids, answer=row.answer) for i in range(r.n_samples)]))
            await generate(groups)
            rewards = np.stack([g.rewards for g in groups])
            adv = compute_advantages(rewards, cfg.algorithm.advantage, cfg.algorithm.adv_eps)
            metrics = worker.train_step(build_train_batch(groups, adv, worker.get_version()))
            out.append({"reward": float(rewards.mean()), "loss": metrics["loss/policy"]})
            await engine.update_weights([worker.full_state_dict()], worker.get_version())
        await engine.shutdown()

    try:
        asyncio.run(main())
        return out, worker.full_state_dict()
    finally:
        worker.shutdown()


def test_sync_preset_equals_the_plain_synchronous_loop(tmp_path):
    import json

    steps = 3
    overrides = ["run.steps=3", "async.max_staleness=0", "rollout.over_provision=1", "rollout.early_stop=false",
                 "rollout.on_weight_update=drain"]
    cfg, seen = run_and_capture(tmp_path, overrides)
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    ref, ref_weights = sync_reference(copy.deepcopy(cfg), steps)
    for got, want in zip(rows, ref):
        assert got["rollout/reward_mean"] == pytest.approx(want["reward"], abs=1e-6)
        assert got["loss/policy"] == pytest.approx(want["loss"], abs=1e-5)
        assert got["staleness/max"] == 0
    final = seen["weights"][steps]
    for name, w in ref_weights.items():
        torch.testing.assert_close(final[name], w, atol=1e-5, rtol=0)
