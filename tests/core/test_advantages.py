"""Tests for comlrl_trl.core.advantages (tiny tensors, no models)."""

import pytest
import torch

from comlrl_trl.core.advantages import group_advantages


# Two groups of K=4: [1, 2, 3, 6] (mean 3, sum 12) and [0, 0, 4, 4] (mean 2, sum 8).
RETURNS = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 4.0, 4.0])
K = 4


def trl_grpo_advantages(rewards: torch.Tensor, k: int, scale_rewards: str) -> torch.Tensor:
    """Direct re-implementation of TRL GRPOTrainer's advantage computation."""
    mean_grouped_rewards = rewards.view(-1, k).mean(dim=1).repeat_interleave(k, dim=0)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards in ["group", "none"]:
        std_rewards = rewards.view(-1, k).std(dim=1).repeat_interleave(k, dim=0)
    elif scale_rewards == "batch":
        std_rewards = rewards.std().expand_as(rewards)
    else:
        raise ValueError(scale_rewards)
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return advantages


@pytest.mark.parametrize(
    "mode, expected",
    [
        # mean: r - mean(r)
        ("mean", [-2.0, -1.0, 0.0, 3.0, -2.0, -2.0, 2.0, 2.0]),
        # raw: r
        ("raw", [1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 4.0, 4.0]),
        # max: r - max(r)
        ("max", [-5.0, -4.0, -3.0, 0.0, -4.0, -4.0, 0.0, 0.0]),
        # rloo: (K r - sum r)/(K-1); e.g. 1 - mean(2,3,6) = -8/3
        ("rloo", [-8 / 3, -4 / 3, 0.0, 4.0, -8 / 3, -8 / 3, 8 / 3, 8 / 3]),
    ],
)
def test_modes_without_scaling(mode, expected):
    out = group_advantages(RETURNS, K, mode=mode, scale="none")
    torch.testing.assert_close(out, torch.tensor(expected), rtol=0, atol=1e-6)


def test_group_scaling_hand_value():
    # Group 2: mean-centered [-2,-2,2,2], unbiased std = sqrt(16/3).
    out = group_advantages(RETURNS, K, mode="mean", scale="group")
    s = (16 / 3) ** 0.5
    torch.testing.assert_close(out[4:], torch.tensor([-2.0, -2.0, 2.0, 2.0]) / (s + 1e-4))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_mean_mode_matches_trl(scale):
    torch.manual_seed(0)
    rewards = torch.randn(6 * 5)
    ours = group_advantages(rewards, 5, mode="mean", scale=scale)
    ref = trl_grpo_advantages(rewards, 5, scale)
    assert torch.equal(ours, ref)  # bit-for-bit
    # Also on the hand example.
    assert torch.equal(group_advantages(RETURNS, K, mode="mean", scale=scale), trl_grpo_advantages(RETURNS, K, scale))


def test_all_modes_coincide_with_group_scaling():
    # Every baseline is a positive-slope affine map of r within a group,
    # so group standardisation makes them identical.
    torch.manual_seed(1)
    rewards = torch.rand(4 * 6) * 3
    ref = group_advantages(rewards, 6, mode="mean", scale="group")
    # Slope 1 (raw, max): identical up to float rounding even with default eps.
    for mode in ["raw", "max"]:
        out = group_advantages(rewards, 6, mode=mode, scale="group")
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    # rloo has slope K/(K-1), so eps acts slightly differently; with a tiny eps
    # the property holds to 1e-5 ...
    ref_tiny = group_advantages(rewards, 6, mode="mean", scale="group", eps=1e-8)
    for mode in ["raw", "max", "rloo"]:
        out = group_advantages(rewards, 6, mode=mode, scale="group", eps=1e-8)
        torch.testing.assert_close(out, ref_tiny, rtol=0, atol=1e-5)
    # ... and with the default eps=1e-4 it still holds to ~1e-4.
    out = group_advantages(rewards, 6, mode="rloo", scale="group")
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-4)


def test_batch_scaling_rloo_differs_by_k_over_k_minus_1():
    mean_b = group_advantages(RETURNS, K, mode="mean", scale="batch")
    rloo_b = group_advantages(RETURNS, K, mode="rloo", scale="batch")
    torch.testing.assert_close(rloo_b, mean_b * K / (K - 1))
    # max / raw re-centered per group equal mean under batch scaling.
    torch.testing.assert_close(group_advantages(RETURNS, K, mode="max", scale="batch"), mean_b)


@pytest.mark.parametrize("mode", ["mean", "raw", "max", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_zero_variance_group_gives_zeros(mode, scale):
    r = torch.tensor([2.0, 2.0, 2.0, 0.0, 1.0, 5.0])
    out = group_advantages(r, 3, mode=mode, scale=scale)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out[:3], torch.zeros(3))
    # Fully constant batch also gives zeros, not NaN.
    out = group_advantages(torch.full((6,), 3.0), 3, mode=mode, scale=scale)
    torch.testing.assert_close(out, torch.zeros(6))


def test_dtype_and_shape():
    out = group_advantages(torch.tensor([0, 1, 2, 3]), 2, mode="mean", scale="none")
    assert out.is_floating_point() and out.shape == (4,)
    torch.testing.assert_close(out, torch.tensor([-0.5, 0.5, -0.5, 0.5]))
    out64 = group_advantages(RETURNS.double(), K)
    assert out64.dtype == torch.float64


def test_errors():
    with pytest.raises(ValueError, match="not divisible by num_generations=3"):
        group_advantages(RETURNS, 3)
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        group_advantages(RETURNS, 1)
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages(RETURNS, K, mode="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown scale mode"):
        group_advantages(RETURNS, K, scale="token")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be 1-D"):
        group_advantages(RETURNS.view(2, 4), K)
    bad = RETURNS.clone()
    bad[5] = float("nan")
    with pytest.raises(ValueError, match="NaN/inf in group index 1"):
        group_advantages(bad, K)
    bad = RETURNS.clone()
    bad[0] = float("inf")
    with pytest.raises(ValueError, match="NaN/inf in group index 0"):
        group_advantages(bad, K)
