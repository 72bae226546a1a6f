"""Multi-turn rollouts (actors/agents/): environments inside the generation actor, on real engines.

What must hold: environment tokens get no gradient and count in no normaliser; every model token
keeps the logprob and version that sampled it across interruptions mid-turn and between turns
(recomputed under that version's weights); a resumed trajectory equals an uninterrupted one in
its tokens; a tool that hangs does not hold the other rollouts up.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from functools import partial

import numpy as np
import pytest
import torch

from actors.agents.env import EnvRow, EnvSpecError, load_env_class, make_env
from async_april.config import load_config
from async_april.data import PromptDataset
from async_april.store import RolloutStore
from async_april.tasks.reverse_turns import ReverseTurnsEnv
from async_april.trajectory import Sample
from tests.agent_envs import GatedReverseEnv, HangingToolEnv, SlowReverseEnv
from tests.agent_helpers import (  # noqa: F401 - model_dir and tokenizer are fixtures
    LocalStore, env_row, fresh_sample, make_actor, make_cfg, model_dir, run_episode, tokenizer, turn_rows)


# ---------------------------------------------------------------------- the environment contract


def test_env_names_resolve_or_say_what_to_fix(tokenizer):
    assert load_env_class("builtin:reverse_turns") is ReverseTurnsEnv
    assert load_env_class("tests.agent_envs:SlowReverseEnv") is SlowReverseEnv
    for spec, words in [("builtin:nope", "not a built-in"), ("no_such_module_x:Env", "cannot import module"),
                        ("tests.agent_envs:Missing", "has no attribute"), ("tests.agent_envs:NotAnEnv", "reset or step"),
                        ("tests.agent_envs:STEP_NOTE", "not a class"), ("justaname", "module:Class")]:
        with pytest.raises(EnvSpecError, match=words):
            load_env_class(spec)
    with pytest.raises(EnvSpecError, match="env_args"):
        make_env("builtin:reverse_turns", tokenizer, {"bogus": 1})


def test_reverse_turns_env_rewards_each_chunk_and_appends_ids(tokenizer):
    env = ReverseTurnsEnv(tokenizer=tokenizer)
    state = env.reset(EnvRow("314=", np.zeros(1), "314,15,926", {}, 0)).state
    ids = lambda text: np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])  # noqa: E731
    s1 = env.step(state, ids("413"))
    assert s1.reward == pytest.approx(1 / 3) and not s1.done
    assert tokenizer.decode(s1.observation_ids.tolist()) == "15="
    s2 = env.step(s1.state, ids("15"))  # wrong order: no position matches
    assert s2.reward == 0.0 and tokenizer.decode(s2.observation_ids.tolist()) == "926="
    s3 = env.step(s2.state, ids("629"))
    assert s3.done and s3.reward == pytest.approx(1 / 3) and len(s3.observation_ids) == 0


# ------------------------------------------------------------------------ masks in the learner


def test_environment_tokens_get_zero_gradient_and_count_in_no_normaliser(model_dir):
    """A real multi-turn batch through the learner's collate, logprobs and every loss aggregation: the
    loss equals the same loss computed on the model tokens alone, env tokens get exactly zero gradient,
    and the token count the learner normalises by is the model tokens'."""
    from transformers import AutoModelForCausalLM

    from async_april.algorithms.losses import LossSettings, policy_loss
    from async_april.batch import build_train_batch
    from async_april.trajectory import Group
    from learners.logprobs import collate, response_logprobs

    rng = np.random.default_rng(0)
    samples = []
    for i in range(3):
        s = Sample(prompt_index=0, sample_index=i, prompt_ids=np.array([1, 5, 6, 14]))
        for turn in range(2 + i % 2):
            n = int(rng.integers(2, 6))
            s.extend(rng.integers(4, 14, n), rng.normal(-2, 0.3, n), np.full(n, turn), "stop")
            s.observe(rng.integers(4, 15, int(rng.integers(1, 5))))
        s.reward = float(i)
        samples.append(s)
    batch = build_train_batch([Group(0, samples)], np.array([[1.0, -0.5, 0.25]]), policy_version=2)
    assert batch.loss_masks is not None
    model_tokens = sum(int(s.model_mask.sum()) for s in samples)
    env_tokens = sum(s.num_tokens for s in samples) - model_tokens
    assert env_tokens > 0 and batch.num_response_tokens == model_tokens

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mb = collate(batch.input_ids, batch.prompt_lens, batch.behavior_logprobs, batch.advantages, loss_masks=batch.loss_masks)
    assert int(mb.response_mask.sum()) == model_tokens
    lp = response_logprobs(model, mb, 1.0).detach().requires_grad_(True)
    env = (mb.response_mask == 0) & (torch.arange(lp.shape[1])[None] < torch.tensor([s.num_tokens for s in samples])[:, None])
    assert int(env.sum()) == env_tokens
    # Model tokens sampled by this very policy (ratio 1, inside the clip), so each has a gradient.
    behavior = torch.where(mb.response_mask.bool(), lp.detach(), mb.behavior_logprobs)
    for aggregation in ("token_mean", "seq_mean_token_mean", "constant"):
        settings = LossSettings(aggregation=aggregation, constant_normalizer=64.0, dual_clip=None)
        loss, _ = policy_loss(lp, behavior, mb.advantages, mb.response_mask, settings,
                              float(batch.num_response_tokens), float(len(batch)))
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.all(grad[env] == 0), f"{aggregation}: environment tokens got gradient"
        assert torch.all(grad[mb.response_mask.bool()] != 0), f"{aggregation}: a model token got no gradient"
        # The same rows with the environment tokens removed (model tokens packed to the left).
        packed = torch.zeros_like(lp)
        packed_b = torch.zeros_like(lp)
        packed_m = torch.zeros_like(mb.response_mask)
        for i in range(len(samples)):
            keep = mb.response_mask[i].bool()
            k = int(keep.sum())
            packed[i, :k], packed_b[i, :k], packed_m[i, :k] = lp[i][keep], behavior[i][keep], 1
        ref, _ = policy_loss(packed, packed_b, mb.advantages, packed_m, settings, float(model_tokens), float(len(batch)))
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    # Staleness is read from the model tokens only (environment tokens repeat a version, never add one).
    assert [len(v) for v in batch.model_versions()] == [int(s.model_mask.sum()) for s in samples]


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
        name = getattr(condition, "__name__", None) or condition.func.__name__
        assert time.monotonic() - t0 < timeout_s, f"{name} never held in {timeout_s} s"
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


