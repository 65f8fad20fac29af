"""Coming from CoMLRL: removed fields and value spellings give errors naming the replacement, in Python and YAML."""

from pathlib import Path

import pytest
from helpers import length_ratio_reward
from test_recipes import _actor_critic_recipe, _recipe

from comlrl_trl.compat import REMOVED_FIELDS
from comlrl_trl.trainers.actor_critic import IACConfig, MAACConfig
from comlrl_trl.trainers.preference import MADPOConfig, MARLHFConfig, MARLHFIterConfig
from comlrl_trl.trainers.reinforce import (
    MAGRPOConfig,
    MAGRPOTrainer,
    MAREINFORCEConfig,
    MAReMaxConfig,
    MARLOOConfig,
)


ROOT = Path(__file__).parents[1]
CONFIGS = [
    MAGRPOConfig,
    MAREINFORCEConfig,
    MARLOOConfig,
    MAReMaxConfig,
    IACConfig,
    MAACConfig,
    MADPOConfig,
    MARLHFConfig,
    MARLHFIterConfig,
]
# Every field of CoMLRL 1.4.3's configs (MAGRPO, centralised MAGRPO, IAC, MAAC, MADPO, MARLHF, MARLHFIter), read
# from the wheel.
COMLRL_FIELDS = [
    "advantage_mode",
    "advantage_normalization",
    "agent_devices",
    "agent_learning_rate",
    "collaboration_mode",
    "comparator_agents",
    "comparator_api_extra_body",
    "comparator_api_format",
    "comparator_api_headers",
    "comparator_api_key",
    "comparator_api_key_env",
    "comparator_api_key_header",
    "comparator_api_key_prefix",
    "comparator_api_max_n_per_request",
    "comparator_api_model",
    "comparator_api_response_field",
    "comparator_api_timeout",
    "comparator_api_url",
    "comparator_centralized_agent_index",
    "comparator_devices",
    "comparator_generation_mode",
    "comparator_history_k",
    "comparator_model_name",
    "comparator_num_candidates",
    "comparator_policy",
    "critic_devices",
    "critic_learning_rate",
    "critic_model_name",
    "critic_type",
    "critic_value_head_hidden_dim",
    "discount",
    "dpo_beta",
    "early_termination_threshold",
    "environment_steps_per_pair",
    "eval_batch_size",
    "eval_interval",
    "eval_num_samples",
    "external_prompt_passthrough",
    "joint_mode",
    "log_reward_distribution",
    "logging_steps",
    "max_new_tokens",
    "num_agents",
    "num_generations",
    "num_iterations",
    "num_train_epochs",
    "num_turns",
    "pair_selection",
    "parallel_training",
    "policy_checkpoint_dir",
    "preference_num_candidates",
    "preference_pairs_per_sample",
    "preference_replay_dir",
    "preference_replay_k",
    "preference_replay_lambda",
    "preference_replay_mode",
    "preference_replay_sample_size",
    "preference_scoring_reward",
    "reference_devices",
    "reference_kl_coef",
    "reference_kl_enabled",
    "reward_freeze_backbone",
    "reward_learning_rate",
    "reward_max_length",
    "reward_model_device",
    "reward_model_name",
    "reward_num_train_epochs",
    "reward_train_batch_size",
    "rl_algorithm",
    "rollout_buffer_size",
    "temperature",
    "top_k",
    "top_p",
    "train_batch_size",
    "use_environment_step",
    "use_separate_critic",
    "value_clip_range",
    "value_head_hidden_dim",
    "value_loss_coef",
]


def test_every_comlrl_field_exists_or_is_explained():
    ours = {name for cls in CONFIGS for name in cls.__dataclass_fields__}
    unexplained = [name for name in COMLRL_FIELDS if name not in ours and name not in REMOVED_FIELDS]
    assert unexplained == []
    assert not set(REMOVED_FIELDS) & ours  # an explained name is never also a real field


@pytest.mark.parametrize(
    "name, replacement",
    [
        ("reference_kl_coef", "beta"),
        ("reference_kl_enabled", "beta"),
        ("rollout_buffer_size", "per_device_train_batch_size"),
        ("train_batch_size", "steps_per_generation"),
        ("parallel_training", "accelerate launch"),
        ("agent_devices", "Accelerate"),
        ("critic_devices", "DeepSpeed"),
        ("reference_devices", "Accelerate"),
    ],
)
@pytest.mark.parametrize("config_cls", CONFIGS, ids=[c.__name__ for c in CONFIGS])
def test_removed_fields_name_their_replacement(config_cls, name, replacement, tmp_path):
    with pytest.raises(TypeError, match=f"{config_cls.__name__}: `{name}` is a CoMLRL field") as error:
        config_cls(output_dir=str(tmp_path), **{name: 1})
    assert replacement in str(error.value)


