"""Which micro-batches every agent trains on, worked out by hand: each agent its own buffered generation's
micro-batches in order, filled through the same entry for every agent (agent 0 is not special)."""

from datasets import Dataset

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
        original = agent.forward_backward

        def step(inputs):
            used[agent.agent_index].append(next(i for i in range(2) if agent.micro_batch(i) is inputs))
            return original(inputs)

        return step

    for agent in trainer.agent_trainers:
        agent.forward_backward = recording(agent)
    trainer.train()
    assert used == {0: [0, 1, 0, 1], 1: [0, 1, 0, 1]}  # 2 optimiser steps x 2 micro-batches, for every agent


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