# -------------------------------------------------------------------------- a tool that hangs


def test_a_timed_out_tool_does_not_block_other_rollouts(model_dir, tokenizer):
    """One prompt's tool hangs; step_timeout_s=3. The other rollouts finish while it hangs, the hung one
    ends at the timeout with the environment's on_failure (reward -1), counted in agent/step_timeouts."""
    rows = turn_rows(tokenizer, 64, seed=2)
    hang = next(r for r in rows if r.answer.startswith("0"))
    others = [r for r in rows if not r.answer.startswith("0")][:5]
    cfg = make_cfg(model_dir, "tests.agent_envs:HangingToolEnv", "rollout.agent.step_timeout_s=3.0",
                   "rollout.agent.step_concurrency=2")
    actor = make_actor(cfg, model_dir)
    finished: dict[int, float] = {}

    async def one(i, row, t0):
        s = fresh_sample(row, index=i)
        await actor.agent.run(s, env_row(actor, s))
        finished[i] = time.monotonic() - t0
        return s

    async def go():
        await actor.start()
        try:
            t0 = time.monotonic()
            return await asyncio.gather(*(one(i, r, t0) for i, r in enumerate([hang, *others])))
        finally:
            HangingToolEnv.unblock.set()
            await actor.engine.shutdown()

    samples = asyncio.run(go())
    assert samples[0].done and samples[0].env_reward == -1.0 and samples[0].turns == 1
    assert all(s.done and s.env_reward >= 0 for s in samples[1:])
    assert max(finished[i] for i in range(1, 6)) < 3.0 <= finished[0], finished
    m = actor.agent.metrics()
    assert m["agent/step_timeouts"] == 1 and m["agent/steps"] == sum(s.turns for s in samples)


