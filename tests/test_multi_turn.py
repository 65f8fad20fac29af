"""Multi-turn MAGRPO: the rollout tree, external transitions, returns, advantages and per-turn metrics."""

import pytest
import torch
from datasets import Dataset
from helpers import changed, snapshot

from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def _dataset(n):
    return Dataset.from_dict({"prompt": [f"Task {i}: write code" for i in range(n)], "tid": list(range(n))})


class RecordingTransition:
    """Feedback that names the turn; records every call."""

    def __init__(self):
        self.calls = []

    def __call__(
        self,
        *,
        prompt,
        agent_completions,
        num_agents,
        prompt_history_per_agent,
        response_history_per_agent,
        batch_item,
    ):
        self.calls.append(
            dict(
                prompt=prompt,
                completions=list(agent_completions),
                num_agents=num_agents,
                prompts=prompt_history_per_agent,
                responses=response_history_per_agent,
                item=batch_item,
            )
        )
        turn = len(response_history_per_agent[0])
        return [f"Feedback {turn} for agent {a}: revise {batch_item['tid']}" for a in range(num_agents)]


class RecordingReward:
    def __init__(self):
        self.calls = []

    def __call__(self, first, second, *, batch_items):
        rewards = [len(a) / (1.0 + len(b)) + 0.1 * i for i, (a, b) in enumerate(zip(first, second))]
        self.calls.append((list(first), list(second), batch_items[0]["tid"], rewards))
        return rewards


def _trainer(qwen_path, make_config, n_items=2, **config):
    transition, reward = RecordingTransition(), RecordingReward()
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=reward,
        train_dataset=_dataset(n_items),
        eval_dataset=_dataset(2),
        external_transition=transition,
        args=make_config(**config),
    )
    return trainer, transition, reward


@pytest.mark.parametrize(
    ("turns", "mode", "k", "per_item", "transitions_per_item"),
    [(2, "align", 4, 4 + 16, 4), (3, "align", 2, 2 + 4 + 8, 2 + 4), (2, "cross", 2, 4 + 16, 4)],
)
def test_tree_sizes_and_every_agent_learns(qwen_path, make_config, turns, mode, k, per_item, transitions_per_item):
    trainer, transition, reward = _trainer(qwen_path, make_config, num_turns=turns, joint_mode=mode, num_generations=k)
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    assert trainer.env_step == 2 * per_item
    assert len(transition.calls) == 2 * transitions_per_item
    assert sum(len(call[3]) for call in reward.calls) == 2 * per_item
    for i, model in enumerate(trainer.agents):
        assert changed(before[i], model), f"agent {i} did not change"
    logs = [row for row in trainer.state.log_history if "agent_0/loss" in row]
    for turn in range(1, turns + 1):
        assert f"turn_{turn}/reward_mean" in logs[-1] and f"turn_{turn}/expected_return" in logs[-1]


def test_transition_sees_branch_histories(qwen_path, make_config):
    trainer, transition, reward = _trainer(
        qwen_path, make_config, n_items=1, num_turns=3, num_generations=2, max_steps=1
    )
    trainer.train()
    first, second, _, _ = reward.calls[0]  # turn 1 of item 0
    after_turn_1 = transition.calls[:2]
    for j, call in enumerate(after_turn_1):  # one call per joint action, in order
        assert call["completions"] == [first[j], second[j]]
        assert call["responses"] == [[first[j]], [second[j]]]
        assert call["prompts"] == [["Task 0: write code"], ["Task 0: write code"]]
        assert call["prompt"] == "Task 0: write code" and call["num_agents"] == 2 and call["item"]["tid"] == 0
    turn_2_branch_0 = transition.calls[2]
    assert turn_2_branch_0["responses"][0][0] == first[0]  # the branch keeps its own history
    assert turn_2_branch_0["prompts"][0] == ["Task 0: write code", "Feedback 1 for agent 0: revise 0"]
    assert len(turn_2_branch_0["responses"][0]) == 2


