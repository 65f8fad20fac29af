"""bf16 mixed precision: generation, forward and backward really run in bf16; N=1 stays TRL's GRPO within tolerance;
the CPU default follows the model size."""

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from comlrl_trl import precision
from comlrl_trl.integrations.machine import matmul_gflops
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer


def _items(n):
    return Dataset.from_dict({"prompt": [f"Question {i}: say a word" for i in range(n)]})


def _lengths(*agent_completions, **kwargs):
    return [float(sum(len(text) for text in joint)) for joint in zip(*agent_completions)]


def _config(tmp_path, **kwargs):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        num_generations=4,
        max_new_tokens=8,
        learning_rate=0.05,
        logging_steps=1,
        report_to="none",
        num_train_epochs=1,
        seed=3,
        eval_interval=0,
    )
    return MAGRPOConfig(**(settings | kwargs))


def test_generation_forward_and_backward_run_in_bf16(qwen_path, tmp_path):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        reward_func=_lengths,
        train_dataset=_items(2),
        args=_config(tmp_path, num_agents=2, bf16=True, per_device_train_batch_size=4),
    )
    seen = {"generation": set(), "training forward": set(), "backward": set()}

    def forward_hook(module, inputs, output):  # beta=0 and one update per rollout: no grad-free scoring pass
        seen["training forward" if torch.is_grad_enabled() else "generation"].add(output.dtype)

    def backward_hook(module, grad_input, grad_output):
        seen["backward"].add(grad_output[0].dtype)

    for model in trainer.agents:
        projection = model.model.layers[0].mlp.up_proj
        projection.register_forward_hook(forward_hook)
        projection.register_full_backward_hook(backward_hook)
    trainer.train()

    assert seen == {"generation": {torch.bfloat16}, "training forward": {torch.bfloat16}, "backward": {torch.bfloat16}}
    # fp32 master weights and optimiser state: only the matrix products run in bf16
    for agent in trainer.agent_trainers:
        assert {p.dtype for p in agent.model.parameters()} == {torch.float32}
        assert {s.dtype for state in agent.optimizer.state.values() for s in state.values() if s.dim() > 0} == {
            torch.float32
        }


def test_bf16_false_keeps_fp32(qwen_path, tmp_path):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=1,
        reward_func=_lengths,
        train_dataset=_items(1),
        args=_config(tmp_path, num_agents=1, bf16=False, per_device_train_batch_size=4),
    )
    dtypes = set()
    trainer.agents[0].model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    trainer.train()
    assert dtypes == {torch.float32}


def test_one_agent_matches_trl_grpo_in_bf16_within_tolerance(qwen_path, tmp_path):
    """In bf16, N=1 MAGRPO still is TRL's GRPO: same rewards, and losses, gradient norms and weights within bf16
    rounding (TRL generates in fp32 and MAGRPO under bf16 autocast, which samples the same tokens here).

    One SGD update: our CPU log-probability head multiplies its gradient products in bf16 where TRL's uses fp32
    (`adapters/cpu_logprob.py`), so the updated weights differ by rounding and the next samples part at this
    test's learning rate. With Adam, a weight whose near-zero gradient changed sign under rounding (a key bias's is
    zero in exact arithmetic) would move the other way by the whole learning rate. The fp32 test in
    tests/test_magrpo_trainer.py checks several updates exactly."""
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
        bf16=True,
        use_cpu=True,
        # On-policy (one generation per update): bf16 rounding moves TRL's clipped off-policy ratios of later
        # updates apart; tests/test_magrpo_trainer.py checks our default (several updates per generation) in fp32.
        steps_per_generation=1,
        optim="sgd",  # Adam's first step moves a weight by the learning rate whatever its gradient's size
        max_steps=1,
    )

    def trl_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    reference = GRPOTrainer(
        model=qwen_path,
        reward_funcs=trl_reward,
        train_dataset=dataset,
        args=GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            temperature=0.6,
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
        reward_func=_lengths,
        train_dataset=dataset,
        args=MAGRPOConfig(output_dir=str(tmp_path / "ours"), num_agents=1, eval_interval=0, **common),
    )
    ours.train()

    trl_logs = [row for row in reference.state.log_history if "reward" in row]
    our_logs = [row for row in ours.state.log_history if "agent_0/loss" in row]
    assert len(trl_logs) == len(our_logs) == 1
    for theirs, mine in zip(trl_logs, our_logs):
        assert mine["agent_0/reward"] == pytest.approx(theirs["reward"], abs=1e-6)  # the same completions
        assert mine["agent_0/loss"] == pytest.approx(theirs["loss"], abs=2e-3)
        assert mine["agent_0/grad_norm"] == pytest.approx(theirs["grad_norm"], rel=2e-2)
    for (name, theirs), mine in zip(reference.model.named_parameters(), ours.agents[0].parameters()):
        torch.testing.assert_close(mine, theirs, atol=2e-3, rtol=2e-2, msg=name)


