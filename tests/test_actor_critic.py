"""IAC and MAAC on tiny models: what trains, what the critics learn, targets, rewards, saving and resuming."""

import os

import pytest
import torch
from datasets import Dataset
from helpers import changed, snapshot
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer

from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer, RolloutSample


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(8)]})


def _config(make_config, config_cls=IACConfig, **overrides):
    settings = dict(
        config_cls=config_cls,
        num_generations=1,
        per_device_train_batch_size=4,
        max_new_tokens=6,
        learning_rate=0.05,
        lr_scheduler_type="constant",
    )
    settings.update(overrides)
    return make_config(**settings)


def _reward(first, second):
    return [len(b) / (1.0 + len(a)) for a, b in zip(first, second)]


def _logged(trainer, key):
    return [row[key] for row in trainer.state.log_history if key in row]


@pytest.mark.parametrize("critic_type", ["v", "q"])
def test_iac_shared_heads_train_with_the_actors(qwen_path, make_config, critic_type):
    trainer = IACTrainer(
        agent_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config, use_separate_critic=False, critic_type=critic_type),
    )
    assert trainer.critics == []
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    for i, model in enumerate(trainer.agents):
        moved = changed(before[i], model)
        assert {"value_head.net.0.weight", "value_head.net.0.bias"} <= moved, i
        assert any(name.startswith("model.layers.") for name in moved), i
        assert len(_logged(trainer, f"agent_{i}/value_loss")) == 2


@pytest.mark.parametrize("critic_type", ["v", "q"])
def test_iac_separate_critics_and_actors_all_change(qwen_path, make_config, critic_type):
    trainer = IACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config, critic_type=critic_type, critic_learning_rate=0.01),
    )
    assert len(trainer.critics) == 2 and trainer.critics[0] is not trainer.critics[1]
    actors = [snapshot(model) for model in trainer.agents]
    critics = [snapshot(critic) for critic in trainer.critics]
    trainer.train()
    for i in range(2):
        assert changed(actors[i], trainer.agents[i]), f"actor {i}"
        moved = changed(critics[i], trainer.critics[i])
        assert "value_head.net.0.weight" in moved and any(n.startswith("model.model.layers.") for n in moved), i
    assert trainer.critic_set.optimizers[0].param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize("critic_type", ["v", "q"])
def test_maac_trains_one_critic_once_per_joint_sample(qwen_path, make_config, critic_type):
    trainer = MAACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(
            make_config, MAACConfig, critic_type=critic_type, steps_per_generation=2, per_device_train_batch_size=2
        ),
    )
    actors = [snapshot(model) for model in trainer.agents]
    critic = snapshot(trainer.critics[0])
    calls = []
    step = trainer.critic_set.optimizers[0].step
    trainer.critic_set.optimizers[0].step = lambda *a, **k: (calls.append(1), step(*a, **k))[1]
    trainer.train()
    for i in range(2):
        assert changed(actors[i], trainer.agents[i]), f"actor {i}"
    assert "value_head.net.0.weight" in changed(critic, trainer.critics[0])
    # 8 items, 2 rollouts of 4 joint samples, each split into 2 micro-batches: 4 critic steps, not 4 per agent.
    assert len(calls) == 4 and trainer.state.global_step == 4
    assert len(_logged(trainer, "critic/value_loss")) > 0


@pytest.mark.parametrize("setup", ["shared", "separate", "maac"])
def test_value_loss_falls_on_a_fixed_reward(qwen_path, make_config, setup):
    def constant(first, second):
        return [1.0] * len(first)

    config_cls = MAACConfig if setup == "maac" else IACConfig
    extra = {"use_separate_critic": setup == "separate"} if setup != "maac" else {}
    args = _config(
        make_config,
        config_cls,
        num_train_epochs=4,
        learning_rate=1e-6,
        critic_learning_rate=0.005,
        value_clip_range=None,
        **extra,
    )
    if setup == "shared":
        args.learning_rate = 0.005  # the shared head learns with the actor's optimiser
    trainer_cls = MAACTrainer if setup == "maac" else IACTrainer
    critic = {} if setup == "shared" else {"critic_model": qwen_path}
    trainer = trainer_cls(agent_model=qwen_path, reward_func=constant, train_dataset=ITEMS, args=args, **critic)
    trainer.train()
    key = "critic/value_loss" if setup == "maac" else "agent_0/value_loss"
    losses = _logged(trainer, key)
    assert len(losses) == 8
    assert losses[0] == pytest.approx(1.0, abs=1e-6)  # zero-initialised heads: V = 0, target 1
    assert losses[-1] < 0.1 * losses[0], losses


