"""CPU-only speed paths: what they change (the work done) and what they must not (the numbers)."""

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch
from trl import GRPOTrainer

from comlrl_trl.trainers.reinforce import MAGRPOTrainer


trl_utils = importlib.import_module("trl.trainer.utils")


def _agent(qwen_path, make_config, prompts_dataset):
    trainer = MAGRPOTrainer(
        agent_model=qwen_path,
        num_agents=2,
        reward_func=lambda a, b: [0.0] * len(a),
        args=make_config(),
        train_dataset=prompts_dataset,
    )
    return trainer.agent_trainers[1]


def test_head_scores_only_completion_positions_with_trls_values(qwen_path, make_config, prompts_dataset, monkeypatch):
    agent = _agent(qwen_path, make_config, prompts_dataset)
    model = agent.model
    torch.manual_seed(0)
    prompt_len, completion_len, rows = 7, 5, 3
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt_len + completion_len))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding in the prompt
    mask[2, -2:] = 0  # a completion that ended early (padding after it)
    scored_rows = []
    apply = trl_utils._ChunkedLogProbFunction.apply

    def spy(hidden, *args):
        scored_rows.append(hidden.shape[0])
        return apply(hidden, *args)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", spy)

    def logps_and_grad(method):
        model.zero_grad()
        logps, _, _ = method(agent, model, ids, mask, completion_len)
        (logps * torch.arange(1.0, completion_len + 1)).sum().backward()
        return logps.detach(), model.get_output_embeddings().weight.grad.clone()

    ours, our_grad = logps_and_grad(type(agent)._get_per_token_logps_and_entropies)
    theirs, their_grad = logps_and_grad(GRPOTrainer._get_per_token_logps_and_entropies)

    # TRL's own path on a CPU projects every position but the last (rows * 11); ours only the 13 completion tokens
    # that are not padding (5 + 5 + 3).
    assert scored_rows == [13, rows * (prompt_len + completion_len - 1)]
    assert ours.shape == (rows, completion_len)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert torch.all(ours[2, -2:] == 0)  # padding positions: log-probability 0, as in TRL
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-7)
    assert trl_utils._use_triton(torch.device("cpu")) is False  # TRL's choice is back after the call


_FAULTS = textwrap.dedent(
    """
    import resource, sys
    import torch
    from comlrl_trl.hardware import keep_freed_cpu_memory
    if sys.argv[1] == "keep":
        assert keep_freed_cpu_memory() is True
    def faults_of_allocation():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(16 * 2**20)  # 64 MB
        del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faults_of_allocation()
    print(faults_of_allocation())
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_reused_without_page_faults():
    def faults(mode):
        result = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
        return int(result.stdout.split()[-1])

    # 64 MB is 16384 pages of 4 KB: glibc maps it afresh at every allocation and the kernel faults every page in;
    # kept memory is the same pages again.
    assert faults("default") > 10_000
    assert faults("keep") < 1_000


def test_trainer_keeps_freed_memory_on_cpu_unless_told_not_to(qwen_path, make_config, prompts_dataset, monkeypatch):
    import comlrl_trl.trainers.team.trainer as team_trainer

    calls = []
    monkeypatch.setattr(team_trainer, "keep_freed_cpu_memory", lambda: calls.append(1))
    for keep in (True, False):
        MAGRPOTrainer(
            agent_model=qwen_path,
            num_agents=2,
            reward_func=lambda a, b: [0.0] * len(a),
            args=make_config(keep_freed_cpu_memory=keep),
            train_dataset=prompts_dataset,
        )
    assert calls == [1]
