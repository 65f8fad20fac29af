"""MADPO on tiny offline models: every agent trains on joint pairs, the others' terms are the pre-update log-ratios,
reference models (full and LoRA), ties, resume and configuration errors."""

import math

import pytest
import torch
from datasets import Dataset
from helpers import changed, length_ratio_reward, snapshot
from peft import LoraConfig

from comlrl_trl.trainers.preference import MADPOConfig, MADPOTrainer
from comlrl_trl.trainers.preference.madpo_trainer import sequence_logps


ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def _config(make_config, **overrides):
    settings = dict(
        config_cls=MADPOConfig,
        num_generations=None,
        preference_num_candidates=4,
        preference_pairs_per_sample=3,
        max_new_tokens=6,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        dpo_beta=0.5,
    )
    settings.update(overrides)
    return make_config(**settings)


def _trainer(path, make_config, reward_func=length_ratio_reward, **kwargs):
    return MADPOTrainer(
        agent_model=path,
        reward_func=reward_func,
        train_dataset=ITEMS,
        args=_config(make_config, **kwargs.pop("config", {})),
        **kwargs,
    )


def _logged(trainer, key):
    return [row[key] for row in trainer.state.log_history if key in row]


def test_madpo_trains_every_agent_on_joint_pairs(qwen_path, make_config):
    trainer = _trainer(qwen_path, make_config)
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    for i, model in enumerate(trainer.agents):
        assert changed(before[i], model) == set(before[i]), f"agent {i}: some parameters did not change"
        losses = _logged(trainer, f"agent_{i}/dpo/loss")
        assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert _logged(trainer, "preference/pairs") == [3.0] * 4  # 4 distinct rewards per item, capped at 3
    chosen, rejected = (
        _logged(trainer, "preference/chosen_reward_mean"),
        _logged(trainer, "preference/rejected_reward_mean"),
    )
    assert all(c > r for c, r in zip(chosen, rejected))
    assert trainer.env_step == 4 * 4 and len(_logged(trainer, "turn_1/reward_mean")) == 4
    assert [type(agent).__name__ for agent in trainer.agent_trainers] == ["MADPOAgent", "MADPOAgent"]


def test_each_agent_gets_the_other_agents_pre_update_log_ratios(qwen_path, make_config):
    trainer = _trainer(qwen_path, make_config, config=dict(preference_pairs_per_sample=None, pair_selection="all"))
    rows = [dict(ITEMS[0]) for _ in range(4)]
    slots = trainer._generate_pair_batches(rows)  # [agent][slot]
    batches = [agent_slots[0] for agent_slots in slots]
    num_pairs = batches[0]["others_logratio"].numel()
    assert num_pairs > 0 and all(b["completion_ids"].size(0) == 2 * num_pairs for b in batches)
    deltas = []
    with torch.no_grad():
        for agent, batch in zip(trainer.agents, batches):
            logps = sequence_logps(
                agent, batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"]
            )
            deltas.append(logps[:num_pairs] - logps[num_pairs:])
    assert torch.allclose(batches[0]["others_logratio"], deltas[1], atol=1e-5)
    assert torch.allclose(batches[1]["others_logratio"], deltas[0], atol=1e-5)
    assert not batches[0]["others_logratio"].requires_grad
    assert torch.equal(batches[0]["ref_logratio"], torch.zeros(num_pairs))  # reference-free by default
    # Chosen rows are the candidates with the higher task reward, for both agents (aligned joint candidates).
    decode = [agent.processing_class.batch_decode for agent in trainer.agent_trainers]
    texts = [decode[a](batches[a]["completion_ids"], skip_special_tokens=True) for a in range(2)]
    rewards = length_ratio_reward(texts[0], texts[1], batch_items=rows[:1])
    assert all(rewards[p] > rewards[num_pairs + p] for p in range(num_pairs))


@pytest.mark.parametrize("lora", [False, True])
def test_reference_model_makes_the_first_loss_log_two(qwen_path, make_config, lora):
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    trainer = _trainer(qwen_path, make_config, config=dict(use_reference_model=True), peft_config=peft_config)
    assert trainer.args.beta == 0.5  # TRL loads the reference because beta != 0
    # with LoRA the reference is the model with its adapter disabled
    assert all((agent.ref_model is None) == lora for agent in trainer.agent_trainers)
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    for i in range(2):
        losses = _logged(trainer, f"agent_{i}/dpo/loss")
        assert losses[0] == pytest.approx(math.log(2.0), abs=1e-5)  # policy == reference: Δ = 0 for every agent
        assert losses[-1] != pytest.approx(math.log(2.0), abs=1e-5)
        moved = changed(before[i], trainer.agents[i])
        assert moved and (not lora or all("lora_" in name for name in moved))