def _transition(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    return [f"Turn {len(prompt_history_per_agent[a]) + 1}: go on" for a in range(num_agents)]


@pytest.mark.parametrize(
    "trainer_cls, separate",
    [(IACTrainer, True), (IACTrainer, False), (MAACTrainer, None)],
    ids=["iac", "iac-shared", "maac"],
)
def test_multi_turn_targets_bootstrap_from_the_next_turn(qwen_path, make_config, trainer_cls, separate):
    rollouts = []

    def callback(samples):
        rollouts.append(samples)
        return {"samples": len(samples)}

    config_cls = IACConfig if trainer_cls is IACTrainer else MAACConfig
    extra = {} if separate is None else {"use_separate_critic": separate}
    args = _config(make_config, config_cls, num_turns=2, discount=0.5, num_train_epochs=2, **extra)
    critic = {} if separate is False else {"critic_model": qwen_path}
    trainer = trainer_cls(
        agent_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=args,
        external_transition=_transition,
        metrics_callback=callback,
        **critic,
    )
    trainer.train()
    assert len(rollouts) == 16 and all(len(samples) == 4 for samples in rollouts)  # 2 agents x 2 turns per item
    assert _logged(trainer, "samples") == [4.0] * 4
    checked = 0
    for samples in rollouts:
        assert all(isinstance(s, RolloutSample) for s in samples)
        for a in range(2):
            first, second = (
                next(s for s in samples if s.agent_idx == a and s.metadata["turn_idx"] == t) for t in (0, 1)
            )
            assert second.metadata["value_target"] == pytest.approx(second.metadata["reward"], abs=1e-6)
            expected = first.metadata["reward"] + 0.5 * second.metadata["value"]
            assert first.metadata["value_target"] == pytest.approx(expected, abs=1e-5)
            assert first.metadata["batch_item"]["prompt"].startswith("Item ")
            checked += abs(second.metadata["value"]) > 0
    assert checked > 0  # after the first update the bootstrapped values are not all zero


def test_rewards_per_agent_reach_each_agent(qwen_path, make_config):
    rollouts = []
    trainer = IACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=lambda a, b: [1.0, -1.0],
        train_dataset=ITEMS,
        args=_config(make_config, num_generations=3, per_device_train_batch_size=6),
        metrics_callback=lambda samples: rollouts.append(samples) or {},
    )
    trainer.train()
    samples = [s for batch in rollouts for s in batch]
    assert {s.metadata["reward"] for s in samples if s.agent_idx == 0} == {1.0}
    assert {s.metadata["reward"] for s in samples if s.agent_idx == 1} == {-1.0}
    assert _logged(trainer, "agent_1/rewards/joint_reward/mean")[0] == -1.0
    assert _logged(trainer, "turn_1/reward_mean")[0] == 0.0  # the team's reward: the mean over agents


class _CountingMetrics:
    """A stateful metrics_callback: its count of training rollouts must survive a resume."""

    def __init__(self):
        self.calls = 0

    def __call__(self, samples):
        self.calls += 1
        return {}

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_a_stateful_metrics_callback_is_restored_on_resume(qwen_path, make_config, tmp_path):
    def build(epochs):
        callback = _CountingMetrics()
        trainer = IACTrainer(
            agent_model=qwen_path,
            critic_model=qwen_path,
            reward_func=_reward,
            train_dataset=ITEMS.select(range(2)),
            args=_config(make_config, num_train_epochs=epochs, eval_interval=0),
            metrics_callback=callback,
        )
        return trainer, callback

    trainer, once = build(1)
    trainer.train(checkpoint_dir=tmp_path / "ckpt")
    assert once.calls > 0
    trainer, resumed = build(2)
    trainer.train(resume_from_checkpoint=True, checkpoint_dir=tmp_path / "ckpt")
    assert resumed.calls == 2 * once.calls  # restored from epoch 1, then the same number again in epoch 2