@pytest.mark.parametrize(
    "config_cls, settings, accepted",
    [
        (MAGRPOConfig, {"joint_mode": "aligned"}, "joint_mode='align'"),
        (MAGRPOConfig, {"joint_mode": "crossed"}, "joint_mode='cross' (CoMLRL 1.4.3 scored"),
        (MAGRPOConfig, {"joint_mode": "Align"}, "joint_mode='align'"),
        (MAGRPOConfig, {"advantage_mode": "RLOO"}, "advantage_mode='rloo'"),
        (MARLHFConfig, {"rl_algorithm": "mareforce"}, "rl_algorithm='mareinforce'"),
        (MARLHFConfig, {"rl_algorithm": "MAGRPO"}, "rl_algorithm='magrpo'"),
        (IACConfig, {"joint_mode": "aligned"}, "joint_mode='align'"),
        (MADPOConfig, {"joint_mode": "aligned"}, "joint_mode='align'"),
    ],
)
def test_comlrl_value_spellings_name_the_accepted_value(config_cls, settings, accepted, tmp_path):
    with pytest.raises(TypeError) as error:
        config_cls(output_dir=str(tmp_path), **settings)
    assert f"use {accepted}" in str(error.value)


def test_negative_beta_is_refused(tmp_path):
    with pytest.raises(ValueError, match="beta is the KL coefficient and must be >= 0"):
        MAGRPOConfig(output_dir=str(tmp_path), beta=-0.1)
    assert MAGRPOConfig(output_dir=str(tmp_path), beta=0.0).beta == 0.0


# ----- recipes: YAML files and command lines -----


@pytest.mark.parametrize(
    "line, expected",
    [
        (
            "reference_kl_coef: 0.05",
            "`reference_kl_coef` is a CoMLRL field that comlrl_trl does not have; use TRL's `beta`",
        ),
        ("rollout_buffer_size: 4", "`rollout_buffer_size` is a CoMLRL field"),
        ("parallel_training: mp", "accelerate launch"),
        ("joint_mode: aligned", "use joint_mode='align'"),
        ("algorithm: MAGRPO", "use algorithm='magrpo'"),
        ("task: length-ratio", "task='length-ratio' is not one of 'length_ratio'"),
    ],
)
def test_recipe_yaml_with_comlrl_names_is_explained(line, expected, tmp_path):
    config = tmp_path / "comlrl.yaml"
    config.write_text(f"task: length_ratio\n{line}\n")
    with pytest.raises(ValueError) as error:
        _recipe().make_parser().parse_args_and_config(args=["--config", str(config), "--output_dir", str(tmp_path)])
    assert expected in str(error.value)


def test_actor_critic_recipe_yaml_and_command_line_explain_removed_fields(tmp_path):
    recipe = _actor_critic_recipe()
    config = tmp_path / "iac.yaml"
    config.write_text("algorithm: iac\ncritic_devices: [cuda:1]\n")
    with pytest.raises(ValueError, match="config file: `critic_devices` is a CoMLRL field"):
        recipe.make_parser("iac").parse_args_and_config(args=["--config", str(config)])
    with pytest.raises(ValueError, match="command line: `reference_kl_coef` is a CoMLRL field.*`beta`"):
        recipe.make_parser("iac").parse_args_and_config(args=["--reference_kl_coef=0.1"])


# ----- small fixes -----


class _HalfStateful:
    """A reward with state_dict but no load_state_dict: its state could be saved but never restored."""

    def __call__(self, first, second, *, batch_items):
        return length_ratio_reward(first, second, batch_items=batch_items)

    def state_dict(self):
        return {}


def test_stateful_object_needs_both_methods(qwen_path, prompts_dataset, make_config):
    with pytest.raises(
        TypeError,
        match=r"reward_func \(_HalfStateful\) defines state_dict\(\) but not "
        r"load_state_dict\(\)",
    ):
        MAGRPOTrainer(
            agent_model=qwen_path, reward_func=_HalfStateful(), train_dataset=prompts_dataset, args=make_config()
        )


