"""Multi-turn rollouts (actors/agents/): environments inside the generation actor, on real engines.

What must hold: environment tokens get no gradient and count in no normaliser; a tool that hangs
does not hold the other rollouts up; chat turn markers, the calculator example, the simulated
engine's tool episodes, checkpoints, limits and the SGLang client behave as documented. Token
provenance across interruptions and resumes: tests/test_agent_provenance.py. (Just over 400 lines:
one test per multi-turn behaviour, sharing this file's fixtures.)
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from actors.agents.env import EnvRow, EnvSpecError, load_env_class, make_env
from async_april.config import load_config
from async_april.tasks.reverse_turns import ReverseTurnsEnv
from async_april.rollout.trajectory import Sample
from tests.agent_envs import HangingToolEnv, SlowReverseEnv
from tests.agent_helpers import (  # noqa: F401 - model_dir and tokenizer are fixtures
    env_row, fresh_sample, make_actor, make_cfg, model_dir, run_episode, tokenizer, turn_rows)


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
    from async_april.rollout.batch import build_train_batch
    from async_april.rollout.trajectory import Group
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
    from async_april.run import state_codec

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
