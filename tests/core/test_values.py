"""Value targets, reward broadcasting, advantage normalisation and the value loss of the actor-critic trainers."""

import pytest
import torch

from comlrl_trl.core.values import broadcast_rewards, td_targets, value_loss, whiten


def test_rewards_per_joint_action_are_shared_by_all_agents():
    assert broadcast_rewards([1.0, 2.0, 3.0], num_agents=2, num_generations=3) == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]


def test_rewards_per_agent_are_shared_by_all_generations():
    assert broadcast_rewards([1.0, 5.0], num_agents=2, num_generations=3) == [[1.0, 1.0, 1.0], [5.0, 5.0, 5.0]]


def test_one_reward_is_shared_by_everyone():
    assert broadcast_rewards([0.5], num_agents=3, num_generations=2) == [[0.5, 0.5]] * 3


def test_g_equal_n_reads_one_value_per_joint_action():
    assert broadcast_rewards([1.0, 2.0], num_agents=2, num_generations=2) == [[1.0, 2.0], [1.0, 2.0]]


def test_other_counts_are_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match=r"returned 4 values.*1 \(shared\), 3 .*num_generations.*2 .*num_agents"):
        broadcast_rewards([1.0] * 4, num_agents=2, num_generations=3)


def test_single_turn_target_is_the_reward():
    assert td_targets([0.3, -1.0], [None, None], discount=0.9) == [0.3, -1.0]


def test_td_target_bootstraps_from_the_next_value():
    # r_t + gamma * V(s_{t+1}); the last turn of the episode is its reward alone.
    assert td_targets([1.0, 2.0, 0.5], [4.0, None, -2.0], discount=0.5) == [3.0, 2.0, -0.5]


def test_td_targets_need_one_next_value_per_reward():
    with pytest.raises(ValueError, match="3 rewards but 2 next values"):
        td_targets([1.0, 2.0, 3.0], [None, None], discount=1.0)


def test_whiten_uses_population_statistics():
    x = torch.tensor([1.0, 2.0, 3.0, 6.0])
    out = whiten(x, x.mean(), x.var(unbiased=False))
    assert torch.allclose(out.mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(out.std(unbiased=False), torch.tensor(1.0), atol=1e-5)
    torch.testing.assert_close(out, (x - 3.0) / (3.5**0.5 + 1e-6))


def test_whiten_of_a_constant_group_is_zero_not_nan():
    x = torch.full((3,), 2.0)
    assert torch.equal(whiten(x, x.mean(), x.var(unbiased=False)), torch.zeros(3))


def test_value_loss_without_clipping_is_the_mean_squared_error():
    values, targets = torch.tensor([0.0, 1.0]), torch.tensor([1.0, 3.0])
    assert value_loss(values, targets).item() == pytest.approx((1 + 4) / 2)
    assert value_loss(values, targets, torch.tensor([5.0, 5.0]), None).item() == pytest.approx(2.5)


def test_value_clipping_keeps_the_larger_error():
    old = torch.tensor([0.0, 0.0])
    values = torch.tensor([1.0, 0.1])  # the first moved beyond the clip range, the second did not
    targets = torch.tensor([2.0, 0.0])
    # Row 0: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> 3.24. Row 1: both 0.01.
    assert value_loss(values, targets, old, clip_range=0.2).item() == pytest.approx((3.24 + 0.01) / 2)


def test_value_clipping_stops_the_gradient_of_a_value_moved_too_far_towards_the_target():
    old, targets = torch.tensor([0.0]), torch.tensor([2.0])
    values = torch.tensor([1.0], requires_grad=True)
    value_loss(values, targets, old, clip_range=0.2).backward()
    assert values.grad.item() == 0.0  # the clipped term dominates and does not depend on V
    values = torch.tensor([0.1], requires_grad=True)
    value_loss(values, targets, old, clip_range=0.2).backward()
    assert values.grad.item() == pytest.approx(2 * (0.1 - 2.0))
