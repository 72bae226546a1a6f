"""The digit-reversal task, its reward and the reward registry."""

import numpy as np
import pytest

from async_april.rewards import get_reward_fn
from async_april.rewards.reverse import reverse_match
from async_april.tasks.reverse import LENGTH_BUCKETS, LENGTH_PROBS, MAX_LENGTH, make_reverse_rows


def test_response_lengths_have_a_long_tail():
    rows = make_reverse_rows(4096, seed=0)
    tokens = np.array([len(r["answer"]) + 1 for r in rows])  # + EOS
    assert np.percentile(tokens, 90) >= 4 * np.median(tokens)
    assert tokens.max() <= MAX_LENGTH + 1
    assert abs(sum(LENGTH_PROBS) - 1) < 1e-9 and len(LENGTH_PROBS) == len(LENGTH_BUCKETS)


def test_rows_are_reversals_and_deterministic_from_the_seed():
    rows = make_reverse_rows(64, seed=7)
    assert rows == make_reverse_rows(64, seed=7)
    assert rows != make_reverse_rows(64, seed=8)
    for r in rows:
        assert r["prompt"].endswith("=") and r["prompt"][:-1].isdigit()
        assert r["answer"] == r["prompt"][:-1][::-1]
    assert make_reverse_rows(0, seed=0) == []
    with pytest.raises(ValueError, match="num_prompts"):
        make_reverse_rows(-1, seed=0)


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("4321", "4321", 1.0),  # exact
        ("4321</s><pad><pad>", "4321", 1.0),  # special text stripped
        (" 4321\n", "4321", 1.0),  # whitespace stripped
        ("4301", "4321", 0.75),  # partial
        ("432", "4321", 0.75),  # too short
        ("43210000", "4321", 0.5),  # too long
        ("1234", "4321", 0.0),  # all wrong
        ("", "4321", 0.0),  # empty response
        ("12", "", 0.0),  # empty answer
        ("", "", 1.0),  # both empty
    ],
)
def test_reverse_match(response, answer, expected):
    assert reverse_match("1234=", response, answer) == pytest.approx(expected)


def test_get_reward_fn_by_name_and_by_import_path():
    assert get_reward_fn("reverse_match") is reverse_match
    fn = get_reward_fn("async_april.rewards.reverse:reverse_match")
    assert fn is reverse_match
    assert fn(prompt="12=", response="21", answer="21", extra_column=3) == 1.0


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_reward", "not a registered name"),
        ("async_april.rewards.reverse:nope", "module async_april.rewards.reverse has no attribute nope"),
        ("no_such_module_xyz:fn", "cannot import module no_such_module_xyz"),
        ("async_april.rewards.reverse:EOS_TEXTS", "not a function"),
        (":fn", "module:function"),
    ],
)
def test_get_reward_fn_errors_name_the_problem(name, message):
    with pytest.raises(ValueError, match=message):
        get_reward_fn(name)