def test_cpu_default_bf16_is_off_for_models_too_small_to_gain(qwen_path, tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    config = _config(tmp_path, num_agents=1, use_cpu=True)
    assert config.bf16 is True and config.bf16_from_default  # the device supports it ...
    trainer = MAGRPOTrainer(
        agent_model=qwen_path, num_agents=1, reward_func=_lengths, train_dataset=_items(1), args=config
    )
    assert trainer.args.bf16 is False  # ... but hidden size 32 < 256: casts would cost more than bf16 saves
    assert trainer.accelerator.mixed_precision == "no"


def test_a_lora_team_keeps_the_cpu_default_bf16_like_full_fine_tuning(qwen_path, tmp_path, monkeypatch):
    """Budget mode (docs/benchmarks.md, 2026-12-07): on a CPU with bf16 units, LoRA in bf16 learns per CPU second at
    least as well as in fp32 (level at the peer's budget, the peer's final reward reached sooner), as full fine-tuning
    does, so LoRA adapters do not change the default: bf16 stays on where the model gains from it."""
    from peft import LoraConfig

    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(precision, "CPU_BF16_MIN_HIDDEN_SIZE", 32)  # the tiny model stands in for SmolLM2
    config = _config(tmp_path, num_agents=1, use_cpu=True)
    assert config.bf16 is True and config.bf16_from_default
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=1,
        reward_func=_lengths,
        train_dataset=_items(1),
        args=config,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.args.bf16 is True and trainer.accelerator.mixed_precision == "bf16"


def test_explicit_bf16_is_kept_for_small_models(qwen_path, tmp_path):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=1,
        reward_func=_lengths,
        train_dataset=_items(1),
        args=_config(tmp_path, num_agents=1, bf16=True),
    )
    assert trainer.args.bf16 is True and trainer.accelerator.mixed_precision == "bf16"


def test_hidden_size_threshold(qwen_path, monkeypatch):
    assert precision.cpu_bf16_pays_off([qwen_path]) is False  # hidden size 32
    monkeypatch.setattr(precision, "CPU_BF16_MIN_HIDDEN_SIZE", 32)
    assert precision.cpu_bf16_pays_off([qwen_path]) is True


def test_lora_generation_casts_the_frozen_base_once_and_keeps_it_frozen(qwen_path, tmp_path):
    from peft import LoraConfig

    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=1,
        reward_func=_lengths,
        train_dataset=_items(1),
        args=_config(tmp_path, num_agents=1, bf16=True, max_new_tokens=8),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    agent = trainer.agent_trainers[0]
    trainable = {name for name, p in agent.model.named_parameters() if p.requires_grad}
    with torch.profiler.profile(record_shapes=True) as profile:
        agent.generate(["Question 1: say a word"] * 4)
    # The frozen gate and up projections of the 2 layers are [64, 32]: cast to bf16 once each, not once per token.
    casts = [e for e in profile.events() if e.name == "aten::_to_copy" and e.input_shapes[:1] == [[64, 32]]]
    assert len(casts) == 4
    assert {name for name, p in agent.model.named_parameters() if p.requires_grad} == trainable
    assert all("lora_" in name for name in trainable)