def test_a_wrong_number_of_rewards_is_a_clear_error(qwen_path, make_config):
    trainer = IACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=lambda a, b: [0.0] * 5,
        train_dataset=ITEMS,
        args=_config(make_config, num_generations=3, per_device_train_batch_size=3),
    )
    with pytest.raises(ValueError, match=r"returned 5 values.*1 \(shared\), 3 .* 2 .*task item 0, turn 1"):
        trainer.train()


def test_heterogeneous_actors_with_their_own_tokenizers_and_critics(qwen_path, llama_path, make_config):
    tokenizers = [AutoTokenizer.from_pretrained(p, padding_side="left") for p in (qwen_path, llama_path)]
    iac = IACTrainer(
        agents=[qwen_path, llama_path],
        tokenizer=tokenizers,
        critics=[qwen_path, llama_path],
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config),
    )
    before = [snapshot(c) for c in iac.critics]
    iac.train()
    assert all(changed(b, c) for b, c in zip(before, iac.critics))
    assert [type(c.model).__name__ for c in iac.critics] == ["Qwen2ForCausalLM", "LlamaForCausalLM"]
    maac = MAACTrainer(
        agents=[qwen_path, llama_path],
        tokenizer=tokenizers,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config, MAACConfig),
    )
    maac.train()
    with pytest.raises(ValueError, match="has 384 token embeddings but its tokenizer has 512 tokens"):
        IACTrainer(  # critic i reads agent i's ids: a Llama critic cannot read the Qwen agent's
            agents=[qwen_path, llama_path],
            tokenizer=tokenizers,
            critics=[llama_path, llama_path],
            reward_func=_reward,
            train_dataset=ITEMS,
            args=_config(make_config),
        )


def test_maac_critic_reads_each_agents_text_in_its_own_tokenizer(qwen_path, llama_path, make_config):
    """Agents with different tokenizers (Llama's 384 ids, Qwen's 512) share one Qwen critic: each agent's response
    enters the joint text as its own tokenizer decodes it, and the critic reads the Qwen tokenizer's ids of that
    text, not the first agent's tokenizer's."""
    agent_tokenizers = [AutoTokenizer.from_pretrained(p, padding_side="left") for p in (llama_path, qwen_path)]
    trainer = MAACTrainer(
        agents=[llama_path, qwen_path],
        tokenizer=agent_tokenizers,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config, MAACConfig, critic_type="q", max_steps=1),
    )
    critic_set, seen = trainer.critic_set, {"texts": [], "ids": [], "responses": []}
    encode, rollout_values, forward = critic_set._encode, critic_set.rollout_values, trainer.critics[0].forward

    def recording_encode(texts):
        seen["texts"].append(list(texts))
        return encode(texts)

    def recording_forward(ids, mask, index):
        seen["ids"].append([row[m.bool()].tolist() for row, m in zip(ids, mask)])
        return forward(ids, mask, index)

    def recording_rollout_values(turns, scored):
        values = rollout_values(turns, scored)
        for t, texts in enumerate(critic_set._turn_texts):
            for a, tokenizer in enumerate(agent_tokenizers):
                batch = scored[a][t]
                for row, text in enumerate(texts):
                    ids = batch["completion_ids"][row][batch["completion_mask"][row].bool()]
                    seen["responses"].append((a, tokenizer.decode(ids, skip_special_tokens=True), text))
        return values

    critic_set._encode, critic_set.rollout_values = recording_encode, recording_rollout_values
    trainer.critics[0].forward = recording_forward
    trainer.train()

    assert seen["responses"] and {a for a, _, _ in seen["responses"]} == {0, 1}
    for a, response, text in seen["responses"]:
        assert f"[Agent {a + 1} response]\n{response}" in text
    critic_tokenizer = AutoTokenizer.from_pretrained(qwen_path)
    assert len(seen["texts"]) == len(seen["ids"]) > 0
    for texts, ids in zip(seen["texts"], seen["ids"]):
        assert ids == [critic_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    first_agent_ids = agent_tokenizers[0](seen["texts"][0][0], add_special_tokens=False)["input_ids"]
    assert seen["ids"][0][0] != first_agent_ids  # the two tokenizers disagree on the joint text


def test_lora_actors_and_critics_train_only_adapters_and_heads(qwen_path, make_config):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = IACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config),
        peft_config=lora,
        critic_peft_config=lora,
    )
    critic = trainer.critics[0]
    trainable = {name for name, p in critic.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name or name.startswith("value_head.") for name in trainable)
    before = snapshot(critic)
    trainer.train()
    assert any("lora_B" in name for name in changed(before, critic))


