"""One decoding loop for the whole team (`comlrl_trl/fast/joint_decoding.py`): each row through its own agent's
weights, what the agents share run once."""

import pytest
import torch
from helpers import changed, snapshot
from peft import LoraConfig

from comlrl_trl.fast.joint_decoding import SharedWeights, _PerAgent, _SharedBaseLora, team_view, until_eos
from comlrl_trl.generation import cpu
from comlrl_trl.loading import base_model


LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


@pytest.fixture
def make_lora_team(make_team):
    return lambda **overrides: make_team(reward_func=_length_reward, peft_config=LORA, **overrides)


def _length_reward(completions_0, completions_1):
    return [float(len(a) - len(b)) for a, b in zip(completions_0, completions_1)]


def _make_agents_differ(trainer) -> None:
    """Move every trainable weight of each agent by its own noise (a fresh LoRA update is 0: the agents would agree)."""
    with torch.no_grad():
        for a, agent in enumerate(trainer.agent_trainers):
            generator = torch.Generator().manual_seed(100 + a)
            for p in agent.model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=generator) * 0.5)


def _prompts():
    # Prompts of different lengths within and across agents: the team's batch is left-padded to the longest.
    return [
        [f"Write a story about item {i}:" for i in (0, 0, 1, 1)],
        [f"Item {i}, please, in a single long and careful sentence:" for i in (2, 2, 3, 3)],
    ]


def _greedy(trainer, **settings) -> None:
    for agent in trainer.agent_trainers:
        agent.generation_config.update(do_sample=False, temperature=None, top_p=None, top_k=None, **settings)


def _count_loops(monkeypatch) -> list:
    """The rows of each lean decoding loop the CPU generator runs."""
    loops, loop = [], cpu.lean_generate
    monkeypatch.setattr(cpu, "lean_generate", lambda *args, **kw: loops.append(args[1].shape[0]) or loop(*args, **kw))
    return loops


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_loop_gives_every_agent_the_tokens_of_its_own_call(make_team, make_lora_team, lora, monkeypatch):
    trainer = make_lora_team() if lora else make_team()
    _make_agents_differ(trainer)
    _greedy(trainer)
    team, prompts = trainer.orchestrator.team_generation, _prompts()
    assert team.unavailable() is None
    loops = _count_loops(monkeypatch)

    joint = team(prompts)
    assert loops == [8]  # one loop over both agents' 4 rows
    separate = [agent.generate(p) for agent, p in zip(trainer.agent_trainers, prompts)]
    assert loops == [8]  # each agent's own TRL call: transformers' generate, with nothing of ours
    for ours, theirs in zip(joint, separate):
        assert ours.prompt_ids == theirs.prompt_ids
        assert ours.completion_ids == theirs.completion_ids
        assert ours.completions == theirs.completions
    # The agents' weights differ, so a wrong agent's weights on a row would show: their completions differ.
    assert separate[0].completion_ids != separate[1].completion_ids

    # Evaluation samples through the same loop.
    texts = trainer.orchestrator.sample([[p0, p1] for p0, p1 in zip(*prompts)])
    assert texts == [rollout.completions for rollout in separate]
    assert loops == [8, 8]


def test_sampling_filters_each_row_in_the_team_batch(make_team):
    """With top_k=1 sampling must pick each row's greedy token: the logits processors run row by row on the batch."""
    trainer = make_team()
    _make_agents_differ(trainer)
    team, prompts = trainer.orchestrator.team_generation, _prompts()
    for agent in trainer.agent_trainers:
        agent.generation_config.update(do_sample=True, top_k=1, top_p=1.0, temperature=0.7)
    sampled = team(prompts)
    _greedy(trainer)
    greedy = [agent.generate(p) for agent, p in zip(trainer.agent_trainers, prompts)]
    assert [r.completion_ids for r in sampled] == [r.completion_ids for r in greedy]


