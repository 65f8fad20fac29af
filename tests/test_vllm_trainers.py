"""`use_vllm=True` in every team trainer: generation goes through the team's vLLM engines (`make test-vllm`).

Each test builds a trainer on a tiny random Qwen2 saved to disk (vLLM's CPU attention needs a head size of at least
32), trains one or two steps and checks what went through the team's one engine: which agents generated, that every
agent's new weights were pushed after its optimiser step and loaded before its generation, that the engine is put to
sleep between generation and training, and that TRL applied its importance-sampling correction with the engine's
log-probabilities.
"""

import os

import pytest
import torch
from helpers import sampling_ratios


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: plenty for these models
vllm = pytest.importorskip("vllm")

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from comlrl_trl.adapters.grpo import AgentGRPOTrainer  # noqa: E402
from comlrl_trl.generation import TeamVLLM  # noqa: E402
from comlrl_trl.testing import build_tokenizer  # noqa: E402
from comlrl_trl.trainers.actor_critic import IACConfig, IACTrainer, MAACConfig, MAACTrainer  # noqa: E402
from comlrl_trl.trainers.preference import MADPOConfig, MADPOTrainer, MARLHFConfig, MARLHFTrainer  # noqa: E402
from comlrl_trl.trainers.reinforce import MAGRPOTrainer  # noqa: E402


pytestmark = pytest.mark.vllm

ITEMS = Dataset.from_dict({"prompt": [f"Item {i}: say something" for i in range(4)]})


