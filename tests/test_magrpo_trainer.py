"""MAGRPO training behaviour on tiny offline models: every agent learns, joint actions, LoRA, KL, saving."""

import math

import pytest
import torch
from helpers import changed, length_ratio_reward, snapshot
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from comlrl_trl.trainers.reinforce import MAGRPOTrainer, MARLOOConfig, MARLOOTrainer


def train_logs(trainer):
    return [row for row in trainer.state.log_history if "agent_0/loss" in row]


def test_every_agent_changes_and_metrics_are_logged(qwen_path, prompts_dataset, make_config):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        args=make_config(),
    )
    assert len(trainer.agents) == 2 and len(trainer.tokenizers) == 2
    assert trainer.agents[0] is not trainer.agents[1]
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()

    for i, model in enumerate(trainer.agents):
        assert changed(before[i], model) == set(before[i]), f"agent {i}: some parameters did not change"
    # 8 items x K=4 aligned joint actions
    assert trainer.env_step == 32
    logs = train_logs(trainer)
    assert [row["env_step"] for row in logs] == list(range(4, 33, 4))
    last = logs[-1]
    for key in (
        "turn_1/reward_mean",
        "turn_1/expected_return",
        "agent_0/loss",
        "agent_1/loss",
        "agent_0/grad_norm",
        "agent_1/grad_norm",
        "agent_1/reward",
        "agent_1/completions/mean_length",
    ):
        assert key in last and math.isfinite(last[key]), key
    assert last["loss"] == pytest.approx(last["agent_0/loss"] + last["agent_1/loss"], abs=1e-6)


def test_logging_steps_counts_optimiser_updates_as_in_trl(qwen_path, prompts_dataset, make_config):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        args=make_config(logging_steps=3),
    )
    trainer.train()
    steps = [(row["step"], row["env_step"]) for row in train_logs(trainer)]
    assert steps == [(1, 4), (3, 12), (6, 24)]  # the first update, then every 3rd; env_step grows by 4 per update


def test_reward_is_called_once_per_item_with_the_item(qwen_path, prompts_dataset, make_config):
    calls = []

    def reward(first, second, *, batch_items):
        calls.append((len(first), len(second), batch_items))
        return length_ratio_reward(first, second, batch_items=batch_items)

    MAGRPOTrainer(agent_model=qwen_path, reward_func=reward, train_dataset=prompts_dataset, args=make_config()).train()
    assert len(calls) == 8
    assert [c[2][0]["target"] for c in calls] == list(range(8))  # task order is kept by default
    assert all(c[:2] == (4, 4) and len(c[2]) == 1 for c in calls)


def test_cross_mode_scores_every_combination(qwen_path, prompts_dataset, make_config):
    seen = []

    def reward(first, second, third):  # no batch_items keyword: it is not passed
        seen.append((list(first), list(second), list(third)))
        return [float(len(a) + 2 * len(b) - len(c)) for a, b, c in zip(first, second, third)]

    config = make_config(num_agents=3, joint_mode="cross", num_generations=2, max_steps=2)
    trainer = MAGRPOTrainer(
        agent_model=qwen_path, num_agents=3, reward_func=reward, train_dataset=prompts_dataset, args=config
    )
    trainer.train()
    assert len(seen) == 2 and trainer.env_step == 2 * 2**3
    first, second, third = seen[0]
    assert len(first) == 8
    # product order (agent 0 varies slowest): j = 4*k0 + 2*k1 + k2
    assert first[:4] == [first[0]] * 4 and third[0::2] == [third[0]] * 4