def test_evaluate_takes_no_count_and_averages_metrics_callback(qwen_path, make_config):
    seen = []

    def callback(samples):
        seen.append(samples)
        return {"mean_length": sum(len(s.completion) for s in samples) / len(samples), "note": "text is dropped"}

    trainer = MAACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        eval_dataset=ITEMS,
        metrics_callback=callback,
        args=_config(make_config, MAACConfig, eval_num_samples=3),
    )
    metrics = trainer.evaluate()
    assert len(seen) == 3 and all(len(samples) == 2 for samples in seen)
    assert [s.metadata["generation_idx"] for s in seen[0]] == [0, 0]
    expected = sum(sum(len(s.completion) for s in samples) / 2 for samples in seen) / 3
    assert metrics["eval/mean_length"] == pytest.approx(expected)
    assert "eval/note" not in metrics and "eval/turn_1/reward_mean" in metrics


def test_iac_save_model_layouts_and_head_restore(qwen_path, make_config, tmp_path):
    shared = IACTrainer(
        agent_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config, use_separate_critic=False, value_head_hidden_dim=8),
    )
    shared.train()
    shared.save_model(str(tmp_path / "shared"))
    for i in range(2):
        files = set(os.listdir(tmp_path / "shared" / f"agent_{i}"))
        assert {"model.safetensors", "tokenizer.json", "value_head.pt"} <= files
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "shared" / f"agent_{i}")
        assert not hasattr(reloaded, "value_head")  # the head is not inside the model weights
    dirs = [str(tmp_path / "shared" / f"agent_{i}") for i in range(2)]
    continued = IACTrainer(
        agents=dirs,
        tokenizer=[AutoTokenizer.from_pretrained(d) for d in dirs],
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config, use_separate_critic=False, value_head_hidden_dim=8),
    )
    for i in range(2):
        head = continued.agents[i].value_head
        assert not any(p.abs().sum() > 0 for p in head.net[-1].parameters())  # a fresh head starts at zero
        head.load_state_dict(torch.load(tmp_path / "shared" / f"agent_{i}" / "value_head.pt", weights_only=True))
        for p, q in zip(head.parameters(), shared.agents[i].value_head.parameters()):
            assert torch.equal(p, q)

    separate = IACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config),
    )
    separate.train()
    separate.save_model(str(tmp_path / "separate"))
    for i in range(2):
        critic_dir = tmp_path / "separate" / f"agent_{i}" / "critic"
        assert {"model.safetensors", "value_head.pt", "tokenizer.json"} <= set(os.listdir(critic_dir))
        assert "value_head.pt" not in os.listdir(tmp_path / "separate" / f"agent_{i}")


def _ac_trainer(path, make_config, epochs, trainer_cls=IACTrainer, **config):
    config_cls = IACConfig if trainer_cls is IACTrainer else MAACConfig
    critic = {} if config.get("use_separate_critic") is False else {"critic_model": path}
    return trainer_cls(
        agent_model=path,
        reward_func=_reward,
        train_dataset=ITEMS,
        eval_dataset=ITEMS,
        args=_config(make_config, config_cls, num_train_epochs=epochs, eval_interval=4, **config),
        **critic,
    )


