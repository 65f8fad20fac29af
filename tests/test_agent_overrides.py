"""Per-agent settings (`agent_overrides`): every family trains and samples each agent with its own values."""

import importlib.util
from pathlib import Path

import pytest
from datasets import Dataset
from helpers import changed, length_ratio_reward, snapshot
from test_recipes import _recipe

from comlrl_trl.generation import cpu as cpu_generation
from comlrl_trl.loading import base_model
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer
from comlrl_trl.trainers.preference import MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFTrainer
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer, MARLOOConfig, MARLOOTrainer


ROOT = Path(__file__).parents[1]
ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})
# Agent 0 never moves (lr 0) and samples exactly 6 tokens; agent 1 learns and samples exactly 3.
OVERRIDES = [
    {
        "learning_rate": 0.0,
        "lr_scheduler_type": "linear",
        "weight_decay": 0.0,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "max_new_tokens": 6,
        "generation_kwargs": {"min_new_tokens": 6},
    },
    {
        "agent_learning_rate": 0.05,
        "lr_scheduler_type": "constant",
        "weight_decay": 0.25,
        "temperature": 1.3,
        "top_p": 1.0,
        "top_k": None,
        "max_new_tokens": 3,
        "generation_kwargs": {"min_new_tokens": 3},
    },
]


def _record_generation_configs(trainer, monkeypatch):
    """Record the generation config of every sampling call of each agent: its model's `generate` (TRL's own call) and
    the lean CPU generator's own loop (`lean_generate`, called with the agent's transformers model and its config)."""
    seen = [[] for _ in trainer.agents]
    for i, agent in enumerate(trainer.agent_trainers):
        model = agent.model
        original = model.generate

        def generate(*args, _i=i, _original=original, **kwargs):
            seen[_i].append(kwargs["generation_config"])
            return _original(*args, **kwargs)

        model.generate = generate
    agent_of = {id(base_model(agent.model)): i for i, agent in enumerate(trainer.agent_trainers)}
    lean = cpu_generation.lean_generate

    def lean_generate(model, input_ids, attention_mask, config, decoder=None, logits=None):
        assert decoder is None, "agents with different settings must not decode in one loop"
        seen[agent_of[id(model)]].append(config)
        return lean(model, input_ids, attention_mask, config, decoder=decoder, logits=logits)

    monkeypatch.setattr(cpu_generation, "lean_generate", lean_generate)
    return seen


def _magrpo(path, make_config):
    return MAGRPOTrainer(
        agent_model=path,
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        args=make_config(agent_overrides=OVERRIDES),
    )


def _marloo(path, make_config):
    return MARLOOTrainer(
        agent_model=path,
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        args=make_config(MARLOOConfig, agent_overrides=OVERRIDES),
    )


def _iac(path, make_config):
    return IACTrainer(
        agent_model=path,
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        args=make_config(
            IACConfig,
            num_generations=1,
            per_device_train_batch_size=4,
            use_separate_critic=False,
            agent_overrides=OVERRIDES,
        ),
    )


def _maac(path, make_config):
    return MAACTrainer(
        agent_model=path,
        critic_model=path,
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        args=make_config(MAACConfig, num_generations=1, per_device_train_batch_size=4, agent_overrides=OVERRIDES),
    )


def _madpo(path, make_config):
    return MADPOTrainer(
        agent_model=path,
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        args=make_config(
            MADPOConfig,
            num_generations=None,
            preference_num_candidates=4,
            preference_pairs_per_sample=2,
            agent_overrides=OVERRIDES,
        ),
    )


def _marlhf(path, make_config):
    return MARLHFTrainer(
        agent_model=path,
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        args=make_config(
            MARLHFConfig,
            num_generations=2,
            preference_num_candidates=4,
            preference_pairs_per_sample=2,
            reward_learning_rate=1e-3,
            agent_overrides=OVERRIDES,
        ),
    )


def _marlhf_iac(path, make_config):
    return MARLHFTrainer(
        agent_model=path,
        reward_func=length_ratio_reward,
        train_dataset=ITEMS,
        args=make_config(
            MARLHFConfig,
            rl_algorithm="iac",
            num_generations=1,
            per_device_train_batch_size=4,
            use_separate_critic=False,
            preference_num_candidates=4,
            preference_pairs_per_sample=2,
            reward_learning_rate=1e-3,
            agent_overrides=OVERRIDES,
        ),
    )