def test_orchestrator_advantages_follow_the_mode(qwen_path, make_config):
    config = make_config(advantage_normalization=False, max_steps=1)
    trainer = MARLOOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=_items(4),
        args=MARLOOConfig(**_as_dict(config)),
    )
    assert trainer.args.advantage_mode == "rloo" and trainer.args.scale_rewards == "none"
    for model in trainer.agents:
        model.train()
    rows = [{"prompt": "Say something:"}] * 4
    rollout = trainer.orchestrator.rollout(rows)
    first, second = rollout.completions
    rewards = length_ratio_reward(first, second, batch_items=rows[:1])
    # leave-one-out, no normalisation: r_i minus the mean of the other three rewards
    expected = torch.tensor([r - (sum(rewards) - r) / 3 for r in rewards])
    for batch, advantages in zip(rollout.agent_batches, rollout.agent_advantages, strict=True):
        assert "advantages" not in batch  # TRL's own group advantages never reach the loss
        torch.testing.assert_close(advantages, expected)
        # the loss never sees tokens after EOS: the mask covers exactly the generated ids
        lengths = batch["completion_mask"].sum(dim=1)
        assert torch.all(lengths <= batch["completion_ids"].shape[1])
        pad = trainer.tokenizers[0].pad_token_id
        for ids, mask in zip(batch["completion_ids"], batch["completion_mask"]):
            assert torch.all(ids[mask == 0] == pad)


def test_lora_trains_only_adapters_and_logs_reference_kl(qwen_path, prompts_dataset, make_config):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        args=make_config(beta=0.1, max_steps=4),
        peft_config=lora,
    )
    before = [{n: p.detach().clone() for n, p in model.named_parameters()} for model in trainer.agents]
    trainer.train()
    for i, model in enumerate(trainer.agents):
        moved = {n for n, p in model.named_parameters() if not torch.equal(before[i][n], p)}
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        assert moved == trainable, f"agent {i}"
    last = train_logs(trainer)[-1]
    assert last["turn_1/reference_kl_penalty_mean"] == pytest.approx(0.1 * last["turn_1/reference_kl_mean"])
    assert last["turn_1/reference_kl_mean"] > 0


def test_full_finetune_with_reference_model(qwen_path, prompts_dataset, make_config):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        args=make_config(beta=0.05, max_steps=3),
    )
    assert all(agent.ref_model is not None for agent in trainer.agent_trainers)
    trainer.train()
    assert "turn_1/reference_kl_mean" in train_logs(trainer)[-1]


def test_heterogeneous_agents_with_their_own_tokenizers(qwen_path, llama_path, prompts_dataset, make_config):
    trainer = MAGRPOTrainer(
        agents=[qwen_path, llama_path],
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        args=make_config(max_steps=3),
    )
    assert type(trainer.agents[0]).__name__ == "Qwen2ForCausalLM"
    assert type(trainer.agents[1]).__name__ == "LlamaForCausalLM"
    assert len(trainer.tokenizers[0]) != len(trainer.tokenizers[1])
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    assert all(changed(before[i], model) for i, model in enumerate(trainer.agents))


def test_model_objects_with_tokenizer_list(qwen_path, llama_path, prompts_dataset, make_config):
    models = [AutoModelForCausalLM.from_pretrained(p) for p in (qwen_path, llama_path)]
    tokenizers = [AutoTokenizer.from_pretrained(p) for p in (qwen_path, llama_path)]
    trainer = MAGRPOTrainer(
        agents=models,
        tokenizer=tokenizers,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        args=make_config(max_steps=2),
    )
    assert trainer.agents[0] is models[0] and trainer.agents[1] is models[1]
    trainer.train()


def test_save_model_and_continue_training(qwen_path, prompts_dataset, make_config, tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        args=make_config(max_steps=2),
        peft_config=[lora, None],
    )
    trainer.train()
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    assert (out / "agent_0" / "adapter_config.json").is_file()  # LoRA agent: the adapter only
    assert (out / "agent_1" / "model.safetensors").is_file()  # full agent: the weights
    for i in range(2):
        assert (out / f"agent_{i}" / "tokenizer.json").is_file()
        assert not (out / f"agent_{i}" / "optimizer.pt").exists()  # an export, not a checkpoint
    trained = [snapshot(model) for model in trainer.agents]

    continued = MAGRPOTrainer(
        agents=[str(out / "agent_0"), str(out / "agent_1")],
        num_agents=2,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        args=make_config(max_steps=2),
    )
    for i, model in enumerate(continued.agents):  # the trained weights come back
        reloaded = dict(model.named_parameters())
        for name, value in trained[i].items():
            assert torch.equal(reloaded[name], value), name
    before = [snapshot(model) for model in continued.agents]
    continued.train()
    assert all(changed(before[i], model) for i, model in enumerate(continued.agents))