# --------------------------------------------------------- chat templates and the calculator example

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml_tokenizer():
    """A character-level tokenizer with ChatML specials and template (a real chat model's shape, built offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = {" ": "\u0120", "\n": "\u010a"}  # byte-level BPE spells these two bytes as letters
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + [byte_level.get(c, c) for c in chars])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def test_chat_turn_markers_are_appended_as_ids_without_retokenising():
    from actors.agents.chat import ChatTurns

    tok = chatml_tokenizer()
    turns = ChatTurns(tok)
    obs = turns.observation('{"result": 84}', role="tool")
    assert tok.decode(obs.tolist()) == '\n<|im_start|>tool\n{"result": 84}<|im_end|>\n<|im_start|>assistant\n'
    # Prompt ids + sampled ids + observation ids = the template's rendering of the whole conversation.
    prompt = np.asarray(tok.apply_chat_template([{"role": "user", "content": "12*7?"}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"])
    sampled = np.asarray(tok("<tool_call>x</tool_call>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    whole = tok.apply_chat_template([{"role": "user", "content": "12*7?"}, {"role": "assistant", "content": "<tool_call>x</tool_call>"},
                                     {"role": "tool", "content": '{"result": 84}'}], add_generation_prompt=True, tokenize=False)
    assert np.concatenate([prompt, sampled, obs]).tolist() == tok(whole, add_special_tokens=False)["input_ids"]
    plain = build_plain_tokenizer()
    with pytest.raises(ValueError, match="chat template"):
        ChatTurns(plain)


def build_plain_tokenizer():
    from async_april.models.tiny import build_tokenizer

    return build_tokenizer()


def test_calculator_env_answers_tool_calls_and_scores_the_final_answer():
    from actors.agents.calculator import CalculatorEnv, evaluate

    tok = chatml_tokenizer()
    env = make_env("builtin:calculator", tok, {"max_calls": 2})
    assert isinstance(env, CalculatorEnv)
    ids = lambda text: np.asarray(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])  # noqa: E731
    state = env.reset(EnvRow("12*(3+4)?", np.zeros(1), "84", {}, 0)).state
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}\n</tool_call>'
    s1 = env.step(state, ids(call))
    assert not s1.done and s1.reward == 0 and '{"result": 84}' in tok.decode(s1.observation_ids.tolist())
    s2 = env.step(s1.state, ids("The answer is \\boxed{84}."))
    assert s2.done and s2.reward == 1.0
    assert env.step(s1.state, ids("It is 85.")).reward == 0.0
    with pytest.raises(ValueError):
        evaluate("__import__('os').system('true')")
    with pytest.raises(ValueError, match="exponent"):
        evaluate("10 ** 10 ** 10")
    bad = env.on_failure(s1.state, ids("<tool_call>{nope</tool_call>"), "JSONDecodeError: ...")
    assert not bad.done and '"error"' in tok.decode(bad.observation_ids.tolist())
    assert env.on_failure(bad.state, ids("x"), "again").done  # out of calls


# ---------------------------------------------------------------- simulated engine and tools


def _turn_lengths(s: Sample) -> list[int]:
    """Lengths of the model's turns (runs of loss mask 1)."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], s.model_mask.astype(int), [0]])))
    return [int(b - a) for a, b in zip(edges[::2], edges[1::2])]


def test_simulated_tool_episode_resumes_to_the_same_turns(model_dir, tokenizer):
    """On the simulated engine each turn draws its length from its own seed and its context, so a turn cut
    in the middle resumes to the length it had drawn (later turns see other sampled ids, as on a real
    engine, and draw again); the tool's observations and rewards depend on the episode's state only."""
    from actors.engines.simulated import SimulatedEngine

    scale = 0.02
    cfg = make_cfg(model_dir, "builtin:simulated_tool", "rollout.engine=simulated", "rollout.max_new_tokens=20000",
                   "rollout.agent.max_turn_tokens=4096", "rollout.agent.max_observation_tokens=64",
                   f"rollout.agent.env_args={{time_scale: {scale}, median_s: 0.5, sigma: 0.5, min_turns: 3, max_turns: 3, obs_tokens: 8}}")
    row = turn_rows(tokenizer, 1)[0]

    async def go():
        from actors.generation import GenerationActor

        actor = GenerationActor(cfg, "gen0", None, model_dir, engine=SimulatedEngine("lognormal", time_scale=scale))
        await actor.start()
        try:
            ref = fresh_sample(row)
            t0 = time.monotonic()
            await actor.agent.run(ref, env_row(actor, ref))
            ref_s, ref_tool_s = time.monotonic() - t0, actor.agent.env.sim_tool_s
            # Abort once the engine has sampled 2 tokens of the second turn. The simulated engine runs on the
            # wall clock, so on a loaded machine the turn can end before the abort is handled (or before this
            # loop looks): then the episode is run again, until an abort lands inside that turn.
            for _ in range(5):
                got, before = fresh_sample(row), actor.engine.stats().generated_tokens
                task = asyncio.create_task(actor.agent.run(got, env_row(actor, got)))
                while not task.done() and not (got.turns == 1 and not got.env_pending and actor.engine.stats().generated_tokens
                                               - before - got.num_model_tokens >= 2):
                    await asyncio.sleep(0.001)
                actor.aborting.add(got.uid)
                await actor.engine.abort_all()
                await task
                actor.aborting.discard(got.uid)
                if got.turns == 1 and not got.env_pending and got.num_tokens > got.turn_start:
                    break
            cut = got.num_tokens - got.turn_start if got.turns == 1 and not got.done else 0
            if cut:
                await actor.agent.run(got, env_row(actor, got))
            return ref, got, cut, ref_s, ref_tool_s
        finally:
            await actor.engine.shutdown()

    ref, got, cut, ref_s, ref_tool_s = asyncio.run(go())
    assert cut > 0, "the abort did not land inside the second turn"
    assert ref.done and got.done and ref.turns == got.turns == 3
    assert _turn_lengths(got)[:2] == _turn_lengths(ref)[:2] and len(_turn_lengths(got)) == 3
    np.testing.assert_array_equal(got.response_ids[~got.model_mask], ref.response_ids[~ref.model_mask])
    assert got.env_reward == ref.env_reward
    assert ref_s >= 0.9 * scale * ref_tool_s  # the episode's simulated tool time was slept


