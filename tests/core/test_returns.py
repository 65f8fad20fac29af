"""Rollout-tree returns and sizes, by hand."""

import pytest

from comlrl_trl.core.returns import joint_actions_per_item, suffix_returns, tree_returns


@pytest.mark.parametrize(
    ("per_node", "turns", "expected"),
    [(4, 1, 4), (4, 2, 4 + 16), (2, 3, 2 + 4 + 8), (9, 2, 9 + 81), (1, 5, 5)],
)
def test_joint_actions_per_item(per_node, turns, expected):
    assert joint_actions_per_item(per_node, turns) == expected


def test_two_turn_returns_undiscounted():
    # turn 1: one node with joint actions [1, 2]; each expands into a turn-2 node
    rewards = [[[1.0, 2.0]], [[0.0, 4.0], [3.0, 3.0]]]
    children = [[[0, 1]], [[None, None], [None, None]]]
    returns = tree_returns(rewards, children, gamma=1.0)
    assert returns[1] == [[0.0, 4.0], [3.0, 3.0]]  # leaves: their reward
    assert returns[0] == [[1.0 + 2.0, 2.0 + 3.0]]  # reward + mean return of the child node


def test_three_turn_returns_discounted():
    rewards = [[[1.0]], [[2.0, 0.0]], [[4.0], [8.0]]]
    children = [[[0]], [[0, 1]], [[None], [None]]]
    returns = tree_returns(rewards, children, gamma=0.5)
    assert returns[2] == [[4.0], [8.0]]
    assert returns[1] == [[2.0 + 0.5 * 4.0, 0.0 + 0.5 * 8.0]]  # [4, 4]
    assert returns[0] == [[1.0 + 0.5 * 4.0]]  # mean of [4, 4] is 4


def test_early_terminated_node_is_a_leaf():
    rewards = [[[1.0, 5.0], [2.0, 2.0]], [[1.0, 1.0], [3.0, 1.0]]]
    children = [[[0, 1], [None, None]], [[None, None], [None, None]]]  # node 1 was not expanded
    returns = tree_returns(rewards, children, gamma=1.0)
    assert returns[0] == [[2.0, 7.0], [2.0, 2.0]]


def test_suffix_returns():
    assert suffix_returns([1.0, 2.0, 4.0], gamma=1.0) == [7.0, 6.0, 4.0]
    assert suffix_returns([1.0, 2.0, 4.0], gamma=0.5) == [1.0 + 0.5 * 2.0 + 0.25 * 4.0, 2.0 + 0.5 * 4.0, 4.0]


def test_errors():
    with pytest.raises(ValueError, match="gamma"):
        tree_returns([[[1.0]]], [[[None]]], gamma=1.5)
    with pytest.raises(ValueError, match="children"):
        tree_returns([[[1.0, 2.0]]], [[[None]]], gamma=1.0)
    with pytest.raises(ValueError):
        joint_actions_per_item(0, 2)