def test_eval_schedule_counts_training_items(qwen_path, prompts_dataset, make_config):
    eval_dataset = _items(3)
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        eval_dataset=eval_dataset,
        args=make_config(eval_interval=3, num_train_epochs=2),
    )
    trainer.train()
    evals = [row for row in trainer.state.log_history if "eval/turn_1/reward_mean" in row]
    # before items 0, 3 and 6 of each of the 2 epochs
    assert [row["env_step"] for row in evals] == [0, 12, 24, 32, 44, 56]
    metrics = trainer.evaluate(num_eval_samples=2)
    assert set(metrics) == {"eval/turn_1/reward_mean", "eval/turn_1/expected_return"}


def test_evaluate_without_eval_dataset_is_empty(qwen_path, prompts_dataset, make_config):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path, reward_func=length_ratio_reward, train_dataset=prompts_dataset, args=make_config()
    )
    assert trainer.evaluate() == {}


@pytest.mark.parametrize(
    "logprob_temperature, trl_temperatures",
    [
        (None, dict(temperature=0.6)),  # the default: log-probabilities at the sampling temperature, as TRL
        # CoMLRL's temperature-1 log-probabilities, in TRL's terms: its temperature is the log-probabilities', and
        # generation_kwargs set the sampling one.
        (1.0, dict(temperature=1.0, generation_kwargs={"temperature": 0.6})),
    ],
)
def test_one_agent_matches_trl_grpo(qwen_path, tmp_path, logprob_temperature, trl_temperatures):
    """With N=1, MAGRPO is GRPO: same seed and data give the same rewards, losses and weights as TRL."""
    dataset = _items(6)
    common = dict(
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=0.05,
        logging_steps=1,
        gradient_checkpointing=False,
        report_to="none",
        num_train_epochs=1,
        seed=3,
        shuffle_dataset=False,
        save_strategy="no",
        bf16=False,
    )

    def trl_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    reference = GRPOTrainer(
        model=qwen_path,
        reward_funcs=trl_reward,
        train_dataset=dataset,
        # Our default samples two updates' items at once (6 items: 3 generations) with CoMLRL's sampling and constant
        # learning rate. TRL gets the same settings; they are not TRL's defaults.
        args=GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            steps_per_generation=2,
            **trl_temperatures,
            top_p=0.6,
            top_k=50,
            lr_scheduler_type="constant",
            **common,
        ),
    )
    reference.train()
    ours = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=1,
        reward_func=lambda c: [float(len(x)) for x in c],
        train_dataset=dataset,
        args=_magrpo_config(
            tmp_path / "ours", num_agents=1, eval_interval=0, logprob_temperature=logprob_temperature, **common
        ),
    )
    assert ours.args.steps_per_generation == 2
    ours.train()

    # logging_steps=1 logs every update in both (6 updates); rewards are logged once per generation (3 generations
    # of 2 items), at the first update after it.
    trl_logs = [row for row in reference.state.log_history if "loss" in row]
    our_logs = train_logs(ours)
    assert [row["step"] for row in trl_logs] == [row["step"] for row in our_logs] == [1, 2, 3, 4, 5, 6]
    trl_rewards = [row["reward"] for row in trl_logs if "reward" in row]
    our_rewards = [row["agent_0/reward"] for row in our_logs if "agent_0/reward" in row]
    assert len(trl_rewards) == len(our_rewards) == 3
    assert our_rewards == pytest.approx(trl_rewards, abs=1e-6)
    assert our_logs[0]["agent_0/loss"] == pytest.approx(trl_logs[0]["loss"], abs=1e-6)
    assert our_logs[0]["agent_0/grad_norm"] == pytest.approx(trl_logs[0]["grad_norm"], rel=1e-5)
    # The same six updates of 0.05-rate AdamW steps, to float rounding (worst difference measured: 6e-6 on a Xeon,
    # 3.7e-4 on an AMD EPYC with AVX512-BF16, where AdamW's normalisation magnifies the rounding of near-zero
    # gradients; a wrong micro-batch, ratio or advantage moves weights by ~1e-2).
    for (name, theirs), mine in zip(reference.model.named_parameters(), ours.agents[0].parameters()):
        torch.testing.assert_close(mine, theirs, atol=1e-3, rtol=0, msg=name)