def test_a_lora_team_shares_its_base_and_keeps_its_own_updates(make_lora_team):
    trainer = make_lora_team()
    models = [base_model(agent.model) for agent in trainer.agent_trainers]
    shared = SharedWeights()
    view = team_view(models, [4, 4], shared)
    first = models[0].model
    layer = view.model.layers[1]
    assert isinstance(layer.self_attn.q_proj, _SharedBaseLora)
    assert isinstance(layer.self_attn.v_proj, _SharedBaseLora)
    assert layer.self_attn.k_proj is first.layers[1].self_attn.k_proj  # frozen and equal: agent 0's, once
    assert layer.mlp.down_proj is first.layers[1].mlp.down_proj
    assert layer.input_layernorm is first.layers[1].input_layernorm
    assert view.model.embed_tokens is first.embed_tokens
    assert view.lm_head is models[0].lm_head

    # An equal copy is compared, and shared; changed in place (a new tensor version) it is compared again.
    k_proj = models[1].model.layers[1].self_attn.k_proj
    k_proj.weight = torch.nn.Parameter(k_proj.weight.detach().clone(), requires_grad=False)
    view = team_view(models, [4, 4], shared)
    assert view.model.layers[1].self_attn.k_proj is first.layers[1].self_attn.k_proj
    with torch.no_grad():
        k_proj.weight.add_(1.0)
    view = team_view(models, [4, 4], shared)
    assert isinstance(view.model.layers[1].self_attn.k_proj, _PerAgent)
    assert view.model.layers[0].self_attn.k_proj is first.layers[0].self_attn.k_proj


def test_fully_fine_tuned_agents_run_their_own_weights(make_team):
    trainer = make_team()
    models = [base_model(agent.model) for agent in trainer.agent_trainers]
    view = team_view(models, [3, 5], SharedWeights())
    site = view.model.layers[0].mlp.gate_proj
    assert isinstance(site, _PerAgent)
    x = torch.randn(8, models[0].config.hidden_size)
    expected = torch.cat(
        [models[0].model.layers[0].mlp.gate_proj(x[:3]), models[1].model.layers[0].mlp.gate_proj(x[3:])]
    )
    with torch.no_grad():
        models[1].model.layers[0].mlp.gate_proj.weight.mul_(2.0)
        expected[3:] *= 2.0
        torch.testing.assert_close(site.forward(x), expected)


def test_agents_that_sample_differently_generate_in_their_own_calls(make_team, monkeypatch):
    trainer = make_team()
    team = trainer.orchestrator.team_generation
    trainer.agent_trainers[1].generation_config.temperature = 0.3
    assert team.unavailable() == "the agents sample with different settings"
    loops = _count_loops(monkeypatch)
    rollouts = team(_prompts())
    assert loops == [4, 4]
    assert [len(r.completion_ids) for r in rollouts] == [4, 4]


def test_joint_generation_false_generates_agent_by_agent(make_team, monkeypatch):
    trainer = make_team(joint_generation=False)
    assert trainer.orchestrator.team_generation.unavailable() == "joint_generation=False"
    loops = _count_loops(monkeypatch)
    trainer.orchestrator.team_generation(_prompts())
    assert loops == [4, 4]


def test_the_teams_joint_generation_decides_not_the_first_agents(make_team, monkeypatch):
    trainer = make_team()  # joint_generation=True: one loop
    monkeypatch.setattr(trainer.agent_trainers[0].args, "joint_generation", False, raising=False)
    assert trainer.orchestrator.team_generation.unavailable() is None
    loops = _count_loops(monkeypatch)
    trainer.orchestrator.team_generation(_prompts())
    assert loops == [8]


def test_training_with_one_loop_updates_every_agent(make_lora_team, monkeypatch):
    trainer = make_lora_team(max_steps=2)
    loops = _count_loops(monkeypatch)
    before = [snapshot(agent.model) for agent in trainer.agent_trainers]
    trainer.train()
    assert loops == [8, 8]  # one loop per generation, both agents' 4 rows
    for agent, params in zip(trainer.agent_trainers, before):
        assert any("lora_B" in name for name in changed(params, agent.model))


