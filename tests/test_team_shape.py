"""The team is N equal agents driven by one loop the team trainer owns.

The team trainer is a TRL `GRPOTrainer` that is none of its agents; every agent, agent 0 included, is a trainer of
the family's agent class with its own optimiser, scheduler and checkpoint files; one optimiser update runs the
callbacks in transformers' order; each agent's learning rate is logged as its own.
"""

import os

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOTrainer

from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer
from comlrl_trl.trainers.preference import MADPOConfig, MADPOTrainer
from comlrl_trl.trainers.reinforce import MAGRPOTrainer


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def _reward(a, b):
    return [float(len(x) - len(y)) for x, y in zip(a, b)]


def _magrpo(qwen_path, make_config, **config):
    settings = dict(num_generations=2, per_device_train_batch_size=2, max_new_tokens=4, max_steps=2)
    return MAGRPOTrainer(
        agent_model=qwen_path, reward_func=_reward, train_dataset=ITEMS, args=make_config(**{**settings, **config})
    )


@pytest.mark.parametrize(
    "family, agent_class",
    [("magrpo", "AgentGRPOTrainer"), ("iac", "ActorAgent"), ("madpo", "MADPOAgent")],
)
def test_every_agent_is_a_trainer_of_one_class_and_the_team_is_none_of_them(
    qwen_path, make_config, family, agent_class
):
    if family == "magrpo":
        trainer = _magrpo(qwen_path, make_config)
    elif family == "iac":
        trainer = IACTrainer(
            agent_model=qwen_path,
            reward_func=_reward,
            train_dataset=ITEMS,
            args=make_config(
                config_cls=IACConfig,
                num_generations=1,
                per_device_train_batch_size=2,
                max_new_tokens=4,
                max_steps=1,
                use_separate_critic=False,
            ),
        )
    else:
        trainer = MADPOTrainer(
            agent_model=qwen_path,
            reward_func=_reward,
            train_dataset=ITEMS,
            args=make_config(
                config_cls=MADPOConfig,
                num_generations=None,
                preference_num_candidates=2,
                per_device_train_batch_size=2,
                max_new_tokens=4,
                max_steps=1,
            ),
        )
    agents = trainer.agent_trainers
    assert isinstance(trainer, GRPOTrainer)
    assert [type(agent).__name__ for agent in agents] == [agent_class] * 2
    assert all(agent is not trainer for agent in agents)
    assert list(trainer.model) == [agent.model for agent in agents]  # the team's model: every agent's, in order
    assert [agent.agent_index for agent in agents] == [0, 1]
    assert trainer.orchestrator.accelerator is trainer.accelerator  # the rollout's collectives: the team's
    assert agents[0].args is not agents[1].args and agents[0].args is not trainer.args
    assert all(family in agent.model.model_tags for agent in agents)  # every agent's model carries its family's tag


def test_every_agent_gets_its_own_optimiser_and_scheduler_and_the_same_checkpoint_files(
    qwen_path, make_config, tmp_path
):
    trainer = _magrpo(qwen_path, make_config)
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    agents = trainer.agent_trainers
    assert agents[0].optimizer is not agents[1].optimizer and agents[0].lr_scheduler is not agents[1].lr_scheduler
    optimised = [{id(p) for group in agent.optimizer.param_groups for p in group["params"]} for agent in agents]
    assert optimised[0] and optimised[1] and not optimised[0] & optimised[1]
    assert all(agent.state.global_step == trainer.state.global_step == 2 for agent in agents)
    (checkpoint,) = (tmp_path / "ckpt").glob("checkpoint-*")
    files = [sorted(os.listdir(checkpoint / f"agent_{i}")) for i in range(2)]
    assert files[0] == files[1]
    assert {"optimizer.pt", "scheduler.pt"} <= set(files[0])
    # The team's own files sit beside the agents' directories, not inside agent 0's.
    assert {"trainer_state.json", "rng_state.pth"} <= set(os.listdir(checkpoint))
    assert "trainer_state.json" not in files[0]


class _Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("train_begin", state.max_steps))

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(("step_begin", state.global_step))

    def on_substep_end(self, args, state, control, **kwargs):
        self.events.append(("substep_end", state.global_step))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.events.append(("pre_optimizer_step", state.global_step))

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.events.append(("optimizer_step", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append(("train_end", state.global_step))


def test_one_update_runs_the_callbacks_in_transformers_order(qwen_path, make_config):
    """Gradient accumulation 2, two updates: every update is step_begin, one substep_end (after the first of its two
    micro-steps), pre_optimizer_step, optimizer_step, then step_end with global_step advanced."""
    recorder = _Recorder()
    config = make_config(
        num_generations=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_new_tokens=4, max_steps=2
    )
    trainer = MAGRPOTrainer(
        agent_model=qwen_path, reward_func=_reward, train_dataset=ITEMS, args=config, callbacks=[recorder]
    )
    trainer.train()
    update = ["step_begin", "substep_end", "pre_optimizer_step", "optimizer_step", "step_end"]
    names = [name for name, _ in recorder.events]
    assert names == ["train_begin", *update, *update, "train_end"]
    assert recorder.events[0] == ("train_begin", 2)
    assert [step for name, step in recorder.events if name == "step_end"] == [1, 2]
    assert [step for name, step in recorder.events if name == "optimizer_step"] == [0, 1]


def test_each_agent_logs_its_own_learning_rate(qwen_path, make_config):
    """Agent 1 trains at a tenth of agent 0's rate: both are logged as agent_i/learning_rate, and TRL's shared
    `learning_rate` key is left out because there is no one rate of the team."""
    trainer = _magrpo(
        qwen_path, make_config, learning_rate=0.1, agent_overrides=[{}, {"learning_rate": 0.01}], logging_steps=1
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "agent_0/loss" in entry]
    assert logs and all(entry["agent_0/learning_rate"] == pytest.approx(0.1) for entry in logs)
    assert all(entry["agent_1/learning_rate"] == pytest.approx(0.01) for entry in logs)
    assert all("learning_rate" not in entry for entry in logs)
    same = _magrpo(qwen_path, make_config, learning_rate=0.1, logging_steps=1)
    same.train()
    assert all(e["learning_rate"] == pytest.approx(0.1) for e in same.state.log_history if "agent_0/loss" in e)


def test_the_logged_team_loss_is_the_sum_of_the_agents_losses(qwen_path, make_config):
    trainer = _magrpo(qwen_path, make_config, logging_steps=1)
    output = trainer.train()
    logs = [entry for entry in trainer.state.log_history if "agent_0/loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        assert entry["loss"] == pytest.approx(entry["agent_0/loss"] + entry["agent_1/loss"])
    assert output.training_loss == pytest.approx(sum(entry["loss"] for entry in logs) / 2)
    assert torch.isfinite(torch.tensor(output.training_loss))


def test_an_agent_is_told_its_place_in_the_team():
    """No agent is agent 0 by default: `agent_index` is a required keyword of every agent trainer."""
    import inspect

    from comlrl_trl.adapters.grpo import AgentGRPOTrainer

    parameter = inspect.signature(AgentGRPOTrainer.__init__).parameters["agent_index"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is inspect.Parameter.empty
    assert "agent_index" not in vars(AgentGRPOTrainer)  # no class-level default either
