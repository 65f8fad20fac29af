"""Returns over a multi-turn rollout tree, and its size.

Every node of the tree is one turn of one task item along one branch: each agent samples K completions, the
joint actions of the node (K in `align`, K^N in `cross`) are scored, and each joint action of a node that is
expanded gets its own child node at the next turn. Returns are computed bottom-up::

    R_j = r_j + gamma * mean(R of the child node's joint actions)     (R_j = r_j when j has no child)

so that gamma = 1 gives the undiscounted sum of rewards along a branch, averaged over the sampled futures.
"""

from collections.abc import Sequence


def joint_actions_per_item(joint_actions_per_node: int, num_turns: int, cap: int | None = None) -> int:
    """Joint actions scored for one task item when every node is expanded: J + J^2 + ... + J^T.

    With `cap`, the count stops growing once it exceeds `cap` (the result is then some value above `cap`), so
    that checking a bound never builds huge integers: it takes at most about log_J(cap) steps for any T.
    """
    if joint_actions_per_node < 1 or num_turns < 1:
        raise ValueError("joint_actions_per_node and num_turns must be >= 1.")
    if joint_actions_per_node == 1:
        return num_turns
    if cap is None:  # closed form of the geometric series
        return (joint_actions_per_node ** (num_turns + 1) - joint_actions_per_node) // (joint_actions_per_node - 1)
    total, term = 0, 1
    for _ in range(num_turns):
        term *= joint_actions_per_node
        total += term
        if total > cap:
            break
    return total


def tree_returns(
    rewards: Sequence[Sequence[Sequence[float]]],
    children: Sequence[Sequence[Sequence[int | None]]],
    gamma: float,
) -> list[list[list[float]]]:
    """Discounted returns of every joint action of every node.

    Args:
        rewards: `rewards[t][n][j]`, the reward of joint action j of node n at turn t.
        children: same shape; `children[t][n][j]` is the index of the child node in turn t+1, or None for a leaf.
        gamma: the discount, in [0, 1].

    Returns:
        `returns[t][n][j]`, same shape as `rewards`.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}.")
    if len(rewards) != len(children):
        raise ValueError("rewards and children must have one entry per turn.")
    returns: list[list[list[float]]] = [[] for _ in rewards]
    for t in reversed(range(len(rewards))):
        for n, (node_rewards, node_children) in enumerate(zip(rewards[t], children[t], strict=True)):
            if len(node_rewards) != len(node_children):
                raise ValueError(f"turn {t} node {n}: {len(node_rewards)} rewards but {len(node_children)} children.")
            node_returns = []
            for reward, child in zip(node_rewards, node_children):
                if child is None:
                    node_returns.append(float(reward))
                else:
                    child_returns = returns[t + 1][child]  # bootstrap from the mean return of the child node
                    node_returns.append(float(reward) + gamma * sum(child_returns) / len(child_returns))
            returns[t].append(node_returns)
    return returns


def suffix_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """Discounted return from every turn of one path: G_t = r_t + gamma * G_{t+1} (evaluation)."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        running = float(rewards[t]) + gamma * running
        out[t] = running
    return out