def test_tied_candidates_make_no_pairs_and_no_update(qwen_path, make_config):
    trainer = _trainer(qwen_path, make_config, reward_func=lambda first, second: [1.0] * len(first))
    before = [snapshot(model) for model in trainer.agents]
    trainer.train()
    assert _logged(trainer, "preference/pairs") == [0.0] * 4
    for i, model in enumerate(trainer.agents):
        assert changed(before[i], model) == set()


def test_resume_gives_the_same_weights(qwen_path, make_config, tmp_path):
    straight = _trainer(qwen_path, make_config, config=dict(num_train_epochs=2))
    straight.train()
    first = _trainer(qwen_path, make_config, config=dict(num_train_epochs=1))
    first.train(checkpoint_dir=tmp_path / "ckpt")
    resumed = _trainer(qwen_path, make_config, config=dict(num_train_epochs=2))
    resumed.train(resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-1"), checkpoint_dir=tmp_path / "ckpt")
    for model_a, model_b in zip(straight.agents, resumed.agents):
        for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
            assert torch.equal(p, q), name
    assert _logged(resumed, "agent_1/dpo/loss") == _logged(straight, "agent_1/dpo/loss")
    changed_beta = _trainer(qwen_path, make_config, config=dict(num_train_epochs=2, dpo_beta=0.2))
    with pytest.raises(ValueError, match="dpo_beta: checkpoint has 0.5, this trainer has 0.2"):
        changed_beta.train(resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-1"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(dpo_beta=0.0), "dpo_beta must be a number > 0"),
        (dict(num_generations=8), "num_generations=8 differs from preference_num_candidates=4"),
        (dict(beta=0.04), "beta=0.04 is TRL's GRPO KL coefficient"),
        (dict(num_turns=2), "num_turns=1 only"),
        (dict(preference_num_candidates=1), "preference_num_candidates must be an integer >= 2"),
        (dict(pair_selection="best"), "pair_selection must be one of"),
        (dict(logprob_temperature=None), "logprob_temperature=None: MADPO's loss always uses .* temperature 1"),
    ],
)
def test_config_errors(make_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(make_config, **overrides)


def test_micro_batches_hold_whole_items(qwen_path, make_config):
    with pytest.raises(ValueError, match="must be a multiple of preference_num_candidates=4"):
        _trainer(qwen_path, make_config, config=dict(per_device_train_batch_size=2, steps_per_generation=2))
    with pytest.raises(TypeError, match="args must be a MADPOConfig"):
        MADPOTrainer(agent_model=qwen_path, reward_func=length_ratio_reward, train_dataset=ITEMS, args=make_config())


def test_sequence_logps_in_chunks_match_one_forward(qwen_path):
    """The no-grad log-ratio passes forward a micro-batch's rows at a time; the numbers are those of one forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen_path).eval()
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, model.config.vocab_size, (5, 3), generator=generator)
    completion_ids = torch.randint(0, model.config.vocab_size, (5, 4), generator=generator)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1], [1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with torch.no_grad():
        whole = sequence_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
        chunked = sequence_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, chunk=2)
    hook.remove()
    assert len(calls) == 1 + 3
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)


def test_sequence_logps_runs_the_agreed_number_of_forwards(qwen_path):
    """A process with fewer pairs pads its no-grad pass to the forwards of the busiest process (ZeRO-3 gathers the
    parameters in each one); the padding forwards change no result, and fewer forwards than chunks is refused."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(qwen_path).eval()
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(0, model.config.vocab_size, (3, 2), generator=generator)
    completion_ids = torch.randint(0, model.config.vocab_size, (3, 3), generator=generator)
    prompt_mask, completion_mask = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    tensors = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with torch.no_grad():
        plain = sequence_logps(model, *tensors, chunk=2)  # ceil(3 / 2) = 2 forwards
        padded = sequence_logps(model, *tensors, chunk=2, num_forwards=5)
    hook.remove()
    assert len(calls) == 2 + 5
    assert padded.shape == (3,)
    torch.testing.assert_close(padded, plain)
    with pytest.raises(ValueError, match="num_forwards=1 is fewer than the 2 chunks of 3 rows"):
        sequence_logps(model, *tensors, chunk=2, num_forwards=1)


def test_forwards_needed_is_the_largest_chunk_count_of_the_process(qwen_path):
    """One process: each batch's own ceil(rows / chunk) (the all-process maximum is checked on two ranks)."""
    from types import SimpleNamespace

    from comlrl_trl.trainers.preference.madpo_trainer import forwards_needed

    accelerator = SimpleNamespace(num_processes=1, device=torch.device("cpu"))
    assert forwards_needed([2, 12, 5], 4, accelerator) == [1, 3, 2]