def _items(n):
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"Question {i}: say a word" for i in range(n)]})


def _magrpo_config(output_dir, **kwargs):
    from comlrl_trl.trainers.reinforce import MAGRPOConfig

    return MAGRPOConfig(output_dir=str(output_dir), **kwargs)


def _as_dict(config):
    keys = (
        "output_dir",
        "num_generations",
        "max_new_tokens",
        "learning_rate",
        "logging_steps",
        "gradient_checkpointing",
        "report_to",
        "num_train_epochs",
        "eval_interval",
        "seed",
        "advantage_normalization",
        "max_steps",
    )
    return {key: getattr(config, key) for key in keys}


def test_iterable_datasets_train_and_evaluate(qwen_path, prompts_dataset, make_config):
    seen = []

    def reward(first, second, *, batch_items):
        seen.append(batch_items[0]["target"])
        return length_ratio_reward(first, second, batch_items=batch_items)

    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=reward,
        train_dataset=prompts_dataset.to_iterable_dataset(),
        eval_dataset=prompts_dataset.select(range(3)).to_iterable_dataset(),
        args=make_config(max_steps=5),
    )
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    assert seen == [0, 1, 2, 3, 4] and trainer.env_step == 20
    assert all(changed(before[i], model) for i, model in enumerate(trainer.agents))
    seen.clear()
    assert set(trainer.evaluate(num_eval_samples=2)) == {"eval/turn_1/reward_mean", "eval/turn_1/expected_return"}
    assert seen == [0, 1]


def test_lora_agents_share_the_frozen_base_weights(qwen_path, prompts_dataset, make_config):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        args=make_config(max_steps=2),
        peft_config=lora,
    )
    first, second = (dict(model.named_parameters()) for model in trainer.agents)
    frozen = [name for name, p in first.items() if not p.requires_grad]
    assert frozen and all(first[n].data_ptr() == second[n].data_ptr() for n in frozen)  # one copy in memory
    adapters = [name for name, p in first.items() if p.requires_grad]
    assert adapters and all(first[n].data_ptr() != second[n].data_ptr() for n in adapters)
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    assert all(changed(before[i], model) == set(before[i]) for i, model in enumerate(trainer.agents))
    assert all(torch.equal(first[n], second[n]) for n in frozen)


def test_agent_step_with_a_missing_gradient_norm_still_steps_and_reports_none():
    """DeepSpeed's clip_grad_norm_ returns None when the engine computed no norm: the agent still steps, schedules
    and zeroes its gradients, and reports None (which the team leaves out of the logged mean) instead of raising on
    float(None); the learning rate of the update is read before the scheduler steps."""
    from types import SimpleNamespace

    from comlrl_trl.adapters.grpo import AgentGRPOTrainer

    calls = []
    norms = iter([None, 3.0])
    rates = iter([0.5, 0.25])
    agent = SimpleNamespace(
        _clip_grad_norm=lambda model: next(norms),
        _get_learning_rate=lambda: next(rates),
        model_wrapped=SimpleNamespace(zero_grad=lambda: calls.append("zero")),
        optimizer=SimpleNamespace(step=lambda: calls.append("step")),
        accelerator=SimpleNamespace(optimizer_step_was_skipped=False),
        args=SimpleNamespace(max_grad_norm=1.0),
        lr_scheduler=SimpleNamespace(step=lambda: calls.append("schedule")),
    )
    assert AgentGRPOTrainer.optimizer_step(agent) is None and agent.last_learning_rate == 0.5
    assert AgentGRPOTrainer.optimizer_step(agent) == 3.0 and agent.last_learning_rate == 0.25
    assert calls == ["step", "schedule", "zero"] * 2


