"""The CPU backward of the log-probability head (`comlrl_trl/adapters/cpu_logprob.py`): TRL's numbers exactly in fp32,
and within bf16 rounding of them under bf16 autocast (where its gradient products run in bf16)."""

import contextlib
import importlib

import pytest
import torch
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

from comlrl_trl.adapters import cpu_logprob
from comlrl_trl.adapters.cpu_logprob import CpuChunkedLogProb


def _head(
    function,
    hidden,
    weight,
    targets,
    grad_logprobs,
    *,
    temperature=0.6,
    chunk_size=96,
    scale=1.0,
    bias=None,
    outputs=("entropy",),
    grad_entropy=None,
    dtype=torch.bfloat16,
):
    """Values and gradients of one head call under `dtype` autocast (bf16: how TRL's loss runs it on a bf16 CPU;
    fp32: the logits' gradient keeps every bit, where bf16 would round small differences away)."""
    hidden = hidden.detach().clone().requires_grad_(hidden.requires_grad)
    weight = weight.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        logps, entropy, *_ = function.apply(
            hidden, weight, bias, targets, temperature, chunk_size, None, scale, outputs
        )
    loss = (logps * grad_logprobs).sum()
    if grad_entropy is not None:
        loss = loss + (entropy * grad_entropy).sum()
    loss.backward()
    return logps.detach(), hidden.grad, weight.grad


def _inputs(tokens, hidden_size=24, vocab=250, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator) * 0.3
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    # targets on both sides of every vocabulary chunk's edge (chunks of 96: 0-95, 96-191, 192-249)
    targets[:6] = torch.tensor([0, 95, 96, 191, 192, 249])
    grad_logprobs = torch.randn(tokens, generator=generator)
    grad_logprobs[6] = 0.0  # a token without weight in the loss (clipped, or padding in TRL's full layout)
    return hidden, weight, targets, grad_logprobs


def _assert_within_bf16_rounding(mine, trl):
    """Each entry within a few bf16 roundings (2^-8 relative) of TRL's, measured against the tensor's largest entry:
    bf16 products of the same bf16 operands differ from fp32 ones by the rounding of each vocabulary chunk's result."""
    scale = trl.abs().max()
    assert scale > 0
    torch.testing.assert_close(mine, trl, rtol=0, atol=float(scale) * 2**-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "temperature, scale", [(0.6, 1.0), (1.0, 1.0), (0.7, 0.5)], ids=["T=0.6", "T=1", "T=0.7,logit_scale=0.5"]
)
def test_values_are_trls_and_gradients_trls_in_fp32_within_rounding_in_bf16(temperature, scale, dtype):
    hidden, weight, targets, grad_logprobs = _inputs(40)
    kwargs = dict(temperature=temperature, scale=scale, dtype=dtype)
    theirs = _head(ChunkedLogProbFunction, hidden, weight, targets, grad_logprobs, **kwargs)
    ours = _head(CpuChunkedLogProb, hidden, weight, targets, grad_logprobs, **kwargs)
    assert torch.equal(ours[0], theirs[0])  # the forward is TRL's
    for mine, trl in zip(ours[1:], theirs[1:]):
        assert mine.dtype == trl.dtype
        if dtype == torch.float32:
            assert torch.equal(mine, trl)
        else:
            _assert_within_bf16_rounding(mine, trl)
    assert ours[2].abs().sum() > 0 and ours[1].abs().sum() > 0  # gradients reached both inputs


def test_bf16_gradient_products_really_run_in_bf16():
    """The speed-up: the products take bf16 operands. Rounding their results to bf16 moves the gradients off TRL's
    fp32 products by more than nothing but less than the tolerance above."""
    hidden, weight, targets, grad_logprobs = _inputs(200, hidden_size=64, vocab=400)
    theirs = _head(ChunkedLogProbFunction, hidden, weight, targets, grad_logprobs)
    ours = _head(CpuChunkedLogProb, hidden, weight, targets, grad_logprobs)
    products = []
    original_mm = torch.mm

    def spy(a, b, **kwargs):
        products.append((a.dtype, b.dtype))
        return original_mm(a, b, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "mm", spy)
        _head(CpuChunkedLogProb, hidden, weight, targets, grad_logprobs)
    assert products and set(products) == {(torch.bfloat16, torch.bfloat16)}
    assert not torch.equal(ours[2], theirs[2])
    _assert_within_bf16_rounding(ours[2], theirs[2])


