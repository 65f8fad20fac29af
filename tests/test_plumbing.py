"""The plumbing between the rollout and the losses, with expectations worked out by hand: which micro-batch every
agent trains on, which returns every agent gets in cross mode, and the actor-critic advantage and team reward."""

import pytest
import torch
from datasets import Dataset

from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer
from comlrl_trl.trainers.reinforce import MAGRPOTrainer


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def test_every_agent_trains_on_each_micro_batch_of_a_generation(qwen_path, make_config):
    """Two micro-batches per generation (gradient accumulation 2): every agent must train on micro-batch 0, then 1,
    of its own buffered generation; never twice on the first, and no agent on another agent's."""
    config = make_config(
        num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_new_tokens=4, max_steps=2
    )
    trainer = MAGRPOTrainer(
        agent_model=qwen_path, reward_func=lambda a, b: [float(len(x)) for x in b], train_dataset=ITEMS, args=config
    )
    assert trainer.args.steps_per_generation == 2
    used = {0: [], 1: []}  # per agent and training step: the index of its micro-batch in its buffered generation

    def recording(agent):
        original = agent.training_step

        def step(model, inputs, num_items_in_batch=None):
            used[agent.agent_index].append(next(i for i in range(2) if agent.micro_batch(i) is inputs))
            return original(model, inputs, num_items_in_batch)

        return step

    for agent in trainer.agent_trainers:
        agent.training_step = recording(agent)
    trainer.train()
    assert used == {0: [0, 1, 0, 1], 1: [0, 1, 0, 1]}  # 2 optimiser steps x 2 micro-batches, for every agent


def test_cross_mode_gives_every_agent_its_own_completion_returns(qwen_path, make_config):
    """K=2, N=2, cross: joint actions (0,0), (0,1), (1,0), (1,1) get rewards 1, 2, 3, 4. Agent 0's completion k
    takes part in the joint actions with k0 = k: returns (1+2)/2 = 1.5 and (3+4)/2 = 3.5. Agent 1's completion k
    in those with k1 = k: (1+3)/2 = 2 and (2+4)/2 = 3. With raw advantages and no normalisation, these are the
    advantages."""
    config = make_config(
        num_generations=2,
        joint_mode="cross",
        advantage_mode="raw",
        advantage_normalization=False,
        max_new_tokens=4,
        max_steps=1,
    )
    trainer = MAGRPOTrainer(
        agent_model=qwen_path, reward_func=lambda a, b: [1.0, 2.0, 3.0, 4.0], train_dataset=ITEMS, args=config
    )
    for model in trainer.agents:
        model.train()
    rollout = trainer.orchestrator.rollout([{"prompt": "Say something:"}] * 2)
    agent_0, agent_1 = (advantages.tolist() for advantages in rollout.agent_advantages)
    assert agent_0 == [1.5, 3.5]
    assert agent_1 == [2.0, 3.0]


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


def test_every_agent_gets_its_rows_through_the_same_entry(qwen_path, make_config, monkeypatch):
    """Agent 0 (the team trainer) is not special: at every generation each agent, in order, has its micro-batches
    filled through `fill_micro_batches` with its own advantages, and TRL's own scorer is never the entry."""
    from comlrl_trl.adapters.grpo import AgentGRPOTrainer

    filled = []
    original = AgentGRPOTrainer.fill_micro_batches

    def record(self, batch, advantages):
        assert "advantages" not in batch and advantages.shape == batch["completion_ids"].shape[:1]
        filled.append(self.agent_index)
        original(self, batch, advantages)

    monkeypatch.setattr(AgentGRPOTrainer, "fill_micro_batches", record)
    config = make_config(num_agents=3, num_generations=2, max_new_tokens=4, max_steps=2)
    trainer = MAGRPOTrainer(
        agent_model=qwen_path, reward_func=lambda a, b, c: [float(len(x)) for x in c], train_dataset=ITEMS, args=config
    )
    trainer.train()
    assert filled == [0, 1, 2, 0, 1, 2]
