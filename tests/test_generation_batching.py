"""The default generation schedule: one task item per optimiser update, the items of several updates sampled in one
`generate` call per agent, every agent updated at every step."""

import torch
from datasets import Dataset
from transformers import TrainerCallback

from comlrl_trl.adapters.grpo import AgentGRPOTrainer
from comlrl_trl.trainers.reinforce import MAGRPOTrainer


TEN_ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(10)]})


class ParameterChanges(TrainerCallback):
    """After every optimiser step: which agents' weights differ from the step before."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.before = self._snapshot()
        self.changed = []

    def _snapshot(self):
        return [torch.cat([p.detach().flatten() for p in agent.parameters()]).clone() for agent in self.trainer.agents]

    def on_step_end(self, args, state, control, **kwargs):
        now = self._snapshot()
        self.changed.append([not torch.equal(a, b) for a, b in zip(self.before, now)])
        self.before = now


def test_default_samples_two_updates_at_once_and_updates_every_agent_every_step(qwen_path, make_config, monkeypatch):
    # 10 items, one per update, 2 updates per generation: 5 generations of 2 items x K=2 = 4 prompts per agent, and
    # 10 optimiser steps that each change both agents.
    calls = []  # (agent index, number of prompts) per generate call
    original = AgentGRPOTrainer.generate

    def counting(self, prompts):
        calls.append((self.agent_index, len(prompts)))
        return original(self, prompts)

    monkeypatch.setattr(AgentGRPOTrainer, "generate", counting)
    config = make_config(num_generations=2, max_new_tokens=4, steps_per_generation=None)
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=lambda a, b: [float(len(x)) for x in b],
        train_dataset=TEN_ITEMS,
        args=config,
    )
    assert (config.per_device_train_batch_size, config.steps_per_generation) == (2, 2)
    changes = ParameterChanges(trainer)
    trainer.add_callback(changes)
    trainer.train()
    assert calls == [(0, 4), (1, 4)] * 5
    assert trainer.state.global_step == 10
    assert changes.changed == [[True, True]] * 10


def test_a_set_steps_per_generation_of_one_samples_for_every_update(qwen_path, make_config, monkeypatch):
    calls = []
    original = AgentGRPOTrainer.generate

    def counting(self, prompts):
        calls.append(len(prompts))
        return original(self, prompts)

    monkeypatch.setattr(AgentGRPOTrainer, "generate", counting)
    config = make_config(num_generations=2, max_new_tokens=4, steps_per_generation=1)
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=lambda a, b: [float(len(x)) for x in b],
        train_dataset=TEN_ITEMS,
        args=config,
    )
    trainer.train()
    assert calls == [2] * 20  # 10 updates x 2 agents, one item of K=2 each