def test_reference_kl_runs_in_chunks_and_matches_one_forward(qwen_path, make_config, prompts_dataset):
    """The rollout-time KL statistic forwards per_device_train_batch_size rows at a time (not a whole turn's rows
    at once) and gives the k3 sum of one plain forward, worked out here from the model's logits."""
    from comlrl_trl.orchestrator import reference_kl_stats

    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=prompts_dataset,
        args=make_config(num_generations=2, per_device_train_batch_size=2, temperature=1.0),
    )
    agent = trainer.agent_trainers[0]
    generator = torch.Generator().manual_seed(0)
    rows, prompt_len, completion_len = 5, 3, 4
    vocab = agent.model.config.vocab_size
    prompt_ids = torch.randint(0, vocab, (rows, prompt_len), generator=generator)
    completion_ids = torch.randint(0, vocab, (rows, completion_len), generator=generator)
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "ref_per_token_logps": -6.0 + 0.5 * torch.randn(rows, completion_len, generator=generator),
    }
    calls = []
    hook = agent.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    stats = reference_kl_stats(agent, batch)
    hook.remove()
    assert len(calls) == 3  # 5 rows in chunks of 2
    with torch.no_grad():
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        logits = agent.model(input_ids=input_ids).logits[:, prompt_len - 1 : -1].float()
        logps = torch.log_softmax(logits, dim=-1).gather(-1, completion_ids[..., None]).squeeze(-1)
    delta = batch["ref_per_token_logps"] - logps
    expected = ((torch.exp(delta) - delta - 1) * completion_mask).sum()
    assert stats[1].item() == 4 + 2 + 1 + 3 + 4
    torch.testing.assert_close(stats[0], expected, rtol=1e-4, atol=1e-4)


def test_by_default_every_agent_keeps_its_learning_rate(qwen_path, make_config):
    # The default schedule is constant (CoMLRL's); TRL's linear decay would end every agent's run at lr 0.
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        reward_func=length_ratio_reward,
        train_dataset=_items(3),
        args=make_config(num_generations=2, max_new_tokens=4, learning_rate=0.01),
    )
    trainer.train()
    assert [agent.state.global_step for agent in trainer.agent_trainers] == [3, 3]
    for agent in trainer.agent_trainers:  # every parameter group (with and without weight decay) of every agent
        assert agent.lr_scheduler.get_last_lr() == [0.01] * len(agent.optimizer.param_groups)
        assert [group["lr"] for group in agent.optimizer.param_groups] == [0.01] * len(agent.optimizer.param_groups)


@pytest.mark.parametrize(
    "logprob_temperature, agent_overrides, expected",
    [
        # (sampling, log-probability) temperature of agents 0 and 1
        (1.0, None, [(0.6, 1.0), (0.6, 1.0)]),
        (None, None, [(0.6, 0.6), (0.6, 0.6)]),
        (None, [{}, {"temperature": 0.9}], [(0.6, 0.6), (0.9, 0.9)]),
        (0.8, [{}, {"temperature": 0.9}], [(0.6, 0.8), (0.9, 0.8)]),
        (1.0, [{}, {"generation_kwargs": {"temperature": 0.7}}], [(0.6, 1.0), (0.7, 1.0)]),  # the user's wins
    ],
)
def test_agents_sample_at_temperature_and_train_log_probabilities_at_logprob_temperature(
    make_team, logprob_temperature, agent_overrides, expected
):
    team = make_team(temperature=0.6, logprob_temperature=logprob_temperature, agent_overrides=agent_overrides)
    for agent, (sampling, logprob) in zip(team.agent_trainers, expected):
        assert agent.generation_config.temperature == sampling
        assert agent.temperature == logprob  # TRL's log-probability heads and loss divide the logits by it
    # The configurations say what the user set, not TRL's rewriting.
    assert [agent.args.temperature for agent in team.agent_trainers] == [
        (overrides or {}).get("temperature", 0.6) for overrides in (agent_overrides or [{}, {}])
    ]
    assert team.agent_trainers[0].args.generation_kwargs is None