def test_returns_and_advantages_follow_the_tree(qwen_path, make_config):
    gamma = 0.5
    trainer, transition, reward = _trainer(
        qwen_path,
        make_config,
        n_items=1,
        num_turns=2,
        num_generations=2,
        discount=gamma,
        advantage_normalization=False,
        advantage_mode="mean",
        turn_gradient_weights=[1.0, 0.25],
    )
    for model in trainer.agents:
        model.train()
    rollout = trainer.orchestrator.rollout([dict(trainer.train_dataset[0])] * 2)
    turn1 = reward.calls[0][3]
    children = [call[3] for call in reward.calls[1:]]  # the two turn-2 nodes, in joint-action order
    returns_1 = torch.tensor([r + gamma * sum(c) / len(c) for r, c in zip(turn1, children)])

    # mean baseline over a group of two, no normalisation: (a - b) / 2 and (b - a) / 2
    def centred(a, b):
        return [(a - b) / 2, (b - a) / 2]

    expected_turn_1 = torch.tensor(centred(*returns_1.tolist()))
    expected_turn_2 = 0.25 * torch.tensor(centred(*children[0]) + centred(*children[1]))
    for batch, advantages in zip(rollout.agent_batches, rollout.agent_advantages, strict=True):
        assert advantages.shape == batch["completion_ids"].shape[:1] == (2 + 4,)  # turn-1 rows, then both turn-2 nodes
        torch.testing.assert_close(advantages[:2], expected_turn_1)
        torch.testing.assert_close(advantages[2:], expected_turn_2)
    assert rollout.turn_returns[0] == pytest.approx([returns_1.mean().item()])
    assert rollout.env_steps == 2 + 4


def test_early_termination_stops_expanding(qwen_path, make_config):
    transition = RecordingTransition()
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=lambda a, b: [1.0] * len(a),
        train_dataset=_dataset(2),
        external_transition=transition,
        args=make_config(num_turns=3, num_generations=2, early_termination_threshold=0.5),
    )
    trainer.train()
    assert transition.calls == [] and trainer.env_step == 2 * 2


def test_formatter_external_prompts_and_passthrough(qwen_path, make_config):
    seen = []

    def formatter(item, external_prompts=None):
        seen.append(external_prompts)
        return f"[{item['tid']}] {external_prompts or item['prompt']}"

    transition = RecordingTransition()
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        formatters=formatter,
        reward_func=RecordingReward(),
        train_dataset=_dataset(1),
        external_transition=transition,
        args=make_config(num_turns=2, num_generations=2),
    )
    trainer.train()
    assert seen[:2] == [None, None]  # first turn: the item only
    assert "Feedback 1 for agent 0: revise 0" in seen[2:]
    assert len(transition.calls) == 2  # after turn 1 only, once per joint action

    passthrough = RecordingTransition()
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        formatters=formatter,
        reward_func=RecordingReward(),
        train_dataset=_dataset(1),
        external_transition=passthrough,
        args=make_config(num_turns=3, num_generations=2, external_prompt_passthrough=True, max_steps=1),
    )
    trainer.train()
    later = passthrough.calls[2]["prompts"][1]
    assert later[1] == "Feedback 1 for agent 1: revise 0"  # verbatim, not "[0] Feedback ..."