def test_training_autocast_is_bf16_where_accelerates_is_a_no_op():
    """Under DeepSpeed Accelerate's autocast() is a null context (native_amp off): bf16 comes from torch's own."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    sentinel = nullcontext("accelerate's")
    deepspeed_like = SimpleNamespace(native_amp=False, device=torch.device("cpu"), autocast=lambda: sentinel)
    with precision.training_autocast(deepspeed_like, bf16=True):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert precision.training_autocast(deepspeed_like, bf16=False) is sentinel  # fp32 (or fp16): Accelerate's
    native = SimpleNamespace(native_amp=True, device=torch.device("cpu"), autocast=lambda: sentinel)
    assert precision.training_autocast(native, bf16=True) is sentinel


def test_critic_and_reference_kl_forwards_run_in_bf16_when_accelerates_autocast_is_off(
    qwen_path, tmp_path, monkeypatch
):
    """MAAC with bf16 and Accelerate's native AMP off (as under DeepSpeed): the critic's rollout-time and training
    forwards, and the agents' rollout-time reference-KL forward, still run their matrix products in bf16."""
    from comlrl_trl.trainers.actor_critic import MAACConfig, MAACTrainer

    trainer = MAACTrainer(
        agent_model=qwen_path,
        critic_model=qwen_path,
        reward_func=_lengths,
        train_dataset=_items(2),
        args=MAACConfig(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=2,
            max_new_tokens=6,
            learning_rate=0.05,
            beta=0.1,
            report_to="none",
            num_train_epochs=1,
            eval_interval=0,
            bf16=True,
            optim="sgd",  # Adam's first step moves a weight by the learning rate whatever its gradient's size
            max_steps=1,
        ),
    )
    for agent in trainer.agent_trainers:
        agent.accelerator.native_amp = False  # DeepSpeed's setting: accelerator.autocast() does nothing
    from comlrl_trl import orchestrator

    seen = {"critic rollout": set(), "critic training": set(), "reference KL": set()}
    in_kl = []

    def recorded_kl(agent, batch):
        in_kl.append(True)
        try:
            return kl_stats(agent, batch)
        finally:
            in_kl.pop()

    kl_stats = orchestrator.reference_kl_stats
    monkeypatch.setattr(orchestrator, "reference_kl_stats", recorded_kl)
    critic_projection = trainer.critics[0].model.model.layers[0].mlp.up_proj
    critic_projection.register_forward_hook(
        lambda m, i, out: seen["critic training" if torch.is_grad_enabled() else "critic rollout"].add(out.dtype)
    )
    for model in trainer.agents:
        model.model.layers[0].mlp.up_proj.register_forward_hook(
            lambda m, i, out: seen["reference KL"].add(out.dtype) if in_kl else None
        )
    trainer.train()
    assert seen == {
        "critic rollout": {torch.bfloat16},
        "critic training": {torch.bfloat16},
        "reference KL": {torch.bfloat16},
    }


def test_matmul_rate_is_the_best_of_the_timed_products_in_gflops():
    # A clock whose timed products take 2 s, 0.5 s and 1 s: the best is 0.5 s. A 100 x 100 product is
    # 2 * 100**3 = 2e6 floating-point operations, so the rate is 2e6 / 0.5 / 1e9 = 0.004 GFLOP/s.
    ticks = iter([0.0, 2.0, 10.0, 10.5, 20.0, 21.0])
    rate = matmul_gflops(torch.float32, size=100, repeats=3, clock=lambda: next(ticks))
    assert rate == pytest.approx(0.004)
