"""The default generation schedule: one task item per optimiser update, the items of several updates sampled in one
generation of the team (one joint decoding loop, or one `generate` call per agent), every agent updated at every
step."""

import torch
from datasets import Dataset
from transformers import TrainerCallback

from comlrl_trl.adapters.grpo import AgentGRPOTrainer
from comlrl_trl.generation.cpu import LeanCpuGeneration
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
    calls = []  # the number of prompts of every agent, per generation of the team
    original = LeanCpuGeneration.__call__

    def counting(self, prompts):
        calls.append([len(agent_prompts) for agent_prompts in prompts])
        return original(self, prompts)

    monkeypatch.setattr(LeanCpuGeneration, "__call__", counting)
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
    assert calls == [[4, 4]] * 5
    assert trainer.state.global_step == 10
    assert changes.changed == [[True, True]] * 10


def test_a_set_steps_per_generation_of_one_samples_for_every_update(qwen_path, make_config, monkeypatch):
    calls = []  # the number of prompts of every agent, per generation of the team
    original = LeanCpuGeneration.__call__

    def counting(self, prompts):
        calls.append([len(agent_prompts) for agent_prompts in prompts])
        return original(self, prompts)

    monkeypatch.setattr(LeanCpuGeneration, "__call__", counting)
    config = make_config(num_generations=2, max_new_tokens=4, steps_per_generation=1)
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=lambda a, b: [float(len(x)) for x in b],
        train_dataset=TEN_ITEMS,
        args=config,
    )
    trainer.train()
    assert calls == [[2, 2]] * 10  # 10 updates, one item of K=2 for each agent


def _train_two_items_with_a_scoring_probe(qwen_path, make_config, monkeypatch, **config):
    """Train on two items at two updates per generation (K=2) and return the trainer, the rows of every
    gradient-free log-probability forward, and each generation's micro-batches with reference old
    log-probabilities computed from scratch for all their rows before the first update."""
    forwards, generations = [], []
    forward = AgentGRPOTrainer._get_per_token_logps_and_entropies
    fill = AgentGRPOTrainer.fill_micro_batches

    def counting(self, model, input_ids, *args, **kwargs):
        if not torch.is_grad_enabled():
            forwards.append((self.agent_index, len(input_ids)))
        return forward(self, model, input_ids, *args, **kwargs)

    def filling(self, batch, advantages):
        fill(self, batch, advantages)
        micro_batches = [self.micro_batch(slot) for slot in range(self.args.steps_per_generation)]
        references = []
        for m in micro_batches:
            with torch.no_grad():
                references.append(
                    forward(
                        self,
                        self.model,
                        torch.cat([m["prompt_ids"], m["completion_ids"]], dim=1),
                        torch.cat([m["prompt_mask"], m["completion_mask"]], dim=1),
                        m["completion_ids"].size(1),
                        batch_size=len(m["completion_ids"]),
                    )[0]
                )
        generations.append((self.agent_index, micro_batches, references))

    monkeypatch.setattr(AgentGRPOTrainer, "_get_per_token_logps_and_entropies", counting)
    monkeypatch.setattr(AgentGRPOTrainer, "fill_micro_batches", filling)
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=lambda a, b: [float(len(x)) for x in b],
        train_dataset=TEN_ITEMS.select(range(2)),
        args=make_config(num_generations=2, max_new_tokens=4, steps_per_generation=None, **config),
    )
    trainer.train()
    return trainer, forwards, generations


def test_old_log_probs_are_scored_only_for_the_micro_batches_after_the_first_update(
    qwen_path, make_config, monkeypatch
):
    # Two items, two updates per generation, K=2 (2 rows per micro-batch): TRL would score all 4 rows of a generation
    # before its first update; the first micro-batch is trained before any update, so only the second's 2 rows are.
    trainer, forwards, generations = _train_two_items_with_a_scoring_probe(qwen_path, make_config, monkeypatch)
    assert forwards == [(0, 2), (1, 2)]
    assert [agent for agent, _, _ in generations] == [0, 1]
    for _, (first, second), (_, reference) in generations:
        assert "old_per_token_logps" not in first  # TRL's loss takes its own forward's, detached: ratio 1
        mask = second["completion_mask"].bool()
        assert second["old_per_token_logps"].shape == second["completion_ids"].shape
        torch.testing.assert_close(second["old_per_token_logps"][mask], reference[mask], atol=1e-6, rtol=0)
    assert trainer.state.global_step == 2


def test_old_log_probs_stay_trls_when_the_first_micro_batch_comes_back_after_an_update(
    qwen_path, make_config, monkeypatch
):
    # num_iterations=2: every micro-batch is trained again after the generation's updates, so TRL scores every row.
    _, forwards, generations = _train_two_items_with_a_scoring_probe(
        qwen_path, make_config, monkeypatch, num_iterations=2
    )
    assert forwards == [(0, 4), (1, 4)]
    for _, micro_batches, references in generations:
        for m, reference in zip(micro_batches, references):
            mask = m["completion_mask"].bool()
            torch.testing.assert_close(m["old_per_token_logps"][mask], reference[mask], atol=1e-6, rtol=0)
