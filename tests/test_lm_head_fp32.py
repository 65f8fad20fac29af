"""`cast_lm_head_to_fp32` (TRL's GRPOConfig field) reaches every agent: under bf16 or fp16 autocast the head's
logits and log-probabilities are computed in fp32, in the loss forward and backward (TRL's fused head with this
package's CPU backward, `adapters/cpu_logprob.py`) and in generation."""

import pytest
import torch

from comlrl_trl.adapters import cpu_logprob
from comlrl_trl.adapters.cpu_logprob import CpuChunkedLogProb


def _lengths(completions_0, completions_1):
    return [float(len(a) + len(b)) for a, b in zip(completions_0, completions_1)]


@pytest.fixture
def head_dtypes(monkeypatch):
    """The dtypes the fused log-probability head computes its logits tiles in, forward and backward."""
    seen = {"forward": set(), "backward": set()}

    class Recording(CpuChunkedLogProb):
        @staticmethod
        def forward(ctx, *args):
            out = CpuChunkedLogProb.forward(ctx, *args)
            seen["forward"].add(ctx.compute_dtype)
            return out

        @staticmethod
        def backward(ctx, *grads):
            seen["backward"].add(ctx.compute_dtype)
            return CpuChunkedLogProb.backward(ctx, *grads)

    monkeypatch.setattr(cpu_logprob, "CpuChunkedLogProb", Recording)
    return seen


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("cast", [True, False])
def test_the_head_runs_in_fp32_with_cast_lm_head_to_fp32(make_team, head_dtypes, precision, cast):
    team = make_team(
        reward_func=_lengths,
        max_steps=1,
        per_device_train_batch_size=4,
        cast_lm_head_to_fp32=cast,
        **{precision: True},
    )
    generated = set()
    for model in team.agents:
        model.lm_head.register_forward_hook(lambda m, i, o: generated.add(o.dtype))
    team.train()

    low = torch.bfloat16 if precision == "bf16" else torch.float16
    expected = torch.float32 if cast else low
    assert all(agent.args.cast_lm_head_to_fp32 is cast for agent in team.agent_trainers)
    assert head_dtypes == {"forward": {expected}, "backward": {expected}}
    assert generated == {expected}
    assert {model.lm_head.weight.dtype for model in team.agents} == {torch.float32}
