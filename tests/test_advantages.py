"""Advantage estimators on known reward matrices, torch and numpy in, same kind out."""

import numpy as np
import pytest
import torch

from async_april.algorithms.advantages import (
    ESTIMATORS,
    compute_advantages,
    drgrpo_advantages,
    grpo_advantages,
    rloo_advantages,
    zero_variance_groups,
)

EPS = 1e-6


def test_grpo_known_values_uses_biased_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 2.0]], dtype=torch.float64)
    # mean 0.5, std (unbiased=False) 0.5; mean 1, std 1 (the unbiased std would be 2/sqrt(3))
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [-1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    expected[0] *= 0.5 / (0.5 + EPS)
    expected[1] *= 1.0 / (1.0 + EPS)
    torch.testing.assert_close(grpo_advantages(r, EPS), expected, rtol=0, atol=1e-12)


def test_grpo_constant_group_is_zero():
    r = torch.full((2, 4), 0.7, dtype=torch.float64)
    assert torch.equal(grpo_advantages(r, EPS), torch.zeros_like(r))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_equal_reward_groups_give_exactly_zero(dtype, estimator):
    """Regression: in float32 the mean of 8 x 0.6 is not exactly 0.6, std is ~|delta| and GRPO gave
    delta / (|delta| + eps) = +0.056 to every response; 16 x 0.9 gave -0.056. Every value a
    fractional reward can take, any group size, both dtypes, torch and numpy: exactly 0."""
    values = torch.linspace(0.0, 1.0, 101, dtype=torch.float64).to(dtype)
    for n in (2, 3, 8, 16, 17):
        r = values[:, None].expand(-1, n).contiguous()
        out = compute_advantages(r, estimator, EPS)
        assert torch.equal(out, torch.zeros_like(r)), (n, out.abs().max())
        out_np = compute_advantages(r.numpy(), estimator, EPS)
        assert np.array_equal(out_np, np.zeros_like(out_np)) and out_np.dtype == r.numpy().dtype
    # A group with distinct rewards next to an equal one is untouched by the fix.
    mixed = torch.tensor([[0.6] * 8, [0.0, 1.0] * 4], dtype=dtype)
    out = compute_advantages(mixed, estimator, EPS)
    assert torch.equal(out[0], torch.zeros(8, dtype=dtype)) and out[1].abs().min() > 0.4


def test_drgrpo_known_values():
    r = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 8.0]], dtype=torch.float64)
    expected = torch.tensor([[-1.0, 0.0, 1.0], [-1.0, -1.0, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(drgrpo_advantages(r), expected, rtol=0, atol=1e-12)


def test_rloo_known_values_and_single_sample():
    r = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)
    # 1 - mean(2, 3), 2 - mean(1, 3), 3 - mean(1, 2)
    expected = torch.tensor([[-1.5, 0.0, 1.5]], dtype=torch.float64)
    torch.testing.assert_close(rloo_advantages(r), expected, rtol=0, atol=1e-12)
    assert torch.equal(rloo_advantages(torch.tensor([[3.0], [1.0]])), torch.zeros(2, 1))


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_numpy_in_numpy_out(estimator):
    r = np.array([[1.0, 0.0, 0.5], [0.2, 0.2, 0.9]], np.float32)
    out = compute_advantages(r, estimator, EPS)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == r.shape
    ref = compute_advantages(torch.from_numpy(r.astype(np.float64)), estimator, EPS).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_integer_numpy_rewards_become_float():
    out = compute_advantages(np.array([[0, 1]]), "drgrpo")
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, [[-0.5, 0.5]])


def test_dispatch_matches_functions_and_rejects_unknown():
    r = torch.rand(3, 5, dtype=torch.float64)
    assert torch.equal(compute_advantages(r, "grpo", 1e-3), grpo_advantages(r, 1e-3))
    assert torch.equal(compute_advantages(r, "drgrpo"), drgrpo_advantages(r))
    assert torch.equal(compute_advantages(r, "rloo"), rloo_advantages(r))
    with pytest.raises(ValueError, match="algorithm.advantage"):
        compute_advantages(r, "ppo")


def test_rejects_wrong_rank():
    with pytest.raises(ValueError, match=r"\[groups, n\]"):
        grpo_advantages(torch.ones(4))


def test_zero_variance_groups():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5 + 1e-8, 0.5]], dtype=torch.float64)
    assert zero_variance_groups(r).tolist() == [True, False, True]
    assert zero_variance_groups(r, atol=0.0).tolist() == [True, False, False]
    flags = zero_variance_groups(r.numpy())
    assert isinstance(flags, np.ndarray) and flags.dtype == bool and flags.tolist() == [True, False, True]
