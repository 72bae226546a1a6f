"""Multi-turn rollouts across interruptions (actors/agents/, on the real store and torch engine): every
model token keeps the logprob and version that sampled it when weight updates and APRIL early stops
cut a response inside a model turn or inside a tool call (recomputed under that version's weights,
and replayed through the engine's own forwards), and a resumed trajectory equals an uninterrupted
one in its tokens. The rest of the multi-turn tests: tests/test_agents.py.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from functools import partial

import numpy as np
import pytest
import torch

from async_april.data import PromptDataset
from async_april.rollout.store import RolloutStore
from tests.agent_envs import GatedReverseEnv, SlowReverseEnv
from tests.agent_helpers import (  # noqa: F401 - model_dir and tokenizer are fixtures
    LocalStore, env_row, fresh_sample, make_actor, make_cfg, model_dir, tokenizer, turn_rows)

# -------------------------------------------------------- provenance across forced interruptions


def run_actor_during(actor, store: LocalStore, control, groups: int) -> None:
    """Run the generation actor's own loop while `control()` (a coroutine function) acts on it, then
    until the store holds `groups` complete groups (60 s at most); stop the actor and its engine."""

    async def go():
        await actor.start()
        loop = asyncio.create_task(actor.run())
        try:
            await control()
            t0 = time.monotonic()
            while len(store.store.completed) < groups and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.05)
        finally:
            await actor.stop()
            loop.cancel()
            await actor.engine.shutdown()

    asyncio.run(go())


def mid_turn_now(actor) -> bool:
    """Whether the actor's torch engine runs a row that has sampled a few tokens of its turn and has
    budget left: an abort sent now cuts it inside the turn. (The engine's own list of running rows,
    read from this thread: a test's window on the engine, never written.)"""
    return any(0 < len(r.ids) <= 5 for r in list(actor.engine._running))


def tool_call_now() -> bool:
    """Whether a SlowReverseEnv step is running: an abort sent now lands between two model turns."""
    return SlowReverseEnv.stepping > 0


async def wait_until(condition, timeout_s: float) -> None:
    """Poll `condition()` every millisecond; fail the test if it never holds."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout_s:
            name = getattr(condition, "__name__", None) or condition.func.__name__  # a function or a partial
            raise AssertionError(f"{name} never held in {timeout_s} s")
        await asyncio.sleep(0.001)


def _perturbed(state: dict, version: int) -> dict:
    """New weights for `version`; tied tensors (embedding and lm_head) stay one tensor."""
    g = torch.Generator().manual_seed(version)
    out, by_storage = {}, {}
    for k, v in state.items():
        key = v.data_ptr()
        if key not in by_storage:
            by_storage[key] = v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
        out[k] = by_storage[key]
    return out


def _write_weights(root, state, version) -> str:
    from learners.weight_sync import DiskBucketWriter

    w = DiskBucketWriter(root, version)
    w.add(state)
    return w.commit()


def test_every_model_token_keeps_its_logprob_and_version_across_interruptions(model_dir, tokenizer, tmp_path):
    """The generation actor's own loop on a real store and torch engine, a tool that takes 50 ms, and
    8 weight updates with on_weight_update=interrupt, each sent when a model turn is under way or when
    a tool call is: interruptions land inside model turns and inside environment steps. Every model token's recorded logprob equals a teacher-forced
    recomputation under the weights of its recorded version (1e-4); environment tokens carry mask 0."""
    from transformers import AutoModelForCausalLM

    from learners.logprobs import collate, response_logprobs

    cfg = make_cfg(model_dir, "tests.agent_envs:SlowReverseEnv", "rollout.on_weight_update=interrupt",
                   "rollout.batch_groups=4", "async.max_staleness=0")
    store = LocalStore(RolloutStore(cfg, PromptDataset(rows=turn_rows(tokenizer, 16), seed=0)))
    actor = make_actor(cfg, model_dir, store)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    weights = {0: base}

    async def interrupts():
        # Each update waits for the moment it must hit (inside a model turn, or inside a tool call),
        # instead of a wall-clock delay whose outcome depends on the machine's speed.
        for v in range(1, 9):
            await wait_until(partial(mid_turn_now, actor) if v % 2 else tool_call_now, timeout_s=20)
            weights[v] = _perturbed(base, v)
            await actor.update_weights(_write_weights(tmp_path / "w", weights[v], v), v)

    run_actor_during(actor, store, interrupts, groups=4)
    pushed = [s for batch in store.pushes for s in batch]
    between = [s for s in pushed if s.finish_reason == "abort" and s.env_pending]
    mid_turn = [s for s in pushed if s.finish_reason == "abort" and not s.env_pending and s.num_tokens > s.turn_start]
    assert between and mid_turn, f"interrupts landed {len(between)} times between turns and {len(mid_turn)} times mid-turn"
    done = [s for g in store.store.completed for s in g.samples]
    assert len(done) == 8 and all(s.done for s in done)
    assert sum(s.num_resumes > 0 for s in done) >= 2
    checked = 0
    for s in done:
        mask = s.model_mask
        assert (~mask).any() and s.turns >= 1
        assert np.all(s.behavior_logprobs[~mask] == 0)
        assert np.all(np.diff(s.model_versions) >= 0)
        for v in np.unique(s.model_versions):
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model.load_state_dict(weights[int(v)])
            mb = collate([np.concatenate([s.prompt_ids, s.response_ids])], np.array([len(s.prompt_ids)]),
                         [s.behavior_logprobs], np.zeros(1))
            with torch.no_grad():
                lp = response_logprobs(model.eval(), mb, 1.0)[0].numpy()
            sel = mask & (s.versions == v)
            np.testing.assert_allclose(lp[sel], s.behavior_logprobs[sel], atol=1e-4)
            checked += int(sel.sum())
    assert checked == sum(int(s.model_mask.sum()) for s in done)
    assert len({int(v) for s in done for v in s.model_versions}) > 1, "no response spans several versions"


def replayed_logprobs(models: dict, input_ids, output_ids, versions) -> np.ndarray:
    """What the torch engine computes for one request, replayed token by token: the input is prefilled
    by the weights of the first output token's version, and each later output token comes from
    feeding the one before it through the weights of its own version on top of the cache so far (an
    in-flight load, `continue`, changes the weights between two tokens and keeps the cache)."""
    from transformers import DynamicCache

    first = models[int(versions[0])]
    kw = "cache" if "cache" in inspect.signature(first.forward).parameters else "past_key_values"
    cache = DynamicCache(config=first.config)
    out = []
    with torch.no_grad():
        logits = first(torch.as_tensor(np.asarray(input_ids), dtype=torch.long)[None], use_cache=True, **{kw: cache}).logits
        for i, tok in enumerate(output_ids):
            if i:
                fed = torch.tensor([[int(output_ids[i - 1])]])
                logits = models[int(versions[i])](fed, use_cache=True, **{kw: cache}).logits
            out.append(float(torch.log_softmax(logits[0, -1].float(), -1)[int(tok)]))
    return np.asarray(out)


@pytest.mark.parametrize("policy", ["interrupt", "continue"])
def test_early_stops_and_loads_across_turns_keep_every_tokens_provenance(model_dir, tokenizer, tmp_path, policy):
    """APRIL early stops land inside model turns and inside environment steps, and weights load with
    on_weight_update=interrupt or continue (with continue a load lands inside a model turn and the turn
    goes on over the cache the old weights computed). Every engine request's logprobs equal a replay
    of the engine's own forwards (1e-4), and every trajectory that completes carries, for its model
    tokens, exactly the tokens, logprobs and versions its requests returned, in order, across its
    resumes; the early-stopped partials come back only under newer weights."""
    from transformers import AutoModelForCausalLM

    # 12 groups may start (max_staleness 2, over_provision 3 at learner version 0): fresh work is
    # there to lease while an early stop's partials wait for newer weights.
    cfg = make_cfg(model_dir, "tests.agent_envs:SlowReverseEnv", f"rollout.on_weight_update={policy}",
                   "rollout.batch_groups=4", "async.max_staleness=2", "rollout.over_provision=3")
    store = LocalStore(RolloutStore(cfg, PromptDataset(rows=turn_rows(tokenizer, 16), seed=0)))
    actor = make_actor(cfg, model_dir, store)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    weights = {0: base}
    requests: list[tuple[str, np.ndarray, object]] = []  # (sample uid, input ids, engine result), in order
    generate = actor.engine.generate

    async def recorded(req):  # the real engine's generate, its requests and results kept for the replay
        res = await generate(req)
        requests.append((req.request_id.split("/")[1], np.asarray(req.input_ids), res))
        return res

    actor.engine.generate = recorded

    async def decoding():  # until the engine has sampled two more tokens (or 2 s without any)
        before, t0 = actor.engine.stats().generated_tokens, time.monotonic()
        while actor.engine.stats().generated_tokens < before + 2 and time.monotonic() - t0 < 2:
            await asyncio.sleep(0.001)

    async def load(v):
        weights[v] = _perturbed(base, v)
        await actor.update_weights(_write_weights(tmp_path / "w", weights[v], v), v)

    async def early_stops_and_loads():
        for v in range(1, 9):
            await decoding()  # with continue, the load lands inside a model turn
            await load(v)
            # Each early stop waits for the moment it must hit (inside a model turn, or inside a tool
            # call), not for a wall-clock delay whose outcome depends on the machine's speed.
            await wait_until(partial(mid_turn_now, actor) if v % 2 else tool_call_now, timeout_s=20)
            await actor.early_stop()  # its partials wait for the next load
        await load(9)

    run_actor_during(actor, store, early_stops_and_loads, groups=12)
    early = [s for batch in store.early_pushes for s in batch]
    between = [s for s in early if s.env_pending]
    mid_turn = [s for s in early if not s.env_pending and s.num_tokens > s.turn_start]
    assert between and mid_turn, f"early stops landed {len(between)} times between turns and {len(mid_turn)} times mid-turn"
    spanning = [res for _, _, res in requests if len(set(res.versions)) > 1]
    if policy == "continue":
        assert spanning, "no load landed inside a model turn"
    else:
        assert not spanning, "interrupt let a request run across a load"

    models = {}
    for v, state in weights.items():
        models[v] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        models[v].load_state_dict(state)
        models[v].eval()
    for _, input_ids, res in requests:
        if len(res.output_ids):
            np.testing.assert_allclose(res.logprobs, replayed_logprobs(models, input_ids, res.output_ids, res.versions), atol=1e-4)

    done = [s for g in store.store.completed for s in g.samples]
    assert len(done) == 24 and all(s.done for s in done) and not store.store.partials
    assert sum(s.num_resumes > 0 for s in done) >= 4
    for s in done:
        mine = [res for uid, _, res in requests if uid == s.uid]
        mask = s.model_mask
        np.testing.assert_array_equal(s.response_ids[mask], np.concatenate([r.output_ids for r in mine]))
        np.testing.assert_array_equal(s.behavior_logprobs[mask], np.concatenate([r.logprobs for r in mine]))
        np.testing.assert_array_equal(s.versions[mask], np.concatenate([r.versions for r in mine]))
        assert s.turns >= 1 and (~mask).any() and np.all(s.behavior_logprobs[~mask] == 0)
    assert len({int(v) for s in done for v in s.model_versions}) > 1, "no response spans several versions"
    final = {s.uid: s for s in done}
    for p in early:  # resumed only under newer weights: the first model token after the cut is newer
        k = p.num_model_tokens
        if 0 < k < final[p.uid].num_model_tokens:  # (a step that ended the episode adds no model token)
            assert final[p.uid].model_versions[k] > p.model_versions.max()


# ------------------------------------------------------------------- resume equals uninterrupted


async def _run_with_abort(actor, sample, where: str):
    """Run `sample` through the actor's turn loop, abort it once `where` ('step': inside an environment
    step, which waits for the test; 'turn': a few tokens into a model turn after the first), then resume
    it to its end. Returns (pending step?, tokens into the cut turn)."""
    env = actor.agent.env
    before = actor.engine.stats().generated_tokens
    task = asyncio.create_task(actor.agent.run(sample, env_row(actor, sample)))
    if where == "step":
        await asyncio.to_thread(type(env).entered.wait, 30)
    else:
        type(env).release.set()
        t0 = time.monotonic()
        # The engine's count minus the sample's model tokens: tokens of the turn running now.
        while not (sample.turns >= 1 and actor.engine.stats().generated_tokens - before - sample.num_model_tokens >= 3):
            assert time.monotonic() - t0 < 30 and not task.done()
            await asyncio.sleep(0.001)
    actor.aborting.add(sample.uid)
    actor.agent.abort([sample.uid])
    await actor.engine.abort_all()
    await task
    actor.aborting.discard(sample.uid)
    type(env).release.set()
    assert sample.finish_reason == "abort"
    cut = (sample.env_pending, sample.num_tokens - sample.turn_start)
    sample.num_resumes += 1
    await actor.agent.run(sample, env_row(actor, sample))
    return cut


@pytest.mark.parametrize("where,temperature", [("step", 1.0), ("turn", 1e-3)])
def test_a_resumed_trajectory_equals_the_uninterrupted_one(model_dir, tokenizer, where, temperature):
    """Cut inside an environment step (sampled at T=1: the next turn's seed depends only on the tokens so
    far, so the continuation is the same) or inside a model turn (near-greedy, T=1e-3: a resumed turn
    draws with a new seed, as single-turn resumes do). Same tokens, masks and turns; the logprobs agree."""
    cfg = make_cfg(model_dir, "tests.agent_envs:GatedReverseEnv", f"rollout.temperature={temperature}",
                   "rollout.agent.max_turn_tokens=24", "rollout.max_new_tokens=100")
    actor = make_actor(cfg, model_dir)
    row = turn_rows(tokenizer, 8, seed=11)[2]
    assert len(row.answer.split(",")) >= 3

    async def go():
        await actor.start()
        try:
            GatedReverseEnv.release.set()
            ref = fresh_sample(row)
            await actor.agent.run(ref, env_row(actor, ref))
            GatedReverseEnv.entered.clear()
            GatedReverseEnv.release.clear()
            # A turn runs on the engine's own thread: on a loaded machine it can end before the abort reaches
            # it (the abort then lands in the next step). Run the episode again until the cut is where asked.
            for _ in range(5):
                got = fresh_sample(row)
                cut = await _run_with_abort(actor, got, where)
                if where == "step" or not cut[0]:
                    break
                GatedReverseEnv.entered.clear()
                GatedReverseEnv.release.clear()
            return ref, got, cut
        finally:
            GatedReverseEnv.release.set()
            await actor.engine.shutdown()

    ref, got, (pending, in_turn) = asyncio.run(go())
    if where == "step":
        assert pending, "the abort did not land inside an environment step"
    else:
        assert not pending and in_turn > 0, "the abort did not land inside a model turn"
    assert ref.done and got.done and got.num_resumes == 1
    np.testing.assert_array_equal(got.response_ids, ref.response_ids)
    np.testing.assert_array_equal(got.loss_mask, ref.loss_mask)
    assert (got.turns, got.env_reward, got.finish_reason) == (ref.turns, ref.env_reward, ref.finish_reason)
    np.testing.assert_allclose(got.behavior_logprobs, ref.behavior_logprobs, atol=1e-4)