def test_evaluation_runs_one_path_per_item(qwen_path, make_config):
    rows_seen = []

    def eval_logger(*, agent_completions_turns, batch_items, prompts):
        rows_seen.append(agent_completions_turns)
        return [{"turns": float(len(agent_completions_turns[0][i]))} for i in range(len(batch_items))]

    def eval_aggregator(rows, *, num_turns):
        return {"mean_turns": sum(r["turns"] for r in rows) / len(rows)}

    transition = RecordingTransition()
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=RecordingReward(),
        train_dataset=_dataset(2),
        eval_dataset=_dataset(2),
        external_transition=transition,
        eval_logger=eval_logger,
        eval_aggregator=eval_aggregator,
        args=make_config(num_turns=3, num_generations=2, discount=0.5, eval_batch_size=2),
    )
    metrics = trainer.evaluate(num_eval_samples=2)
    assert len(transition.calls) == 2 * 2  # one path per item: a transition after turns 1 and 2
    assert metrics["eval/mean_turns"] == 3.0
    completions = rows_seen[0]
    assert len(completions) == 2 and len(completions[0]) == 2 and len(completions[0][0]) == 3  # [agent][item][turn]
    for turn in (1, 2, 3):
        assert f"eval/turn_{turn}/reward_mean" in metrics
    # the discounted suffix return: G3 = r3, G2 = r2 + 0.5 G3
    g3 = metrics["eval/turn_3/expected_return"]
    assert metrics["eval/turn_2/expected_return"] == pytest.approx(metrics["eval/turn_2/reward_mean"] + 0.5 * g3)


def test_transition_errors_name_the_item(qwen_path, make_config):
    def wrong_count(**kwargs):
        return ["only one"]

    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=RecordingReward(),
        train_dataset=_dataset(1),
        external_transition=wrong_count,
        args=make_config(num_turns=2, num_generations=2),
    )
    with pytest.raises(ValueError, match="2 prompts .* task item 0"):
        trainer.train()

    def wrong_type(**kwargs):
        return ["fine", 3]

    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=RecordingReward(),
        train_dataset=_dataset(1),
        external_transition=wrong_type,
        args=make_config(num_turns=2, num_generations=2),
    )
    with pytest.raises(TypeError, match="agent 1"):
        trainer.train()


def test_explosion_guard_and_turn_settings(tmp_path):
    with pytest.raises(ValueError, match="joint actions"):
        MAGRPOConfig(output_dir=str(tmp_path), num_agents=3, joint_mode="cross", num_turns=2)  # 64 + 4096
    MAGRPOConfig(
        output_dir=str(tmp_path), num_agents=3, joint_mode="cross", num_turns=2, max_joint_actions_per_item=5000
    )
    with pytest.raises(ValueError, match="turn_gradient_weights"):
        MAGRPOConfig(output_dir=str(tmp_path), num_turns=2, turn_gradient_weights=[1.0])
    with pytest.raises(ValueError, match="turn_gradient_weights"):
        MAGRPOConfig(output_dir=str(tmp_path), num_turns=2, turn_gradient_weights=[1.0, -1.0])
    with pytest.raises(ValueError, match="discount"):
        MAGRPOConfig(output_dir=str(tmp_path), discount=1.5)


def test_a_tree_sampled_for_two_updates_scores_old_log_probs_of_the_second_micro_batch(qwen_path, make_config):
    # The default of two updates per generation over a two-turn tree (both turns' rows joined, then shuffled): the
    # first micro-batch is trained on-policy without old log-probabilities, the second with them, for every row.
    trainer, _, _ = _trainer(qwen_path, make_config, num_turns=2, num_generations=2, steps_per_generation=None)
    assert trainer.args.steps_per_generation == 2
    seen = []
    for agent in trainer.agent_trainers:
        fill = agent.fill_micro_batches

        def filling(batch, advantages, agent=agent, fill=fill):
            fill(batch, advantages)
            first, second = agent.micro_batch(0), agent.micro_batch(1)
            seen.append(("old_per_token_logps" in first, second["old_per_token_logps"].shape))
            assert second["old_per_token_logps"].shape == second["completion_ids"].shape
            assert torch.isfinite(second["old_per_token_logps"]).all()

        agent.fill_micro_batches = filling
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    assert len(seen) == 2 and not any(has_old for has_old, _ in seen)  # one generation (2 items), two agents
    for i, model in enumerate(trainer.agents):
        assert changed(before[i], model), f"agent {i} did not change"
