"""MADPO's log-probabilities go through TRL's fused, tiled log-probability head (issue 58, item 7): the same loss and
gradients as the model's full logits, and no tensor of rows x tokens x vocabulary elements in the forward or the
backward; its largest tensor is no larger than that of MAGRPO's head on the same shapes."""

import copy
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOTrainer
from trl.trainer.utils import add_fused_lm_head

from comlrl_trl.adapters.cpu_logprob import cpu_fused_head
from comlrl_trl.trainers.preference.madpo_trainer import MADPOAgent, sequence_logps


VOCAB, HIDDEN, PAIRS, PROMPT, WIDTH = 8192, 16, 4, 4, 12
ROWS = 2 * PAIRS


def _model(seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).train()


def _inputs():
    generator = torch.Generator().manual_seed(0)
    completion_mask = torch.ones(ROWS, WIDTH, dtype=torch.long)
    completion_mask[1, 7:] = 0
    completion_mask[5, 3:] = 0
    prompt_mask = torch.ones(ROWS, PROMPT, dtype=torch.long)
    prompt_mask[2, :2] = 0
    return {
        "prompt_ids": torch.randint(0, VOCAB, (ROWS, PROMPT), generator=generator),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(0, VOCAB, (ROWS, WIDTH), generator=generator),
        "completion_mask": completion_mask,
        "pair_weight": torch.tensor([1.0, 1.0, 0.0, 1.0]),
        "ref_logratio": torch.tensor([0.1, -0.2, 0.0, 0.3]),
        "others_logratio": torch.tensor([0.5, 0.0, -1.0, 2.0]),
    }


def _agent(model):
    """What `MADPOAgent.compute_agent_loss` reads of its trainer, on one process."""
    return SimpleNamespace(
        model=model,
        current_gradient_accumulation_steps=1,
        args=SimpleNamespace(dpo_beta=0.5),
        accelerator=SimpleNamespace(gather=lambda t: t, autocast=nullcontext, is_main_process=True),
        metrics=lambda mode: defaultdict(list),
    )


class _Largest(TorchDispatchMode):
    """The most elements of a tensor that an operation returned (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _peak(loss_fn) -> tuple[int, int]:
    """(largest tensor created, largest tensor saved for the backward) while `loss_fn()` runs and its backward."""
    saved = [0]

    def pack(t):
        saved[0] = max(saved[0], t.numel())
        return t

    with _Largest() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn().backward()
    return mode.largest, saved[0]


def test_madpo_loss_and_gradients_through_the_fused_head_equal_the_full_logits():
    plain = _model()
    fused = copy.deepcopy(plain)
    add_fused_lm_head(fused, outputs=("log_probs", "entropy"))  # as TRL's GRPOTrainer adds it to every agent
    inputs = _inputs()
    fused_loss = MADPOAgent.compute_agent_loss(_agent(fused), fused, inputs)
    fused_loss.backward()
    # The reference: the model's full logits, log-softmax and the chosen tokens, summed per row.
    logits = plain(
        input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
        attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
    ).logits[:, PROMPT - 1 : -1]
    per_token = logits.log_softmax(-1).gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    logps = (per_token * inputs["completion_mask"]).sum(1)
    own = logps[:PAIRS] - logps[PAIRS:] - inputs["ref_logratio"]
    per_pair = -torch.nn.functional.logsigmoid(0.5 * (own + inputs["others_logratio"]))
    plain_loss = (per_pair * inputs["pair_weight"]).sum() / 3.0  # three real pairs
    plain_loss.backward()
    torch.testing.assert_close(fused_loss, plain_loss)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    # The no-grad passes (policy and reference log-ratios) agree too.
    tensors = [inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    with torch.no_grad():
        torch.testing.assert_close(
            sequence_logps(fused, *tensors, chunk=3, fused_head=True), logps.detach(), rtol=1e-5, atol=1e-4
        )


@pytest.fixture
def small_tiles(monkeypatch):
    """TRL's tiles (4096 tokens x 32768 vocabulary entries) made small enough to be seen at these tiny shapes."""
    import trl.kernels.chunked_logprob as kernel
    import trl.trainer.utils as trl_utils

    import comlrl_trl.adapters.cpu_logprob as cpu_logprob

    monkeypatch.setattr(kernel, "TOKEN_CHUNK_SIZE", 32)
    monkeypatch.setattr(cpu_logprob, "TOKEN_CHUNK_SIZE", 32)
    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 1024)
    return 32 * 1024


def test_madpo_loss_never_holds_the_rows_x_tokens_x_vocabulary_logits(small_tiles):
    inputs = _inputs()
    fused = _model()
    add_fused_lm_head(fused, outputs=("log_probs", "entropy"))
    madpo_created, madpo_saved = _peak(lambda: MADPOAgent.compute_agent_loss(_agent(fused), fused, inputs))

    # MAGRPO's loss on the same rows: TRL's per-token log-probabilities (and entropies) through the same head.
    magrpo = _model()
    add_fused_lm_head(magrpo, outputs=("log_probs", "entropy"))
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)

    def magrpo_loss():
        with cpu_fused_head(magrpo):
            logps, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                _agent(magrpo), magrpo, input_ids, attention_mask, WIDTH, compute_entropy=True
            )
        return -(logps * inputs["completion_mask"]).sum()

    magrpo_created, magrpo_saved = _peak(magrpo_loss)

    # The bound, worked out: a logits tile is 32 tokens x 1024 entries = 32768; the largest other tensors are the
    # vocabulary matrices' gradients (embedding and head), 8192 x 16 = 131072. The full logits of the 8 rows over
    # the 12 completion positions (13 kept by `logits_to_keep`) would be 8 x 13 x 8192 = 851968.
    bound = max(small_tiles, VOCAB * HIDDEN)
    assert bound == 131072
    full_logits = ROWS * (WIDTH + 1) * VOCAB
    print(f"largest created/saved: MADPO {madpo_created}/{madpo_saved}, MAGRPO {magrpo_created}/{magrpo_saved}")
    assert madpo_created <= bound and madpo_saved <= bound, (madpo_created, madpo_saved)
    assert madpo_created <= magrpo_created and madpo_saved <= magrpo_saved
    # The hook does see the full logits where they are materialised (the path before this change).
    plain = _model()
    tensors = [inputs[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    plain_created, plain_saved = _peak(lambda: sequence_logps(plain, *tensors).sum())
    assert plain_created >= full_logits and plain_saved >= ROWS * WIDTH * VOCAB  # 786432: the completions' slice
