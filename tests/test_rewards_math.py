"""Math rewards (math-verify, GSM8K final answers, format) and the RewardScorer's weights,
error policy and process pool (`reward.num_workers > 0`, `score_async`)."""

from __future__ import annotations

import asyncio
import os

import pytest

from async_april.config import RewardConfig
from async_april.rewards import REGISTRY, get_reward_fn
from async_april.rewards.math import answer_tag_format, boxed_format, extract_final_number, gsm8k
from async_april.rewards.scoring import RewardError, RewardScorer

os.environ.setdefault("OMP_NUM_THREADS", "1")

MATH_TABLE = [  # (response, reference answer, expected)
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("So x = \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("Thus \\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("The final answer is $3\\pi$", "3\\pi", 1.0),
    ("Answer: 34", "34", 1.0),
    ("\\boxed{(1,2)}", "(1,2)", 1.0),
    ("\\boxed{10\\%}", "10\\%", 1.0),
    ("\\boxed{1}</s> and then \\boxed{2}", "1", 1.0),  # text after EOS is ignored
    ("\\boxed{43}", "42", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("\\boxed{(2,1)}", "(1,2)", 0.0),
    ("\\boxed{-7}", "7", 0.0),
    ("I don't know", "42", 0.0),
    ("", "42", 0.0),
    ("\\boxed{42}", "", 0.0),  # no reference: never right
    ("\\boxed{" + "9" * 3000 + "}", "1", 0.0),
    ("\\boxed{\\frac{1}{", "1", 0.0),  # unbalanced LaTeX does not raise
]


@pytest.mark.parametrize("response,answer,want", MATH_TABLE)
def test_math_verify_table(response, answer, want):
    pytest.importorskip("math_verify")
    assert get_reward_fn("math_verify")(prompt="", response=response, answer=answer) == want


GSM8K_TABLE = [
    ("She has 5 + 3 = 8 apples.\n#### 8", "Natalia sold 48/2 = 24 clips.\n#### 8", 1.0),
    ("so the total is 1,234.", "1234", 1.0),
    ("#### $18.00", "18", 1.0),
    ("The answer is 7", "#### 8", 0.0),
    ("#### 8\nWait, actually 9", "8", 1.0),  # the marked answer wins over later numbers
    ("no number here", "8", 0.0),
    ("-3", "#### -3", 1.0),
]


@pytest.mark.parametrize("response,answer,want", GSM8K_TABLE)
def test_gsm8k_table(response, answer, want):
    assert gsm8k("", response, answer) == want


def test_final_number_extraction():
    assert extract_final_number("a 1 b 2.5 c") == 2.5
    assert extract_final_number("#### 1,000") == 1000.0
    assert extract_final_number("none") is None


def test_format_rewards():
    assert boxed_format("", "so \\boxed{3}", "") == 1.0
    assert boxed_format("", "so \\boxed{}", "") == 0.0
    assert boxed_format("", "the answer is 3", "") == 0.0
    assert answer_tag_format("", "<think>..</think><answer> 3 </answer>", "") == 1.0
    assert answer_tag_format("", "<answer></answer>", "") == 0.0


def test_registered_names():
    for name in ("math_verify", "gsm8k", "format", "boxed_format", "answer_tag_format", "reverse_match"):
        assert name in REGISTRY and callable(get_reward_fn(name))


def _raises(**kw):
    raise RuntimeError("boom")


def test_scorer_weights_parts_and_errors():
    scorer = RewardScorer(RewardConfig(functions={"gsm8k": 1.0, "format": 0.25}))
    total, parts = scorer.score("", "\\boxed{8} #### 8", "8", {"unused_column": 1})
    assert parts == {"gsm8k": 1.0, "format": 1.0} and total == 1.25
    bad = RewardScorer(RewardConfig(functions={"gsm8k": 1.0, "tests.test_rewards_math:_raises": 1.0}))
    total, parts = bad.score("", "8", "8")
    assert parts["tests.test_rewards_math:_raises"] == 0.0 and total == 1.0 and bad.errors == 1
    stop = RewardScorer(RewardConfig(functions={"tests.test_rewards_math:_raises": 1.0}, on_error="stop"))
    with pytest.raises(RewardError, match="boom"):
        stop.score("", "8", "8")


def test_process_pool_scores_like_inline_and_keeps_the_error_policy():
    pytest.importorskip("math_verify")
    functions = {"math_verify": 1.0, "format": 0.5, "tests.test_rewards_math:_raises": 1.0}
    inline = RewardScorer(RewardConfig(functions=functions))
    pooled = RewardScorer(RewardConfig(functions=functions, num_workers=2))
    cases = [(r, a) for r, a, _ in MATH_TABLE[:6] + MATH_TABLE[10:13]]
    try:

        async def all_async():
            return await asyncio.gather(*(pooled.score_async("", r, a, {"level": 1}) for r, a in cases))

        got = asyncio.run(all_async())
        want = [inline.score("", r, a, {"level": 1}) for r, a in cases]
        assert got == want
        assert pooled.score(*("", *cases[0])) == want[0]  # the blocking path uses the pool too
        # one failing function per scored response, counted in this process, not in the workers
        assert inline.errors == len(cases) and pooled.errors == len(cases) + 1
    finally:
        pooled.close()
    stop = RewardScorer(RewardConfig(functions={"tests.test_rewards_math:_raises": 1.0}, on_error="stop", num_workers=1))
    try:
        with pytest.raises(RewardError, match="boom"):
            asyncio.run(stop.score_async("", "8", "8"))
    finally:
        stop.close()


def test_score_async_inline_when_no_workers():
    scorer = RewardScorer(RewardConfig(functions={"gsm8k": 1.0}))
    assert asyncio.run(scorer.score_async("", "#### 3", "3")) == (1.0, {"gsm8k": 1.0})
    assert scorer._pool is None


def test_hanging_reward_times_out_per_on_error_without_blocking_the_event_loop():
    """`reward.timeout_s`: a reward that sleeps forever is stopped by its worker's timer (the worker
    lives on), one that cannot be interrupted (SIGALRM blocked, as if stuck in C) has its worker
    killed; both score per on_error while a well-behaved call on the same loop finishes at once."""
    import time

    functions = {"reverse_match": 1.0, "tests.fault_rewards:sleeps_forever": 1.0}
    scorer = RewardScorer(RewardConfig(functions=functions, num_workers=2, timeout_s=0.5))
    quick = RewardScorer(RewardConfig(functions={"reverse_match": 1.0}, num_workers=1, timeout_s=0.5))
    try:
        scorer.score("12=", "21", "21"), quick.score("12=", "21", "21")  # workers started before timing (1 error)

        async def both():
            t0 = time.perf_counter()
            hang = asyncio.ensure_future(scorer.score_async("12=", "21", "21"))
            ok = await quick.score_async("12=", "21", "21")
            t_ok = time.perf_counter() - t0
            return ok, t_ok, await hang, time.perf_counter() - t0

        ok, t_ok, hung, t_hung = asyncio.run(both())
        assert ok == (1.0, {"reverse_match": 1.0}) and t_ok < 0.5, "the event loop waited on the hanging reward"
        assert hung == (1.0, {"reverse_match": 1.0, "tests.fault_rewards:sleeps_forever": 0.0})
        assert 0.5 <= t_hung < 2.0 and scorer.errors == 2
        assert scorer.score("12=", "21", "21")[1]["reverse_match"] == 1.0  # same pool, still serving
        assert scorer.errors == 3
    finally:
        scorer.close()
        quick.close()
    stuck = RewardScorer(RewardConfig(functions={"tests.fault_rewards:ignores_its_timer": 1.0}, num_workers=1,
                                      timeout_s=0.3, on_error="zero"))
    try:
        t0 = time.perf_counter()
        assert asyncio.run(stuck.score_async("", "", "")) == (0.0, {"tests.fault_rewards:ignores_its_timer": 0.0})
        assert time.perf_counter() - t0 < 5 and stuck.errors == 1 and stuck._pool is None  # killed, rebuilt on demand
    finally:
        stuck.close()
    stop = RewardScorer(RewardConfig(functions={"tests.fault_rewards:sleeps_forever": 1.0}, num_workers=1,
                                     timeout_s=0.3, on_error="stop"))
    try:
        with pytest.raises(RewardError, match="took longer than reward.timeout_s=0.3s"):
            stop.score("", "", "")
    finally:
        stop.close()


def test_reward_timeout_needs_worker_processes():
    with pytest.raises(ValueError, match="reward.timeout_s needs reward.num_workers >= 1"):
        RewardConfig(functions={"reverse_match": 1.0}, timeout_s=5)
