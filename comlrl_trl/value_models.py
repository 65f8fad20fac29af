"""Value heads and LLM critics for the actor-critic trainers.

A critic is a causal language model whose last hidden state at one position goes through a small value head.
`critic_type="v"` values a prompt (the position of its last token), `"q"` a prompt with its response (the last
response token). An actor can also carry the head itself (`value_head` attribute on the actor model), sharing its
backbone with the policy.
"""

import os
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from transformers import PreTrainedModel

from .adapters.helpers import zero_partition_dtype, zero_partitioned
from .loading import base_model


VALUE_HEAD_NAME = "value_head.pt"


class ValueHead(nn.Module):
    """`hidden_size -> 1` (linear), or `hidden_size -> hidden_dim -> 1` with a tanh in between.

    The output layer starts at zero, so every value starts at 0 and early advantages are the plain rewards.
    """

    def __init__(self, hidden_size: int, hidden_dim: int | None = None):
        super().__init__()
        if hidden_dim is None:
            self.net = nn.Sequential(nn.Linear(hidden_size, 1))
        else:
            self.net = nn.Sequential(nn.Linear(hidden_size, hidden_dim), nn.Tanh(), nn.Linear(hidden_dim, 1))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.net(hidden.to(self.net[0].weight.dtype)).squeeze(-1)


class CausalLMWithValueHead(nn.Module):
    """A critic: a causal LM backbone (`model`, optionally a PEFT model) and a `value_head`.

    `save_pretrained(path)` writes a loadable model directory plus `value_head.pt`; passing that directory back as
    a critic source reloads the backbone with a fresh head (restore the head with `value_head.load_state_dict`).
    """

    def __init__(self, model: PreTrainedModel, hidden_dim: int | None = None):
        super().__init__()
        self.model = model
        self.value_head = ValueHead(hidden_size(model), hidden_dim).to(model.device)
        partition_dtype = zero_partition_dtype(model)
        if partition_dtype is not None:  # a backbone ZeRO-3 partitioned as it loaded: one dtype per partition
            self.value_head.to(partition_dtype)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return last_token_values(self.model, self.value_head, input_ids, attention_mask, index)

    def save_pretrained(self, path: str, tokenizer=None) -> None:
        self.model.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        torch.save(head_state_dict(self.value_head), os.path.join(path, VALUE_HEAD_NAME))


def gathered_parameters(module: nn.Module, modifier_rank: int | None = None):
    """ZeRO-3 partitions a module's parameters (each process holds a slice, the tensor itself is empty): gather them
    for the block (`modifier_rank`: the process whose changes are kept); every process must enter it. Nothing to do
    for ordinary parameters."""
    params = [p for p in module.parameters() if zero_partitioned(p)]
    if not params:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def head_state_dict(head: nn.Module) -> dict[str, torch.Tensor]:
    """The full state of a value head, on the CPU, also when ZeRO-3 partitions it. Every process must call it."""
    with gathered_parameters(head):
        return {name: tensor.detach().cpu().clone() for name, tensor in head.state_dict().items()}


def load_head_state_dict(head: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a saved value head, also into one that ZeRO-3 partitions (where a plain `load_state_dict` meets empty
    tensors). Every process must call it."""
    with gathered_parameters(head, modifier_rank=0):
        head.load_state_dict(state)


LOW_PRECISION = (torch.bfloat16, torch.float16)


def low_precision_trainable(model: nn.Module) -> list[str]:
    """Names of the trainable parameters stored in bf16/fp16: a plain AdamW step on them loses small updates (a
    5e-6 step is below bf16's resolution for weights of magnitude ~0.01 and up)."""
    return [name for name, p in model.named_parameters() if p.requires_grad and p.dtype in LOW_PRECISION]


def fp32_trainable(model: nn.Module) -> None:
    """Keep fp32 master weights: store the trainable parameters in fp32 (frozen ones keep their dtype). Mixed
    precision then comes from autocast (`bf16=True`), as for the actors."""
    for p in model.parameters():
        if p.requires_grad and p.dtype in LOW_PRECISION:
            p.data = p.data.float()


def hidden_size(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return config.hidden_size


def decoder_of(model) -> nn.Module:
    """The module producing the last hidden states (no LM head): LoRA layers inside it still apply."""
    return base_model(model).get_decoder()


def last_token_values(model, head: nn.Module, input_ids, attention_mask, index) -> torch.Tensor:
    """Values `(B,)` read at position `index[b]` of each row (left-padded rows: the prompt's last token is at -1)."""
    hidden = decoder_of(model)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    rows = torch.arange(hidden.size(0), device=hidden.device)
    return head(hidden[rows, index])


def value_positions(prompt_ids: torch.Tensor, completion_mask: torch.Tensor | None) -> torch.Tensor:
    """Where to read a value in `cat(prompt_ids, completion_ids)` with left-padded prompts.

    Without a completion mask (`critic_type="v"`): the prompt's last token. With it (`"q"`): the last response
    token kept by the mask (the prompt's last token for an empty response).
    """
    last_prompt = prompt_ids.size(1) - 1
    if completion_mask is None:
        return torch.full((prompt_ids.size(0),), last_prompt, dtype=torch.long, device=prompt_ids.device)
    return last_prompt + completion_mask.sum(dim=1).long()


class ValueCapture:
    """Values of an actor's own `value_head` for the policy forward passes that run inside `capture()`.

    TRL's loss computes log-probabilities with one forward pass (in chunks). A hook on the backbone applies the
    head to the same last hidden states, at every position, inside that forward pass: the policy and value losses
    share one forward and one backward pass, and data-parallel wrappers see the head used in `forward`.
    """

    def __init__(self, model):
        self._active = False
        self.values: list[torch.Tensor] = []
        self._model = model
        decoder_of(model).register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if not self._active:
            return None
        hidden = output.last_hidden_state
        values = self._model.value_head(hidden)
        self.values.append(values)
        # Tie the values into the policy's output graph with a zero weight: DistributedDataParallel, which finds
        # used parameters by walking back from the forward's outputs, then counts the head as used.
        output.last_hidden_state = hidden + 0.0 * values.unsqueeze(-1).to(hidden.dtype)
        return output

    @contextmanager
    def capture(self):
        self.values, self._active = [], True
        try:
            yield self.values
        finally:
            self._active = False