def length_reward(*agent_completions, **kwargs):
    return [float(sum(len(text) for text in joint) % 5) for joint in zip(*agent_completions)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-vllm")
    tokenizer = build_tokenizer("qwen2")
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=512,
        vocab_size=len(tokenizer),
        **ids,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def calls(monkeypatch):
    """Every engine generation, weight sync and sleep: (agent index, rows), agent indices, and every call in order."""
    record = {"generate": [], "sync": [], "order": []}
    generate, sync, sleep = TeamVLLM.generate, TeamVLLM.sync, TeamVLLM.sleep

    def recording_generate(self, agent_index, prompt_ids):
        record["generate"].append((agent_index, len(prompt_ids)))
        record["order"].append(f"generate {agent_index}")
        return generate(self, agent_index, prompt_ids)

    def recording_sync(self, agent_index, model):
        record["sync"].append(agent_index)
        record["order"].append(f"sync {agent_index}")
        return sync(self, agent_index, model)

    def recording_sleep(self):
        record["order"].append("sleep")
        return sleep(self)

    monkeypatch.setattr(TeamVLLM, "generate", recording_generate)
    monkeypatch.setattr(TeamVLLM, "sync", recording_sync)
    monkeypatch.setattr(TeamVLLM, "sleep", recording_sleep)
    return record


@pytest.fixture
def scored(monkeypatch):
    """The scored batch every agent receives at every generation."""
    batches = []
    fill = AgentGRPOTrainer.fill_micro_batches

    def recording(self, batch, advantages):
        batches.append((self.agent_index, batch))
        fill(self, batch, advantages)

    monkeypatch.setattr(AgentGRPOTrainer, "fill_micro_batches", recording)
    return batches


def _weights(trainer):
    return [
        {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        for model in trainer.agents
    ]


def _changed(before, trainer) -> list[bool]:
    return [
        any(not torch.equal(before[a][name], p) for name, p in model.named_parameters() if p.requires_grad)
        for a, model in enumerate(trainer.agents)
    ]


def _vllm_config(make_config, config_cls=None, **overrides):
    # Untruncated sampling: the importance-sampling correction is on (under the default top-p/top-k, or with
    # logprob_temperature away from the sampling temperature, it is off).
    settings = dict(use_vllm=True, num_generations=2, max_new_tokens=6, max_steps=2, bf16=False, top_p=1.0, top_k=0)
    settings.update(overrides)
    return make_config(**settings) if config_cls is None else make_config(config_cls, **settings)


def test_two_fully_fine_tuned_agents_train_through_one_engine_and_sync_every_step(
    model_path, make_config, calls, scored
):
    trainer = MAGRPOTrainer(
        agent_model=model_path, reward_func=length_reward, train_dataset=ITEMS, args=_vllm_config(make_config)
    )
    engine = trainer.generation_engines
    assert engine.num_engines == 1 and engine.weight_groups == [[0], [1]]
    assert trainer.args.use_vllm and all(agent.use_vllm for agent in trainer.agent_trainers)
    before = _weights(trainer)
    calls["generate"].clear()
    calls["sync"].clear()
    calls["order"].clear()
    trainer.train()
    assert _changed(before, trainer) == [True, True]
    # one generation per agent per step (2 rows: one item, K=2), in agent order; before each, the agent whose step
    # changed is synced (steps 0 and 1 for both agents); after both, the engine sleeps while the agents train
    step = ["sync 0", "generate 0", "sync 1", "generate 1", "sleep"]
    assert calls["order"] == step + step
    # one engine: each generation first loaded its agent's weights (the other agent's were in it)
    assert engine.weight_loads == [2, 2] and engine.load_seconds > 0
    for _, batch in scored:
        assert batch["sampling_per_token_logps"].shape == batch["completion_ids"].shape
        # On-policy, TRL's ratio is computed from the loss's own forward, not from a second scoring forward.
        assert "importance_sampling_ratio" not in batch and "old_per_token_logps" not in batch
    assert [agent for agent, _ in scored] == [0, 1, 0, 1]
    # The engines sample from the weights being trained (synced after every step): ratios near 1 at both steps.
    ratios = sampling_ratios(trainer)
    assert len(ratios) == 4 and all(0.9 < ratio < 1.1 for ratio in ratios), ratios


@pytest.mark.parametrize(("lora_mode", "groups"), [("adapter", [[0, 1]]), ("merged", [[0], [1]])])
def test_a_lora_team_shares_one_engine_and_every_adapter_trains(lora_mode, groups, model_path, make_config, calls):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = MAGRPOTrainer(
        agent_model=model_path,
        reward_func=length_reward,
        train_dataset=ITEMS,
        args=_vllm_config(make_config, max_steps=1, vllm_lora_mode=lora_mode),
        peft_config=lora,
    )
    assert trainer.generation_engines.num_engines == 1 and trainer.generation_engines.weight_groups == groups
    before = _weights(trainer)
    trainer.train()
    assert _changed(before, trainer) == [True, True]
    assert {agent for agent, _ in calls["generate"]} == {0, 1}


def test_under_the_default_truncated_sampling_the_correction_is_off_and_every_agent_trains(model_path, make_config):
    # vLLM's log-probabilities under top-p 0.6 / top-k 50 are the truncated distribution's: TRL's sequence_mask
    # would drop nearly every sequence (ratios near 1e-6 were measured here), so the unset correction is off.
    args = _vllm_config(make_config, top_p=0.6, top_k=50)
    assert args.vllm_importance_sampling_correction is None
    trainer = MAGRPOTrainer(agent_model=model_path, reward_func=length_reward, train_dataset=ITEMS, args=args)
    assert [agent.vllm_importance_sampling_correction for agent in trainer.agent_trainers] == [False, False]
    before = _weights(trainer)
    trainer.train()
    assert _changed(before, trainer) == [True, True]
    assert sampling_ratios(trainer) == []  # no ratio was computed or logged


def test_with_log_probabilities_at_another_temperature_the_unset_correction_is_off(model_path, make_config):
    # Untruncated sampling at 0.6, the loss's log-probabilities at 1.0: the ratio would be p_1 / p_0.6 per token.
    args = _vllm_config(make_config, temperature=0.6, logprob_temperature=1.0, max_steps=1)
    trainer = MAGRPOTrainer(agent_model=model_path, reward_func=length_reward, train_dataset=ITEMS, args=args)
    assert [agent.vllm_importance_sampling_correction for agent in trainer.agent_trainers] == [False, False]
    trainer.train()
    assert sampling_ratios(trainer) == []


def test_the_correction_with_truncated_sampling_is_refused_at_construction(model_path, make_config):
    args = _vllm_config(make_config, top_p=0.6, top_k=50, vllm_importance_sampling_correction=True)
    with pytest.raises(ValueError, match=r"Agent 0: vllm_importance_sampling_correction=True with truncated sampling"):
        MAGRPOTrainer(agent_model=model_path, reward_func=length_reward, train_dataset=ITEMS, args=args)


def test_multi_turn_generates_every_turn_through_the_engines(model_path, make_config, calls):
    def transition(prompt, agent_completions, num_agents, **kwargs):
        return [f"{prompt} then: {text[:10]}" for text in agent_completions]

    trainer = MAGRPOTrainer(
        agent_model=model_path,
        reward_func=length_reward,
        train_dataset=ITEMS,
        args=_vllm_config(make_config, num_turns=2, max_steps=1),
        external_transition=transition,
    )
    calls["generate"].clear()
    trainer.train()
    # turn 1: one node (2 rows); turn 2: both joint actions of align mode expanded (2 nodes x 2 rows)
    assert calls["generate"] == [(0, 2), (1, 2), (0, 4), (1, 4)]


@pytest.mark.parametrize("family", ["iac", "maac", "madpo"])
def test_every_trainer_family_generates_through_the_engines(family, model_path, make_config, calls):
    if family == "madpo":
        config = _vllm_config(
            make_config,
            MADPOConfig,
            num_generations=None,
            preference_num_candidates=2,
            preference_pairs_per_sample=1,
            max_steps=1,
        )
        trainer = MADPOTrainer(agent_model=model_path, reward_func=length_reward, train_dataset=ITEMS, args=config)
    else:
        trainer_cls, config_cls = (IACTrainer, IACConfig) if family == "iac" else (MAACTrainer, MAACConfig)
        config = _vllm_config(make_config, config_cls, max_steps=1)
        trainer = trainer_cls(
            agent_model=model_path,
            critic_model=model_path,
            reward_func=length_reward,
            train_dataset=ITEMS,
            args=config,
        )
    before = _weights(trainer)
    calls["generate"].clear()
    trainer.train()
    assert {agent for agent, _ in calls["generate"]} == {0, 1}
    assert _changed(before, trainer) == [True, True]


def test_marlhf_collects_pairs_and_trains_its_rl_stage_through_the_engines(model_path, make_config, calls):
    config = _vllm_config(
        make_config,
        MARLHFConfig,
        num_generations=2,
        preference_num_candidates=2,
        max_steps=1,
        preference_pairs_per_sample=1,
        reward_num_train_epochs=1,
        reward_learning_rate=1e-3,
    )
    trainer = MARLHFTrainer(agent_model=model_path, reward_func=length_reward, train_dataset=ITEMS, args=config)
    calls["generate"].clear()
    trainer.train()
    # pair collection samples `preference_num_candidates` per item and agent, then the RL stage samples K per item
    rows = [rows for _, rows in calls["generate"]]
    assert {agent for agent, _ in calls["generate"]} == {0, 1} and len(rows) > 4
    assert trainer.rl_trainer.generation_engines is not None


def test_the_default_config_builds_on_the_transformers_that_vllm_needs(tmp_path):
    """vLLM's CPU build pins transformers < 5.18, whose TrainingArguments have no `activation_checkpointing` yet: the
    CPU default (no checkpointing) must still be set, through `gradient_checkpointing`."""
    from comlrl_trl.trainers.reinforce import MAGRPOConfig

    config = MAGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert config.gradient_checkpointing is False


def test_two_processes_each_generate_their_own_rows_with_an_engine_of_their_own(model_path, tmp_path, monkeypatch):
    """Colocate mode on two processes (torchrun, gloo): one engine per process (vLLM's `external_launcher`), as TRL."""
    from test_distributed import run_torchrun

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    report = run_torchrun("vllm_colocate_ddp.py", tmp_path, 2, model_path)
    rank0, rank1 = report["ranks"]
    for rank in (rank0, rank1):
        # 1 item x K=2 rows per agent and step on each process, each agent's weights loaded before it generates
        assert [(agent, len(rows)) for agent, rows in rank["generated"]] == [(0, 2), (1, 2), (0, 2), (1, 2)]
        assert rank["weight_groups"] == [[0], [1]] and rank["weight_loads"] == [2, 2]
        assert all(after != before for after, before in zip(rank["after"], rank["before"]))  # both agents trained
        # every process's engine samples from the weights being trained: TRL's ratios near 1 at both steps
        assert len(rank["ratios"]) == 4 and all(0.9 < ratio < 1.1 for ratio in rank["ratios"]), rank["ratios"]
    assert rank0["after"] == rank1["after"]  # DDP keeps the agents equal on both processes
    assert rank0["generated"] != rank1["generated"]  # other rows and seeds per process