FAMILIES = {
    "magrpo": _magrpo,
    "marloo": _marloo,
    "iac": _iac,
    "maac": _maac,
    "madpo": _madpo,
    "marlhf": _marlhf,
    "marlhf-iac": _marlhf_iac,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_agent_trains_and_samples_with_its_own_values(family, qwen_path, make_config, monkeypatch):
    trainer = FAMILIES[family](qwen_path, make_config)
    team = trainer.rl_trainer.agent_trainers if hasattr(trainer, "rl_trainer") else trainer.agent_trainers
    seen = _record_generation_configs(trainer.rl_trainer if hasattr(trainer, "rl_trainer") else trainer, monkeypatch)
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()

    assert changed(before[0], trainer.agents[0]) == set(), "agent 0 has lr=0 and must not move"
    assert changed(before[1], trainer.agents[1]), "agent 1 must learn"
    # sampling: every generate call of an agent used its own values
    expected = [(0.7, 0.9, 5, 6, 6), (1.3, 1.0, 0, 3, 3)]
    for i, configs in enumerate(seen):
        assert configs, f"agent {i} never generated"
        used = {(c.temperature, c.top_p, c.top_k, c.max_new_tokens, c.min_new_tokens) for c in configs}
        assert used == {expected[i]}, (i, used)
    # optimisation: agent 0 linear decay to 0 over the run, agent 1 constant; each its own weight decay
    steps = team[0].state.max_steps
    assert team[0].lr_scheduler.lr_lambdas[0](steps) == 0.0 and team[1].lr_scheduler.lr_lambdas[0](steps) == 1.0
    assert team[1].optimizer.param_groups[0]["lr"] == 0.05
    assert [agent.optimizer.param_groups[0]["weight_decay"] for agent in team] == [0.0, 0.25]


def test_completion_lengths_follow_each_agents_max_new_tokens(qwen_path, make_config):
    trainer = _magrpo(qwen_path, make_config)
    trainer.train()
    logs = [row for row in trainer.state.log_history if "agent_0/completions/mean_length" in row]
    assert {row["agent_0/completions/mean_length"] for row in logs} == {6.0}
    assert {row["agent_1/completions/mean_length"] for row in logs} == {3.0}


def test_no_overrides_keeps_the_config_object(qwen_path, make_config):
    config = make_config()
    trainer = MAGRPOTrainer(agent_model=qwen_path, reward_func=length_ratio_reward, train_dataset=ITEMS, args=config)
    assert trainer.args is config and config.agent_overrides is None
    assert trainer.agent_trainers[1].args.learning_rate == config.learning_rate


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([{"num_generations": 8}, {}], r"agent_overrides\[0\]: num_generations is a team setting"),
        ([{}, {"joint_mode": "cross"}], r"agent_overrides\[1\]: joint_mode is a team setting"),
        ([{}, {"num_turns": 2}], r"agent_overrides\[1\]: num_turns is a team setting"),
        ([{"lerning_rate": 1e-5}, {}], r"agent_overrides\[0\]: unknown key 'lerning_rate'. Per-agent keys: "),
        ([{"reference_kl_coef": 0.1}, {}], r"agent_overrides\[0\]: `reference_kl_coef` is a CoMLRL field.*`beta`"),
        ([{}], r"a list of num_agents=2 dicts"),
        ([{}, None], r"agent_overrides\[1\] must be a dict"),
        ([{"temperature": 0}, {}], r"agent_overrides\[0\]: temperature must be a number > 0, got 0"),
        ([{"top_p": 1.5}, {}], r"top_p must be a number in \(0, 1\], got 1.5"),
        ([{"max_new_tokens": 0}, {}], r"max_new_tokens must be an integer >= 1"),
        ([{"lr_scheduler_type": "cosine_decay"}, {}], r"lr_scheduler_type must be one of 'linear', 'cosine'"),
        ([{"learning_rate": 1e-5, "agent_learning_rate": 2e-5}, {}], r"sets learning_rate twice"),
    ],
)
def test_bad_overrides_are_refused(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        MAGRPOConfig(output_dir=str(tmp_path), agent_overrides=overrides)


def test_overrides_from_yaml_and_command_line(tmp_path):
    config = tmp_path / "team.yaml"
    config.write_text(
        "agent_overrides:\n  - {learning_rate: 1.0e-4, temperature: 0.6}\n"
        "  - {learning_rate: 2.0e-5, max_new_tokens: 16, generation_kwargs: {repetition_penalty: 1.1}}\n"
    )
    parser = _recipe().make_parser()
    _, args, _ = parser.parse_args_and_config(args=["--config", str(config), "--output_dir", str(tmp_path)])
    assert args.agent_overrides == [
        {"learning_rate": 1e-4, "temperature": 0.6},
        {"learning_rate": 2e-5, "max_completion_length": 16, "generation_kwargs": {"repetition_penalty": 1.1}},
    ]
    _, args, _ = parser.parse_args_and_config(
        args=["--output_dir", str(tmp_path), "--agent_overrides", '[{"top_k": 20}, {"weight_decay": 0.1}]']
    )
    assert args.agent_overrides == [{"top_k": 20}, {"weight_decay": 0.1}]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (pip install deepspeed)")
def test_per_agent_optimisers_under_deepspeed_zero2(tmp_path):
    """Without an optimizer section in the DeepSpeed config, every engine gets its agent's own optimiser."""
    from test_distributed import run_torchrun

    report = run_torchrun("deepspeed_agent_overrides.py", tmp_path, 1, zero_stage="2")
    assert report["engines"] == ["DeepSpeedEngine", "DeepSpeedEngine"]
    assert report["changed"] == [0, report["parameters"][1]]  # agent 0 (lr 0) stays, every agent-1 tensor moves
    assert report["lrs"] == [0.0, 0.05] and report["end_factors"] == [0.0, 1.0]  # linear vs constant