@pytest.mark.parametrize("setup", [(IACTrainer, False), (IACTrainer, True), (MAACTrainer, None)])
def test_resume_restores_heads_critics_and_their_optimisers(qwen_path, make_config, tmp_path, setup):
    trainer_cls, separate = setup
    config = {} if separate is None else {"use_separate_critic": separate}
    straight = _ac_trainer(qwen_path, make_config, 2, trainer_cls, **config)
    straight.train()
    first = _ac_trainer(qwen_path, make_config, 1, trainer_cls, **config)
    first.train(checkpoint_dir=tmp_path / "ckpt")
    if trainer_cls is MAACTrainer or separate:
        assert os.path.isfile(tmp_path / "ckpt" / "checkpoint-1" / "critic_optimizers.pt")
    resumed = _ac_trainer(qwen_path, make_config, 2, trainer_cls, **config)
    resumed.train(resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-1"), checkpoint_dir=tmp_path / "ckpt")
    for a, b in zip(straight.agents + straight.critics, resumed.agents + resumed.critics, strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert torch.equal(p, q), name
    key = "turn_1/reward_mean"
    assert _logged(resumed, key) == _logged(straight, key) and len(_logged(straight, key)) == 4


def test_critic_gradients_are_averaged_in_buckets_not_per_parameter():
    """One all-reduce per bucket (same dtype, at most bucket_numel elements), each gradient back in place."""
    from types import SimpleNamespace

    from comlrl_trl.trainers.actor_critic.critics import average_gradients

    calls = []

    def reduce(tensor, reduction):
        calls.append((tensor.numel(), tensor.dtype, reduction))
        return tensor / 2  # what a mean over two processes holding these gradients and zeros would give

    params = [
        torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        for shape, dtype in [
            ((2, 3), torch.float32),
            ((4,), torch.float32),
            ((5,), torch.float32),
            ((3,), torch.bfloat16),
        ]
    ]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i + 1))
    average_gradients(params, SimpleNamespace(reduce=reduce), bucket_numel=10)
    assert calls == [(10, torch.float32, "mean"), (5, torch.float32, "mean"), (3, torch.bfloat16, "mean")]
    for i, p in enumerate(params):
        assert torch.equal(p.grad, torch.full_like(p, (i + 1) / 2)) and p.grad.shape == p.shape


def test_rollout_value_forwards_pad_to_the_count_every_process_runs():
    """Under ZeRO-3 every value forward gathers the partitioned weights: a process with fewer rows runs extra
    forwards on its first row (discarded), as many as the process with the most; fewer than its chunks is refused."""
    from comlrl_trl.trainers.actor_critic.critics import _VALUE_CHUNK, batch_values

    rows, calls = _VALUE_CHUNK + 1, []

    def forward(ids, mask, index):
        calls.append(ids.size(0))
        return torch.arange(ids.size(0), dtype=torch.float32)

    batch = {"prompt_ids": torch.ones(rows, 3, dtype=torch.long), "prompt_mask": torch.ones(rows, 3, dtype=torch.long)}
    assert batch_values(forward, batch, "v").shape == (rows,) and calls == [_VALUE_CHUNK, 1]
    calls.clear()
    values = batch_values(forward, batch, "v", num_forwards=4)
    assert calls == [_VALUE_CHUNK, 1, 1, 1] and values.shape == (rows,)
    with pytest.raises(ValueError, match="fewer than the 2 chunks"):
        batch_values(forward, batch, "v", num_forwards=1)


def test_a_critic_engine_config_follows_the_agents_plugin_with_the_critics_own_optimiser():
    """The critic's engine: the plugin's ZeRO settings ("auto" buckets from the critic's hidden size, other "auto"
    values dropped), the run's batch, accumulation, clipping and bf16, no optimiser section (its own AdamW), and the
    accumulation ended by the caller's step."""
    from types import SimpleNamespace

    from comlrl_trl.trainers.actor_critic.critics import critic_engine_config

    plugin = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {"type": "WarmupLR"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "overlap_comm": "auto", "offload_param": {}},
        "steps_per_print": float("inf"),
    }
    args = SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=3, max_grad_norm=0.5, bf16=True)
    config = critic_engine_config(plugin, args, hidden=8)
    assert config == {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "gradient_clipping": 0.5,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 64, "offload_param": {}},
        "steps_per_print": float("inf"),
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "managed_gradient_accumulation": False,
    }
    assert plugin["zero_optimization"]["reduce_bucket_size"] == "auto"  # the agents' plugin is left as it was


