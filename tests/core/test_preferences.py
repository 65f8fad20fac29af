"""Tests for comlrl_trl.core.preferences (no models): pair selection and the joint DPO loss."""

import math
import random

import pytest
import torch

from comlrl_trl.core.preferences import (
    dpo_logratio,
    madpo_loss,
    others_logratio,
    select_preference_pairs,
)


# ----- pair selection -----


def test_all_pairs_drop_ties_and_keep_index_order():
    rewards = [0.0, 1.0, 1.0, 0.5]
    pairs = select_preference_pairs(rewards, "all")
    assert pairs == [(1, 0), (1, 3), (2, 0), (2, 3), (3, 0)]  # (1, 2) and (2, 1) tie: no pair
    assert all(rewards[i] > rewards[j] for i, j in pairs)


def test_reward_gap_sorts_by_gap_then_index_and_caps():
    rewards = [0.0, 1.0, 1.0, 0.5]
    assert select_preference_pairs(rewards, "reward_gap") == [(1, 0), (2, 0), (1, 3), (2, 3), (3, 0)]
    assert select_preference_pairs(rewards, "reward_gap", max_pairs=3) == [(1, 0), (2, 0), (1, 3)]
    assert select_preference_pairs(rewards, "reward_gap", max_pairs=100) == select_preference_pairs(rewards)


def test_all_equal_rewards_give_no_pair():
    assert select_preference_pairs([0.3] * 5, "reward_gap") == []
    assert select_preference_pairs([0.3] * 5, "all") == []
    assert select_preference_pairs([0.3] * 5, "random", rng=random.Random(0)) == []


def test_random_is_a_seeded_permutation_then_capped():
    rewards = [0.1, 0.4, 0.2, 0.9, 0.0]
    every = set(select_preference_pairs(rewards, "all"))
    assert len(every) == 10  # 5 distinct rewards: C(5, 2) pairs
    first = select_preference_pairs(rewards, "random", max_pairs=4, rng=random.Random("seed-1"))
    again = select_preference_pairs(rewards, "random", max_pairs=4, rng=random.Random("seed-1"))
    assert first == again and len(first) == 4 and set(first) <= every
    full = select_preference_pairs(rewards, "random", rng=random.Random(7))
    assert set(full) == every and full != sorted(full)


def test_candidate_count_times_cap():
    # C = 4 candidates with distinct rewards and a cap of 3: 3 pairs per item
    assert len(select_preference_pairs([4.0, 3.0, 2.0, 1.0], "reward_gap", max_pairs=3)) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(selection="best"), "pair_selection"),
        (dict(selection="all", max_pairs=2), "must be None with pair_selection='all'"),
        (dict(max_pairs=0), "positive integer"),
        (dict(max_pairs=True), "positive integer"),
        (dict(selection="random"), "seeded random.Random"),
    ],
)
def test_selection_errors_name_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message):
        select_preference_pairs([1.0, 0.0], **kwargs)


# ----- the joint DPO objective -----


def test_dpo_logratio_with_and_without_reference():
    chosen, rejected = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    assert dpo_logratio(chosen, rejected).tolist() == [2.0, -1.0]
    ref = dpo_logratio(chosen, rejected, torch.tensor([-2.0, -2.0]), torch.tensor([-2.5, -1.5]))
    assert ref.tolist() == [1.5, -0.5]  # [2 - 0.5, -1 - (-0.5)]
    with pytest.raises(ValueError, match="both reference"):
        dpo_logratio(chosen, rejected, torch.tensor([0.0, 0.0]))


def test_others_logratio_is_the_sum_of_the_other_agents():
    deltas = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])
    assert others_logratio(deltas).tolist() == [[3.5, -0.5], [1.5, 2.5], [4.0, 1.0]]


def test_madpo_loss_value_on_a_hand_example():
    # beta = 0.5, own = 1, others = 3: -log sigmoid(2) = log(1 + e^-2)
    loss = madpo_loss(torch.tensor([1.0]), torch.tensor([3.0]), beta=0.5)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-2.0)), rel=1e-6)
    with pytest.raises(ValueError, match="dpo_beta"):
        madpo_loss(torch.tensor([1.0]), torch.tensor([0.0]), beta=0.0)


def test_madpo_gradient_flows_only_through_each_agents_own_term():
    beta = 0.5
    deltas = torch.tensor([[1.0, -2.0], [0.5, 0.25], [-1.0, 3.0]], requires_grad=True)  # (agents, pairs)
    others = others_logratio(deltas)
    losses = [madpo_loss(deltas[i], others[i], beta).mean() for i in range(3)]
    joint = deltas.detach().sum(dim=0)  # the joint log-ratio of every pair: [0.5, 1.25]
    for i, loss in enumerate(losses):
        (grad,) = torch.autograd.grad(loss, deltas, retain_graph=True)
        for j in range(3):
            if j != i:  # the other agents' terms are constants in agent i's loss
                assert torch.equal(grad[j], torch.zeros(2)), (i, j)
        # d/dΔ_i of mean_p -log σ(β z_p) = -β σ(-β z_p) / P, with z_p the joint log-ratio
        expected = -beta * torch.sigmoid(-beta * joint) / 2
        assert torch.allclose(grad[i], expected, atol=1e-7), (i, grad[i], expected)
    # Summing the agents' losses gives every agent exactly its own gradient (no cross terms).
    (total,) = torch.autograd.grad(sum(losses), deltas)
    assert torch.allclose(total, (-beta * torch.sigmoid(-beta * joint) / 2).expand(3, 2), atol=1e-7)
