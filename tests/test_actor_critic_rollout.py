"""The actor-critic rollout, worked out by hand: the advantage is the target minus the value, and the team's
reward is the mean over agents (in training metrics, evaluation and early termination)."""

import pytest
import torch
from datasets import Dataset

from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def _iac(qwen_path, make_config, reward, transition=None, **overrides):
    settings = dict(
        config_cls=IACConfig,
        num_generations=1,
        per_device_train_batch_size=2,
        max_new_tokens=4,
        advantage_normalization=False,
        max_steps=1,
        use_separate_critic=False,
    )
    settings.update(overrides)
    trainer = IACTrainer(
        agent_model=qwen_path,
        reward_func=reward,
        train_dataset=ITEMS,
        eval_dataset=ITEMS,
        args=make_config(**settings),
        external_transition=transition,
    )
    for model in trainer.agents:
        model.train()
    return trainer


def test_actor_critic_advantage_is_the_target_minus_the_value(qwen_path, make_config):
    """One turn, rewards 0.25 for agent 0 and 0.75 for agent 1 (one value per agent). The value heads' output layers
    are set to weight 0 and bias 0.125 and -0.5, so the values are exactly those. The target is the agent's reward,
    the advantage the target minus the value: 0.25 - 0.125 = 0.125 and 0.75 + 0.5 = 1.25."""
    trainer = _iac(qwen_path, make_config, lambda a, b: [0.25, 0.75])
    for model, bias in zip(trainer.agents, (0.125, -0.5)):
        with torch.no_grad():
            model.value_head.net[-1].weight.zero_()
            model.value_head.net[-1].bias.fill_(bias)
    rollout = trainer.orchestrator.rollout([{"prompt": "Say something:"}, {"prompt": "Say more:"}])
    expected = [(0.25, 0.125, 0.125), (0.75, -0.5, 1.25)]
    for (reward, value, advantage), batch, advantages in zip(
        expected, rollout.agent_batches, rollout.agent_advantages
    ):
        assert batch["value_targets"].tolist() == [reward, reward]
        assert batch["old_values"].tolist() == [value, value]
        assert advantages.tolist() == [advantage, advantage]


def test_actor_critic_team_reward_is_the_mean_over_agents(qwen_path, make_config):
    """Per-agent rewards 1 and 3: the team's reward of the joint action is (1 + 3) / 2 = 2, in training metrics,
    in evaluation, and for early termination (threshold 2.5: a team reward of 2 keeps expanding; a sum, 4, would
    stop after the first turn)."""
    transitions = []

    def transition(*, agent_completions, **kwargs):
        transitions.append(1)
        return ["Go on", "Go on"]

    trainer = _iac(
        qwen_path,
        make_config,
        lambda a, b: [1.0, 3.0],
        transition,
        num_turns=2,
        early_termination_threshold=2.5,
        eval_num_samples=2,
    )
    rollout = trainer.orchestrator.rollout([{"prompt": "Say something:"}, {"prompt": "Say more:"}])
    assert rollout.turn_rewards == [[2.0, 2.0], [2.0, 2.0]]
    assert len(transitions) == 2  # both items expanded into a second turn
    metrics = trainer.evaluate()
    assert metrics["eval/turn_1/reward_mean"] == pytest.approx(2.0)
    assert metrics["eval/turn_2/expected_return"] == pytest.approx(2.0)