def test_a_bf16_critic_keeps_fp32_master_weights_and_fp16_is_refused(qwen_path, make_config):
    """A critic loaded in bf16 is stepped by its own plain AdamW: its trainable weights are stored in fp32 (bf16
    comes from autocast), and fp16, which would need a gradient scaler for the value loss, is refused."""
    kwargs = dict(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        model_config={"critic_model_kwargs": {"dtype": torch.bfloat16}},
    )
    trainer = MAACTrainer(args=_config(make_config, MAACConfig), **kwargs)
    critic = trainer.critics[0]
    assert {p.dtype for p in critic.parameters() if p.requires_grad} == {torch.float32}
    args = _config(make_config, MAACConfig)
    args.fp16 = True  # a CPU config cannot ask for fp16 itself; the check is the trainer's
    with pytest.raises(ValueError, match="fp16=True is not supported with critics that have their own optimisers"):
        MAACTrainer(args=args, **kwargs)


def test_bf16_actor_weights_without_deepspeed_warn(qwen_path, make_config):
    """Full fine-tuning of weights stored in bf16 without DeepSpeed is pure-bf16 AdamW: a warning says so."""
    from comlrl_trl.trainers.reinforce import MAGRPOTrainer

    with pytest.warns(UserWarning, match=r"Agent 0 trains \d+ parameters stored in torch.bfloat16 without DeepSpeed"):
        MAGRPOTrainer(
            agent_model=qwen_path,
            reward_func=_reward,
            train_dataset=ITEMS,
            args=make_config(model_init_kwargs={"dtype": "bfloat16"}),
        )


def test_joint_critic_input_is_truncated_from_the_left(qwen_path, make_config):
    """The centralised critic reads the joint text of every agent: at most num_agents * max_prompt_length tokens
    for a V critic, cut from the left so that the last token, where the value is read, stays."""
    trainer = MAACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config, MAACConfig, max_prompt_length=4),
    )
    critic_set = trainer.critic_set
    long_text = "Item 1: say something long enough " * 4
    full = critic_set.tokenizer(long_text, add_special_tokens=False)["input_ids"]
    ids, mask, index = critic_set._encode([long_text, "hi"])
    assert ids.shape[1] == 8 and ids[0].tolist() == full[-8:] and mask[0].all()
    assert index.tolist() == [7, 7]


def test_a_head_on_a_zero3_partitioned_backbone_takes_its_dtype_and_otherwise_stays_fp32():
    """ZeRO-3 partitions the backbone in DeepSpeed's precision while loading and casts nothing added later; its
    optimiser takes one dtype per partition, so a head attached there must share the backbone's dtype."""
    from comlrl_trl.loading import attach_value_head
    from comlrl_trl.value_models import ValueHead

    plain = torch.nn.Linear(4, 4).to(torch.bfloat16)  # a bf16 model without DeepSpeed: the head stays fp32
    attach_value_head(plain, ValueHead(4))
    assert {p.dtype for p in plain.value_head.parameters()} == {torch.float32}

    partitioned = torch.nn.Linear(4, 4).to(torch.bfloat16)
    partitioned.weight.ds_id = 0  # how DeepSpeed marks a ZeRO-3 parameter
    attach_value_head(partitioned, ValueHead(4, hidden_dim=3))
    assert {p.dtype for p in partitioned.value_head.parameters()} == {torch.bfloat16}
    assert partitioned.value_head.net[0].weight.shape == (3, 4)  # the whole head, not only its output layer


def test_actors_train_log_probabilities_at_logprob_temperature_and_sample_at_temperature(qwen_path, make_config):
    trainer = IACTrainer(
        agent_model=qwen_path,
        reward_func=_reward,
        train_dataset=ITEMS,
        args=_config(make_config, use_separate_critic=False, temperature=0.7, logprob_temperature=1.0, max_steps=1),
    )
    for actor in trainer.agent_trainers:
        assert (actor.generation_config.temperature, actor.temperature) == (0.7, 1.0)
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    assert all(changed(before[i], model) for i, model in enumerate(trainer.agents))