# ------------------------------------------------------------- checkpoints and a whole run


def test_a_multi_turn_partial_survives_a_checkpoint(tmp_path, no_pickle):
    """The episode's state, its pending step and its mask go through the pickle-free state files."""
    from async_april import state_codec

    s = Sample(prompt_index=3, sample_index=1, prompt_ids=np.array([1, 4, 5]), answer="12,345")
    s.extend(np.array([5, 4, 2]), np.array([-0.1, -0.2, -0.3]), np.array([0, 0, 1]), "stop")
    s.observe(np.array([6, 7, 8, 14]))
    s.extend(np.array([9]), np.array([-0.5]), np.array([2]), "abort")
    s.env_state, s.env_pending, s.turns, s.env_reward = {"chunks": ["12", "345"], "turn": 1}, True, 1, 0.5
    s.turn_begin = 7
    state_codec.save({"partials": {s.uid: s}}, tmp_path, "store")
    back = state_codec.load(tmp_path, "store")["partials"][s.uid]
    for name in ("response_ids", "behavior_logprobs", "versions", "loss_mask"):
        np.testing.assert_array_equal(getattr(back, name), getattr(s, name))
    assert (back.env_state, back.env_pending, back.turns, back.env_reward) == (s.env_state, True, 1, 0.5)
    assert back.turn_begin == back.turn_start == 7 and back.model_versions.tolist() == [0, 0, 1, 2]
    # A checkpoint written before turn boundaries were recorded: the turn starts after the last env token.
    tree, arrays = state_codec.encode(s)
    del tree["fields"]["turn_begin"]
    old = state_codec.decode(tree, lambda tag: arrays[tag["$nd"]])
    assert old.turn_begin is None and old.turn_start == 7


def test_a_multi_turn_run_trains_through_ray(tmp_path, model_dir, ray_cluster):
    """configs/tiny_cpu_multiturn.yaml end to end for 2 steps (store, actor, learner, metrics). (Held-out
    episodes: test_evaluation_runs_held_out_episodes_through_the_environment, on the same EvalActor class
    without the ~10 s of starting its Ray process.)"""
    import json

    from async_april.launch.controller import train

    cfg = load_config("configs/tiny_cpu_multiturn.yaml", [
        f"run.dir={tmp_path}/run", "run.steps=2", f"model.path={model_dir}", "run.pin_cpus=false",
        "rollout.batch_groups=2", "rollout.n_samples=4", "rollout.concurrency=8", "logging.console_every=1000"])
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["rollout/turns_mean"] >= 1 and r["rollout/env_tokens"] > 0
        assert 0 <= r["reward/env"] <= 1 and r["rollout/reward_mean"] == pytest.approx(r["reward/env"])
        assert r["train/response_tokens"] == r["rollout/tokens"]  # the learner counted model tokens only
    assert rows[-1]["agent/steps"] > 0


# ------------------------------------------------------------------------------------- limits


