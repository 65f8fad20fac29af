"""Tests for comlrl_trl.core.joint (pure python, no models)."""

import itertools

import pytest

from comlrl_trl.core.joint import completion_returns, joint_action_indices, num_joint_actions


def test_align_indices():
    assert joint_action_indices(3, 2, "align") == [(0, 0, 0), (1, 1, 1)]
    assert num_joint_actions(3, 2, "align") == 2


def test_cross_indices_product_order():
    idx = joint_action_indices(2, 3, "cross")
    assert len(idx) == 9
    # First agent varies slowest.
    assert idx == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert idx == list(itertools.product(range(3), repeat=2))
    assert num_joint_actions(2, 3, "cross") == 9
    assert num_joint_actions(3, 4, "cross") == 64


def test_single_agent_modes_coincide():
    assert joint_action_indices(1, 3, "align") == joint_action_indices(1, 3, "cross") == [(0,), (1,), (2,)]


def test_completion_returns_cross_hand_example():
    # N=2, K=2; joint actions (0,0),(0,1),(1,0),(1,1) with returns 1,2,3,4.
    # agent 0: k=0 -> mean(1,2)=1.5 ; k=1 -> mean(3,4)=3.5
    # agent 1: k=0 -> mean(1,3)=2.0 ; k=1 -> mean(2,4)=3.0
    idx = joint_action_indices(2, 2, "cross")
    out = completion_returns([1.0, 2.0, 3.0, 4.0], idx, 2, 2)
    assert out == [[1.5, 3.5], [2.0, 3.0]]


def test_completion_returns_cross_three_by_two():
    # N=2, K=3; returns j=0..8 for (a0,a1) = (j//3, j%3).
    # agent 0, k: mean(3k, 3k+1, 3k+2) = 3k+1 -> [1, 4, 7]
    # agent 1, k: mean(k, k+3, k+6) = k+3 -> [3, 4, 5]
    idx = joint_action_indices(2, 3, "cross")
    out = completion_returns([float(j) for j in range(9)], idx, 2, 3)
    assert out == [[1.0, 4.0, 7.0], [3.0, 4.0, 5.0]]


def test_completion_returns_align_identity():
    rets = [0.5, -1.0, 2.25]
    idx = joint_action_indices(3, 3, "align")
    assert completion_returns(rets, idx, 3, 3) == [rets, rets, rets]


def test_errors():
    with pytest.raises(ValueError, match="unknown joint mode"):
        joint_action_indices(2, 2, "bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown joint mode"):
        num_joint_actions(2, 2, "bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_agents must be >= 1"):
        joint_action_indices(0, 2, "align")
    with pytest.raises(ValueError, match="num_generations must be >= 1"):
        joint_action_indices(2, 0, "cross")
    with pytest.raises(ValueError, match="joint_returns has 1 entries but indices has 2"):
        completion_returns([1.0], [(0, 0), (1, 1)], 2, 2)
    # Completion 1 of both agents never appears.
    with pytest.raises(ValueError, match="completion 1 of agent 0 takes part in no joint action"):
        completion_returns([1.0], [(0, 0)], 2, 2)
    with pytest.raises(ValueError, match="expected num_agents=2"):
        completion_returns([1.0, 2.0], [(0,), (1,)], 2, 2)
    with pytest.raises(ValueError, match="out of range"):
        completion_returns([1.0, 2.0], [(0, 0), (1, 2)], 2, 2)
