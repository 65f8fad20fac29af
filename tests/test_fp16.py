"""fp16 mixed precision for the team: every agent's forward under fp16 autocast with its own loss scaler (one per
agent, each agent has its own optimiser), scaler states saved per agent and restored on resume, a step with an inf
gradient skipped by that agent only; `cast_lm_head_to_fp32` passed through to each agent's TRL head.

On a CPU, Accelerate ignores fp16 (no scaler, no autocast); `precision.enable_cpu_fp16` switches on the same path
as on a GPU, so these tests run here."""

import os

import pytest
import torch

from comlrl_trl import precision
from comlrl_trl.trainers.reinforce import MAGRPOConfig


def _lengths(completions_0, completions_1):
    return [float(len(a) + len(b)) for a, b in zip(completions_0, completions_1)]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _changed(before, model):
    return any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def _scaler_file(root, step, agent):
    return torch.load(os.path.join(root, f"checkpoint-{step}", f"agent_{agent}", "scaler.pt"), weights_only=True)


def _inf_gradient_at_first_update(agent):
    """Make `agent`'s first update see an inf gradient (after its backward pass, before its optimiser step)."""
    step = agent.optimizer_step

    def poisoned():
        if agent.state.global_step == 0:
            next(p for p in agent.model.parameters() if p.grad is not None).grad.fill_(float("inf"))
        return step()

    agent.optimizer_step = poisoned


def test_fp16_trains_every_agent_under_fp16_autocast_with_its_own_scaler(make_team):
    team = make_team(reward_func=_lengths, fp16=True, max_steps=2, per_device_train_batch_size=4)
    dtypes = set()
    for model in team.agents:
        model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    before = [_params(model) for model in team.agents]
    team.train()

    assert dtypes == {torch.float16}
    assert all(_changed(b, model) for b, model in zip(before, team.agents))
    scalers = [agent.accelerator.scaler for agent in team.agent_trainers]
    assert all(isinstance(s, torch.amp.GradScaler) for s in scalers)
    assert scalers[0] is not scalers[1]
    # two finite updates: the scale is untouched (growth after 2000), the tracker counts both
    assert [s.state_dict()["scale"] for s in scalers] == [65536.0, 65536.0]
    assert [s.state_dict()["_growth_tracker"] for s in scalers] == [2, 2]
    # fp32 master weights: only the products run in fp16
    assert {p.dtype for model in team.agents for p in model.parameters()} == {torch.float32}


def test_an_inf_gradient_skips_that_agents_step_and_halves_its_scale_only(make_team):
    team = make_team(reward_func=_lengths, fp16=True, max_steps=1, per_device_train_batch_size=4)
    _inf_gradient_at_first_update(team.agent_trainers[1])
    before = [_params(model) for model in team.agents]
    team.train()

    assert _changed(before[0], team.agents[0])
    assert not _changed(before[1], team.agents[1])
    first, second = (agent.accelerator.scaler.state_dict() for agent in team.agent_trainers)
    assert (first["scale"], first["_growth_tracker"]) == (65536.0, 1)
    assert (second["scale"], second["_growth_tracker"]) == (32768.0, 0)  # backoff 0.5, tracker reset


def test_each_agents_scaler_is_saved_and_restored_on_resume(make_team, tmp_path):
    root = tmp_path / "ckpt"
    first = make_team(reward_func=_lengths, fp16=True, max_steps=1, per_device_train_batch_size=4)
    _inf_gradient_at_first_update(first.agent_trainers[1])
    first.train(checkpoint_dir=root)
    saved = [_scaler_file(root, 1, i) for i in range(2)]
    assert [(s["scale"], s["_growth_tracker"]) for s in saved] == [(65536.0, 1), (32768.0, 0)]

    resumed = make_team(reward_func=_lengths, fp16=True, max_steps=2, save_steps=1, per_device_train_batch_size=4)
    restored = []
    for agent in resumed.agent_trainers:
        prepare = agent.prepare_for_training

        def recorded(*args, _agent=agent, _prepare=prepare, **kwargs):
            _prepare(*args, **kwargs)
            restored.append(_agent.accelerator.scaler.state_dict())

        agent.prepare_for_training = recorded
    resumed.train(resume_from_checkpoint=str(root / "checkpoint-1"), checkpoint_dir=root)

    assert restored == saved
    # one more finite update on each after the resume: agent 1 keeps its halved scale
    final = [agent.accelerator.scaler.state_dict() for agent in resumed.agent_trainers]
    assert [(s["scale"], s["_growth_tracker"]) for s in final] == [(65536.0, 2), (32768.0, 1)]


def test_fp16_and_bf16_together_are_refused(tmp_path):
    with pytest.raises(ValueError, match="fp16 and bf16"):
        MAGRPOConfig(output_dir=str(tmp_path), fp16=True, bf16=True, report_to="none")


def test_fp16_leaves_the_default_bf16_off(tmp_path):
    config = MAGRPOConfig(output_dir=str(tmp_path), fp16=True, report_to="none")
    assert (config.fp16, config.bf16, config.mixed_precision) == (True, False, "fp16")


def test_the_colocated_vllm_engines_sample_in_the_training_precision():
    assert precision.rollout_dtype(fp16=True, bf16=False) == "float16"
    assert precision.rollout_dtype(fp16=False, bf16=True) == "bfloat16"
    assert precision.rollout_dtype(fp16=False, bf16=False) == "auto"  # the checkpoint's dtype