def test_several_token_chunks_accumulate_like_trls():
    hidden, weight, targets, grad_logprobs = _inputs(4096 + 37, hidden_size=8, vocab=200)
    theirs = _head(ChunkedLogProbFunction, hidden, weight, targets, grad_logprobs, chunk_size=128)
    ours = _head(CpuChunkedLogProb, hidden, weight, targets, grad_logprobs, chunk_size=128)
    assert torch.equal(ours[0], theirs[0])
    for mine, trl in zip(ours[1:], theirs[1:]):
        _assert_within_bf16_rounding(mine, trl)


def test_weight_gradient_blocks_cover_every_vocabulary_row(monkeypatch):
    """The weight's gradient is written in blocks of `_WEIGHT_BLOCK` rows: blocks smaller than a chunk, and a last
    block cut short, still give every row (fp32, where the values are TRL's exactly)."""
    monkeypatch.setattr(cpu_logprob, "_WEIGHT_BLOCK", 40)  # chunks of 96 rows: blocks of 40, 40, 16; the last 58
    hidden, weight, targets, grad_logprobs = _inputs(30)
    theirs = _head(ChunkedLogProbFunction, hidden, weight, targets, grad_logprobs, dtype=torch.float32)
    ours = _head(CpuChunkedLogProb, hidden, weight, targets, grad_logprobs, dtype=torch.float32)
    assert torch.equal(ours[2], theirs[2])
    assert (ours[2].abs().sum(dim=1) > 0).all()


def test_frozen_hidden_states_give_only_the_weights_gradient():
    hidden, weight, targets, grad_logprobs = _inputs(12)
    hidden.requires_grad_(False)
    theirs = _head(ChunkedLogProbFunction, hidden, weight, targets, grad_logprobs)
    ours = _head(CpuChunkedLogProb, hidden, weight, targets, grad_logprobs)
    assert ours[1] is None and theirs[1] is None
    _assert_within_bf16_rounding(ours[2], theirs[2])


@pytest.mark.parametrize("case", ["entropy gradient", "bias"])
def test_other_cases_run_trls_backward(case, monkeypatch):
    hidden, weight, targets, grad_logprobs = _inputs(10)
    kwargs = {"entropy gradient": dict(grad_entropy=torch.linspace(-1, 1, 10)), "bias": dict(bias=torch.randn(250))}
    calls = []
    monkeypatch.setattr(cpu_logprob, "_backward", lambda *a: calls.append(a) or pytest.fail("ours ran"))
    theirs = _head(ChunkedLogProbFunction, hidden, weight, targets, grad_logprobs, **kwargs[case])
    ours = _head(CpuChunkedLogProb, hidden, weight, targets, grad_logprobs, **kwargs[case])
    assert calls == []
    for mine, trl in zip(ours, theirs):
        assert torch.equal(mine, trl)


def test_agents_train_through_it_on_a_cpu(make_team, monkeypatch):
    trainer = make_team(reward_func=lambda a, b: [float(len(x) - len(y)) for x, y in zip(a, b)], max_steps=1)
    backward = cpu_logprob._backward
    tokens = []

    def spy(ctx, grad_logprobs):
        tokens.append(ctx.saved_tensors[0].shape[0])
        return backward(ctx, grad_logprobs)

    monkeypatch.setattr(cpu_logprob, "_backward", spy)
    before = [agent.model.get_output_embeddings().weight.detach().clone() for agent in trainer.agent_trainers]
    trainer.train()
    assert len(tokens) >= 2 and min(tokens) > 0  # every agent's loss went through it
    for agent, weight in zip(trainer.agent_trainers, before):
        assert not torch.equal(agent.model.get_output_embeddings().weight, weight)
    # TRL's head is back outside the agents' forward
    assert importlib.import_module("trl.trainer.utils")._ChunkedLogProbFunction is ChunkedLogProbFunction


def test_the_head_is_gathered_for_the_backward(monkeypatch):
    """Under ZeRO-3 an untied head is sharded to numel 0 outside its module's forward: the backward, which reads it
    directly, must gather it as TRL's backward does (a no-op without ZeRO-3)."""
    hidden, weight, targets, grad_logprobs = _inputs(10)
    gathered = []

    @contextlib.contextmanager
    def gather(*params):
        gathered.append([tuple(p.shape) for p in params])
        yield

    monkeypatch.setattr(cpu_logprob, "maybe_gather_lm_head_ctx", gather)
    _head(CpuChunkedLogProb, hidden, weight, targets, grad_logprobs)
    assert gathered == [[(250, 24)]]
