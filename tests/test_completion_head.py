"""The CPU log-probability head scores only the completion positions, with TRL's values and gradients."""

import importlib

import torch
from trl import GRPOTrainer


trl_utils = importlib.import_module("trl.trainer.utils")


def _agent(make_team):
    return make_team().agent_trainers[1]


def test_head_scores_only_completion_positions_with_trls_values(make_team, monkeypatch):
    agent = _agent(make_team)
    model = agent.model
    torch.manual_seed(0)
    prompt_len, completion_len, rows = 7, 5, 3
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt_len + completion_len))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding in the prompt
    mask[2, -2:] = 0  # a completion that ended early (padding after it)
    scored_rows = []
    forward = trl_utils._ChunkedLogProbFunction.forward  # TRL's, which ours (adapters/cpu_logprob.py) inherits

    def spy(ctx, hidden, *args):
        scored_rows.append(hidden.shape[0])
        return forward(ctx, hidden, *args)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "forward", staticmethod(spy))

    def logps_and_grad(method):
        model.zero_grad()
        logps, _, _ = method(agent, model, ids, mask, completion_len)
        (logps * torch.arange(1.0, completion_len + 1)).sum().backward()
        return logps.detach(), model.get_output_embeddings().weight.grad.clone()

    ours, our_grad = logps_and_grad(type(agent).logps_and_entropies)
    theirs, their_grad = logps_and_grad(GRPOTrainer._get_per_token_logps_and_entropies)

    # TRL's own path on a CPU projects every position but the last (rows * 11); ours only the 13 completion tokens
    # that are not padding (5 + 5 + 3).
    assert scored_rows == [13, rows * (prompt_len + completion_len - 1)]
    assert ours.shape == (rows, completion_len)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert torch.all(ours[2, -2:] == 0)  # padding positions: log-probability 0, as in TRL
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-5, atol=1e-7)
    assert trl_utils._use_triton(torch.device("cpu")) is False  # TRL's choice is back after the call