def test_until_eos_keeps_tokens_through_the_first_end_of_sequence():
    tokens = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [3, 3, 9, 1], [9, 0, 0, 0]])
    assert until_eos(tokens, [2, 9]) == [[5, 2], [5, 6, 7, 8], [3, 3, 9], [9]]


@pytest.mark.parametrize("engine", ["is_deepspeed_enabled", "is_fsdp_enabled"])
def test_sharded_agents_generate_in_their_own_calls(make_team, monkeypatch, engine):
    """Under DeepSpeed or FSDP each agent gathers its own parameters for its call, so there is no joint loop."""
    trainer = make_team()
    monkeypatch.setattr(trainer.agent_trainers[1], engine, True)
    team = trainer.orchestrator.team_generation
    assert team.unavailable() == "agent 1: DeepSpeed and FSDP gather its parameters for TRL's own call"


def test_agents_that_differ_in_shape_or_weight_dtype_generate_in_their_own_calls(make_team, monkeypatch):
    trainer = make_team()
    team = trainer.orchestrator.team_generation
    second = trainer.agent_trainers[1].model
    # A different name and pad token id do not stop the joint loop; a different shape does.
    monkeypatch.setattr(second.config, "_name_or_path", "elsewhere")
    monkeypatch.setattr(second.config, "pad_token_id", 7)
    assert team.unavailable() is None
    monkeypatch.setattr(second.config, "rms_norm_eps", second.config.rms_norm_eps * 10)
    assert team.unavailable() == "the agents' models have different architectures"
    monkeypatch.undo()
    assert team.unavailable() is None
    # Another model class with the same config (here a subclass, which the lean loop still runs) is another model.
    monkeypatch.setattr(second, "__class__", type("OtherQwen2", (type(second),), {}))
    assert team.unavailable() == "the agents' models have different architectures"
    monkeypatch.undo()
    second.to(torch.float64)
    assert team.unavailable() == "the agents' weights have different dtypes"
    loops = _count_loops(monkeypatch)
    rollouts = team(_prompts())
    assert loops == [4, 4]
    assert [len(r.completion_ids) for r in rollouts] == [4, 4]


def test_generation_backend_picks_the_team_generator(make_team):
    from comlrl_trl.generation.cpu import LeanCpuGeneration
    from comlrl_trl.generation.team_generator import PerAgentGeneration

    assert type(make_team().orchestrator.team_generation) is LeanCpuGeneration  # "auto" on a CPU
    assert type(make_team(generation_backend="cpu").orchestrator.team_generation) is LeanCpuGeneration
    plain = make_team(generation_backend="transformers").orchestrator.team_generation
    assert type(plain) is PerAgentGeneration
    rollouts = plain(_prompts())
    assert [len(r.completion_ids) for r in rollouts] == [4, 4]


def test_the_cpu_backend_refuses_agents_that_do_not_generate_on_a_cpu(make_team, monkeypatch):
    from comlrl_trl.generation.team_generator import PerAgentGeneration, team_generator

    trainer = make_team()
    agents = trainer.agent_trainers
    monkeypatch.setattr(agents[1], "use_vllm", True)  # the team's vLLM engines: TRL's rollout_func samples
    args = trainer.args
    monkeypatch.setattr(args, "generation_backend", "cpu")
    with pytest.raises(ValueError, match="generation_backend='cpu' needs every agent to generate"):
        team_generator(agents, args)
    monkeypatch.setattr(args, "generation_backend", "auto")
    assert type(team_generator(agents, args)) is PerAgentGeneration
    monkeypatch.setattr(args, "generation_backend", "vllm")
    with pytest.raises(ValueError, match="generation_backend must be one of 'auto', 'transformers', 'cpu'"):
        team_generator(agents, args)


def test_the_configuration_refuses_an_unknown_generation_backend(make_config):
    with pytest.raises(ValueError, match="generation_backend must be one of 'auto', 'transformers', 'cpu'"):
        make_config(generation_backend="gpu")
