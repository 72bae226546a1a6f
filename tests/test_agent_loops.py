"""Agent loops (`rollout.env: module:function`, actors/agents/loop.py) and held-out evaluation of
multi-turn episodes, on the real torch engine and generation actor: a loop gives the episodes of the
equivalent environment, resumes from its record without rerunning a finished tool call, handles its
tools' failures, and says what to fix when it cannot work; evaluation runs episodes through the same
environment."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from actors.agents.env import EnvRow, EnvSpecError, load_env_class, make_env
from tests.agent_helpers import (  # noqa: F401 - model_dir and tokenizer are fixtures
    env_row, fresh_sample, make_actor, make_cfg, model_dir, run_episode, tokenizer, turn_rows)


def test_an_agent_loop_gives_the_episodes_of_the_equivalent_environment(model_dir, tokenizer):
    """`rollout.env: module:function`: the reverse_turns task written as an `async def loop(ctx, row)`
    runs through the same turn loop, on the same engine and seeds, to the same episode, token for token
    (sampled at T=1), with the same masks, turns and reward as the environment class."""
    row = turn_rows(tokenizer, 8, seed=11)[2]
    got = {}
    for env in ("builtin:reverse_turns", "tests.agent_envs:reverse_turns_loop"):
        cfg = make_cfg(model_dir, env, "rollout.agent.max_turn_tokens=24", "rollout.max_new_tokens=100")
        got[env] = asyncio.run(run_episode(make_actor(cfg, model_dir), row))
    a, b = got.values()
    assert a.done and a.turns >= 2
    np.testing.assert_array_equal(b.response_ids, a.response_ids)
    np.testing.assert_array_equal(b.loss_mask, a.loss_mask)
    np.testing.assert_array_equal(b.behavior_logprobs, a.behavior_logprobs)
    assert (b.turns, b.finish_reason) == (a.turns, a.finish_reason)
    assert b.env_reward == pytest.approx(a.env_reward, abs=1e-12)


def test_an_agent_loop_resumes_from_its_record_and_never_reruns_a_finished_call(model_dir, tokenizer):
    """An abort lands while the loop's tool call runs. The resume replays the loop over the recorded turns
    and call results: the same episode as an uninterrupted run, the interrupted call run again, and no
    finished call ever run twice (the uninterrupted run calls the tool once per turn, too)."""
    from tests.agent_envs import GatedLookup

    cfg = make_cfg(model_dir, "tests.agent_envs:gated_tool_loop", "rollout.agent.max_turn_tokens=24", "rollout.max_new_tokens=100")
    actor = make_actor(cfg, model_dir)
    row = turn_rows(tokenizer, 8, seed=11)[2]

    async def go():
        await actor.start()
        try:
            GatedLookup.release.set()
            ref = fresh_sample(row)
            await actor.agent.run(ref, env_row(actor, ref))
            ref_runs = list(GatedLookup.runs)
            GatedLookup.runs.clear()
            GatedLookup.release.clear()
            # Abort inside the second turn's tool call.
            got = fresh_sample(row)
            task = asyncio.create_task(actor.agent.run(got, env_row(actor, got)))
            for _ in range(2):
                GatedLookup.entered.clear()
                await asyncio.to_thread(GatedLookup.entered.wait, 30)
                if len(GatedLookup.runs) == 1:
                    GatedLookup.release.set()
                    await asyncio.sleep(0)
                    GatedLookup.release.clear()
            actor.aborting.add(got.uid)
            actor.agent.abort([got.uid])
            await task
            actor.aborting.discard(got.uid)
            assert got.finish_reason == "abort" and got.env_pending and got.turns == 1
            GatedLookup.release.set()
            got.num_resumes += 1
            await actor.agent.run(got, env_row(actor, got))
            return ref, ref_runs, got, list(GatedLookup.runs)
        finally:
            GatedLookup.release.set()
            await actor.engine.shutdown()

    ref, ref_runs, got, got_runs = asyncio.run(go())
    chunks = row.answer.split(",")
    assert ref.done and ref.turns == len(chunks) >= 3 and ref_runs == chunks
    # The second chunk's call was cut and run again on resume; every other call ran once.
    assert got_runs == [chunks[0], chunks[1], chunks[1], *chunks[2:]]
    assert got.done and got.num_resumes == 1
    np.testing.assert_array_equal(got.response_ids, ref.response_ids)
    np.testing.assert_array_equal(got.loss_mask, ref.loss_mask)
    assert (got.turns, got.finish_reason) == (ref.turns, ref.finish_reason)
    assert got.env_reward == pytest.approx(ref.env_reward, abs=1e-12) and ref.env_reward > 0


def test_an_agent_loop_that_is_not_deterministic_fails_its_step_saying_so(tokenizer):
    from actors.agents.loop import LoopDiverged

    env = make_env("tests.agent_envs:unseeded_loop", tokenizer, {})
    row = EnvRow(prompt="1=", prompt_ids=np.array([1, 5, 14]), answer="1", extra={}, seed=0)
    state = env.reset(row).state
    state = env.step(state, np.array([5, 2])).state
    with pytest.raises(LoopDiverged, match="deterministic"):
        env.step(state, np.array([6, 2]))


def test_an_agent_loops_tool_failures_are_its_to_handle_and_are_replayed_not_rerun(tokenizer):
    """A call that times out (timeout_s) or raises reaches the loop as ToolFailed, which chooses the
    observation; the failure is recorded, so later replays raise it again at that call without running
    the tool (a hung tool is never waited for twice)."""
    from tests.agent_envs import FlakyTool

    FlakyTool.runs.clear()
    FlakyTool.unblock.clear()
    env = make_env("tests.agent_envs:flaky_tool_loop", tokenizer, {})
    row = EnvRow(prompt="1=", prompt_ids=np.array([1, 5, 14]), answer="1", extra={}, seed=0)
    state, steps = env.reset(row).state, []
    try:
        t0 = time.monotonic()
        for turn in range(1, 5):
            step = env.step(state, np.array([4 + turn, 2]))
            state = step.state
            steps.append(step)
        elapsed = time.monotonic() - t0
    finally:
        FlakyTool.unblock.set()
    assert [s.observation_ids.tolist() for s in steps[:3]] == [[5, 1], [6, 7], [6, 8]]
    assert [s.reward for s in steps] == [0.0, -0.25, -0.25, 1.0] and steps[-1].done
    assert FlakyTool.runs == [1, 2, 3, 4]  # each call ran once; replays served the record, failures too
    assert elapsed < 2.0, f"a replay waited for the hung tool again ({elapsed:.1f}s)"
    assert [c[2] is not None for c in state["calls"]] == [False, True, True, False]
    assert "timed out after 0.2s" in state["calls"][1][2] and "ConnectionError: sandbox unreachable" in state["calls"][2][2]


def test_an_agent_loop_call_must_return_plain_data(tokenizer):
    env = make_env("tests.agent_envs:object_result_loop", tokenizer, {})
    row = EnvRow(prompt="1=", prompt_ids=np.array([1, 5, 14]), answer="1", extra={}, seed=0)
    with pytest.raises(TypeError, match=r"returned an object of type object at \['answer'\]\[1\]; .* plain data"):
        env.step(env.reset(row).state, np.array([5, 2]))


@pytest.mark.parametrize("name,message", [
    ("tests.agent_envs:plain_loop", "async def loop"),
    ("tests.agent_envs:one_argument_loop", "loop\\(ctx, row\\)"),
])
def test_agent_loop_names_that_cannot_work_say_what_to_fix(name, message):
    with pytest.raises(EnvSpecError, match=message):
        load_env_class(name)


# ------------------------------------------------------------------------------------ evaluation


def test_evaluation_runs_held_out_episodes_through_the_environment(model_dir, tokenizer):
    """With rollout.env each held-out response is an episode through the same turn loop and environment:
    the greedy score of each prompt is the env reward of the (near-)greedy episode the generation actor runs,
    sampled episodes are seeded (a second evaluation at the same version repeats them), lengths count
    model tokens, and every token is at the evaluated version."""
    from actors.evaluation import EvalActor
    from async_april.evaluation import EvalSet

    extra = ("rollout.agent.max_turn_tokens=24", "rollout.max_new_tokens=100")
    cfg = make_cfg(model_dir, "builtin:reverse_turns", *extra, "eval.samples=2", "eval.greedy=true", "eval.temperature=1.0")
    rows = turn_rows(tokenizer, 8, seed=11)[:4]
    actor = EvalActor(cfg, model_dir, [EvalSet("turns", rows)], nice=0)

    async def go():
        try:
            return await actor.evaluate(None, 0), await actor.evaluate(None, 0)
        finally:
            await actor.stop()
            await actor.engine.shutdown()

    (a,), (b,) = asyncio.run(go())
    assert a.rewards.shape == (4, 2) and a.greedy_rewards.shape == (4,)
    np.testing.assert_array_equal(a.rewards, b.rewards)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    assert np.all((a.rewards >= 0) & (a.rewards <= 1)) and a.rewards.std() > 0
    greedy = make_cfg(model_dir, "builtin:reverse_turns", *extra, "rollout.temperature=1e-4")  # argmax, in effect
    episodes = [asyncio.run(run_episode(make_actor(greedy, model_dir), row)) for row in rows]
    np.testing.assert_allclose(a.greedy_rewards, [e.env_reward for e in episodes], atol=1e-12)
    assert max(e.turns for e in episodes) >= 2
    # Lengths are model tokens: an episode of several turns has environment tokens beside them.
    assert np.all(a.lengths <= 100) and a.lengths.max() > 24


def test_an_abort_during_a_step_keeps_the_calls_that_step_had_finished(model_dir, tokenizer):
    """Regression (issue 26.3): the records of the calls a step had finished lived in state that an abort
    threw away, so the resume ran them again (a step that charges a card, then looks something up,
    charged twice). The abort lands during the first step's lookup, after its charge: on resume the
    lookup runs again, the charge never does, and the episode is the uninterrupted one."""
    from tests.agent_envs import GatedLookup, Ledger

    cfg = make_cfg(model_dir, "tests.agent_envs:charge_then_lookup_loop", "rollout.agent.max_turn_tokens=24",
                   "rollout.max_new_tokens=100")
    actor = make_actor(cfg, model_dir)
    row = turn_rows(tokenizer, 8, seed=11)[2]

    async def go():
        await actor.start()
        try:
            GatedLookup.release.set()
            ref = fresh_sample(row)
            await actor.agent.run(ref, env_row(actor, ref))
            ref_charges = list(Ledger.charges)
            Ledger.charges.clear()
            GatedLookup.runs.clear()
            GatedLookup.release.clear()
            GatedLookup.entered.clear()
            got = fresh_sample(row)
            task = asyncio.create_task(actor.agent.run(got, env_row(actor, got)))
            await asyncio.to_thread(GatedLookup.entered.wait, 30)  # the first step's lookup runs; its charge is done
            actor.aborting.add(got.uid)
            actor.agent.abort([got.uid])
            await task
            actor.aborting.discard(got.uid)
            assert got.finish_reason == "abort" and got.env_pending and got.turns == 0
            GatedLookup.release.set()
            got.num_resumes += 1
            await actor.agent.run(got, env_row(actor, got))
            return ref, ref_charges, got, list(Ledger.charges), list(GatedLookup.runs)
        finally:
            GatedLookup.release.set()
            await actor.engine.shutdown()

    Ledger.charges.clear()
    ref, ref_charges, got, charges, runs = asyncio.run(go())
    chunks = row.answer.split(",")
    assert ref_charges == list(range(len(chunks))) and len(chunks) >= 3
    assert charges == ref_charges, "a finished call of the aborted step ran again on resume"
    assert runs == [chunks[0], *chunks]  # the lookup running at the abort ran again; the others once
    assert got.done and got.turns == ref.turns
    np.testing.assert_array_equal(got.response_ids, ref.response_ids)
    assert got.env_reward == pytest.approx(ref.env_reward, abs=1e-12)