def test_first_step_always_logs(qwen_path, prompts_dataset, make_config):
    """logging_steps far above the run's env_steps (2 items x K=4 = 8) still logs the first step."""
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset.select(range(2)),
        args=make_config(logging_steps=1000),
    )
    trainer.train()
    logged = [row["env_step"] for row in trainer.state.log_history if "turn_1/reward_mean" in row]
    assert logged == [4]


def test_compat_recipe_config_sets_comlrl_defaults(tmp_path):
    """The CoMLRL-compatible recipe config holds CoMLRL 1.4.3's MAGRPO defaults (values from its MAGRPOConfig)."""
    recipe = _recipe()
    recipe_args, config, model_args = recipe.make_parser().parse_args_and_config(
        args=[
            "--config",
            str(ROOT / "recipes" / "configs" / "comlrl_compat_smollm2.yaml"),
            "--output_dir",
            str(tmp_path),
        ]
    )
    assert (config.num_train_epochs, config.learning_rate, config.num_generations, config.max_new_tokens) == (
        20,
        5e-6,
        4,
        256,
    )
    assert (config.temperature, config.top_p, config.top_k, config.logprob_temperature) == (0.6, 0.6, 50, 1.0)
    assert config.lr_scheduler_type == "constant" and config.weight_decay == 0.01 and config.max_grad_norm == 0
    assert config.loss_type == "dr_grpo" and config.beta == 0.0 and not config.gradient_checkpointing
    assert config.per_device_train_batch_size == 2 * 4 and config.steps_per_generation == 1  # 2 items per step
    assert (config.logging_steps, config.eval_interval, config.eval_num_samples, config.eval_batch_size) == (
        50,
        16,
        4,
        1,
    )
    assert config.advantage_normalization and config.discount == 1.0 and config.joint_mode == "align"
    assert not config.bf16 and not model_args.use_peft and not recipe_args.chat


def test_dr_grpo_on_policy_is_comlrls_summed_log_prob_loss(qwen_path, prompts_dataset, make_config):
    """With the compat settings the gradient is CoMLRL's REINFORCE loss, -mean_k(A_k * sum_t log pi(y_kt)), divided
    by max_completion_length (a constant that AdamW cancels). Sampled at temperature 0.6: both train the
    log-probabilities of the untempered distribution (logprob_temperature=1.0, CoMLRL's)."""
    import torch
    from transformers import TrainerCallback

    max_len = 6
    captured = {}

    class Check(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            model, batch = trainer.agents[0], captured["batch"]
            params = [p for p in model.parameters() if p.requires_grad]
            ours = [p.grad.detach().clone() for p in params]
            prompt_len = batch["prompt_ids"].size(1)
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt_len - 1 : -1].float()
            logps = logits.log_softmax(-1).gather(2, batch["completion_ids"].unsqueeze(2)).squeeze(2)
            sequence = (logps * batch["completion_mask"]).sum(1)  # CoMLRL: the summed log-probability
            loss = -(batch["advantages"] * sequence).mean()
            reference = torch.autograd.grad(loss, params)
            captured["ratios"] = [
                (o * max_len - r).abs().max().item() / r.abs().max().item()
                for o, r in zip(ours, reference)
                if r.abs().max() > 0
            ]

    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(qwen_path).eos_token_id
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=1,
        reward_func=lambda completions: [float(len(c)) for c in completions],
        train_dataset=prompts_dataset,
        callbacks=[Check()],
        args=make_config(
            num_agents=1,
            loss_type="dr_grpo",
            max_grad_norm=0,
            temperature=0.6,
            logprob_temperature=1.0,
            top_p=1.0,  # the whole distribution: top-p 0.6 would keep only the biased EOS
            top_k=0,
            max_new_tokens=max_len,
            per_device_train_batch_size=8,
            steps_per_generation=1,
            max_steps=1,
            generation_kwargs={"sequence_bias": {(eos,): 6.0}},
        ),
    )  # EOS often: lengths vary
    agent = trainer.agent_trainers[0]
    fill = agent.fill_micro_batches

    def keep_batch(batch, advantages):
        fill(batch, advantages)
        captured["batch"] = agent.micro_batch(0)  # steps_per_generation=1: the whole generation, with advantages

    agent.fill_micro_batches = keep_batch
    trainer.train()
    lengths = captured["batch"]["completion_mask"].sum(1).tolist()
    assert len(set(lengths)) > 1, lengths  # else every token-normalised loss would agree
    assert len(captured["ratios"]) > 10 and max(captured["ratios"]) < 1e-4