@pytest.mark.parametrize("limit", ["turns", "tokens"])
def test_turn_observation_and_token_limits(model_dir, tokenizer, limit):
    """An observation over max_observation_tokens and a step that raises both go to on_failure (counted);
    max_turns ends the episode with reason length; so does rollout.max_new_tokens, model and
    environment tokens together, never exceeded."""
    from tests.agent_envs import ChattyEnv

    ChattyEnv.errors.clear()
    extra = (["rollout.agent.max_turns=3", "rollout.max_new_tokens=200"] if limit == "turns"
             else ["rollout.agent.max_turns=50", "rollout.max_new_tokens=22"])
    cfg = make_cfg(model_dir, "tests.agent_envs:ChattyEnv", "rollout.agent.max_observation_tokens=12",
                   "rollout.agent.max_turn_tokens=6", *extra)
    actor = make_actor(cfg, model_dir)
    row = next(r for r in turn_rows(tokenizer, 32, seed=4) if len(r.answer.split(",")) == 4)

    s = asyncio.run(run_episode(actor, row))
    assert s.finish_reason == "length" and s.num_tokens <= cfg.rollout.max_new_tokens
    runs = np.split(s.model_mask, np.flatnonzero(np.diff(s.model_mask.astype(int))) + 1)
    assert all(len(r) <= 12 for r in runs if not r[0]), "an observation over the limit was appended"
    assert any("max_observation_tokens" in e for e in ChattyEnv.errors)
    if limit == "turns":
        assert s.turns == 3 and any("RuntimeError: tool crashed" in e for e in ChattyEnv.errors)
        assert actor.agent.metrics()["agent/step_failures"] == 2
    else:
        assert s.turns < 4  # max_turns=50 and four chunks: only the token budget can have ended it


# ------------------------------------------------------------------------- over the SGLang client


def test_a_multi_turn_episode_runs_the_same_through_the_sglang_client(model_dir, tokenizer):
    """The turn loop over the real SGLang HTTP client against the SGLang STAND-IN (tests/sglang_standin.py,
    backed by the torch engine; a real server needs a GPU): one request per turn, ids in and out, gives
    the same episode, token for token, as the torch engine in process, with the same masks and turns."""
    pytest.importorskip("aiohttp", reason="the SGLang client and its stand-in server need aiohttp")
    from actors.engines.sglang_engine import SGLangEngine
    from actors.generation import GenerationActor
    from tests.sglang_standin import StandinServer

    cfg = make_cfg(model_dir, "builtin:reverse_turns", "rollout.agent.max_turn_tokens=24", "rollout.max_new_tokens=100")
    row = turn_rows(tokenizer, 8, seed=11)[2]
    srv = StandinServer(model_dir, max_running=8)
    srv.start()

    try:
        over_http = asyncio.run(run_episode(GenerationActor(cfg, "gen0", None, model_dir, engine=SGLangEngine(url=srv.url, retries=1)), row))
        requests = list(srv.state.requests)
    finally:
        srv.stop()
    in_process = asyncio.run(run_episode(make_actor(cfg, model_dir), row))
    assert over_http.done and over_http.turns >= 2 and len(requests) == over_http.turns  # one /generate per turn
    assert requests[1]["input_ids"][: len(row.prompt_ids)] == list(row.prompt_ids)  # the whole context, as ids
    np.testing.assert_array_equal(over_http.response_ids, in_process.response_ids)
    np.testing.assert_array_equal(over_http.loss_mask, in_process.loss_mask)
    assert (over_http.turns, over_http.env_reward) == (in_process.turns, in_process.env_reward)
    np.testing.assert_allclose(over_http.behavior_logprobs, in_process.behavior_logprobs, atol=1e-4)


def test_an_empty_observation_still_ends_the_turn(model_dir, tokenizer):
    """Regression (issue 26.2): turn boundaries were read from the last environment token, so after an
    empty observation (done=False) the next step was handed every turn since the previous observation,
    or, once rollout.agent.max_turn_tokens was spent, the same tokens again with no new turn sampled.
    Each step is handed exactly its own turn; together they are the model's tokens, once each."""
    from tests.agent_envs import QuietEnv

    QuietEnv.handed.clear()
    cfg = make_cfg(model_dir, "tests.agent_envs:QuietEnv")  # max_turn_tokens=10, max_new_tokens=64
    s = asyncio.run(run_episode(make_actor(cfg, model_dir), turn_rows(tokenizer, 1)[0]))
    assert s.done and s.turns == 3 and len(QuietEnv.handed) == 3
    assert all(0 < len(t) <= 10 for t in QuietEnv.handed), [len(t) for t in QuietEnv.handed]
    assert sum(QuietEnv.handed, []) == s.response_ids[s.model_mask].tolist(), "a step was handed another step's turn"
    assert s.response_ids[~s.model_mask].tolist() == [14]  # the second step's observation, the first's was empty
