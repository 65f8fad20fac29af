"""TRL's log-probability forward with each distinct prompt of a chunk run once, packed into one sequence.

TRL scores a micro-batch by running every row, prompt and completion, through the model. The K completions of a
task item share their prompt (a micro-batch of the defaults holds the rows of one or two items), so each prompt
token goes through the model K times, forward and backward, and the left padding of shorter prompts with them.
`SharedPromptModel` stands in for the model in TRL's `_get_per_token_logps_and_entropies` and makes one call of the
model's own forward with TRL's fused head on one packed sequence:

- each distinct prompt once, without its padding and without its last token;
- then every row's last prompt token and completion;
- each token at its position in TRL's rows (TRL passes no position ids: positions count from the first, padded,
  column), under a mask that lets a prompt token see its own prompt's earlier tokens, and a row's token its prompt
  and its own row's earlier tokens that TRL's mask keeps.

Every token sees the keys and values it sees in TRL's forward, so the log-probabilities, entropies and gradients
are TRL's up to float rounding (other matrix shapes; `tests/test_shared_prompt.py` bounds the difference). One call,
not a prompt call and a row call: on a CPU each call's backward writes its own gradient of every weight, which cost
more than the saved prompt tokens in a first version that way.

The work: for B rows of P prompt and C completion tokens, G distinct prompts of p_g tokens without padding, about
sum(p_g) + B * (C + 1) tokens go through the linear layers instead of B * (P + C); attention covers the square of
that packed length once instead of B squares of P + C. Used where that estimate saves at least `MIN_SAVED_WORK`
(`packing_pays`), for Llama, Qwen2 and Qwen3 models (PEFT-wrapped or not) with full attention in every layer
(`shares_prompts`); otherwise, and for any other call, the model runs as TRL calls it.
"""

import functools

import torch
from torch import nn

from ..loading import base_model
from .helpers import full_sdpa_attention


# Decoder layers whose forward takes a 4-D attention mask as given and explicit positions (transformers 5).
_LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer")
# Saved multiply-adds below which packing is not worth its Python (about 1-2 ms): 1e8 is under one SmolLM2-135M
# token forward, and far above what a tiny test model's whole chunk costs.
MIN_SAVED_WORK = 1e8
_IGNORED = -100  # TRL's label of a position that is not scored


def shares_prompts(model: nn.Module) -> bool:
    """Whether `SharedPromptModel` may run `model`'s scoring forward packed (see the module docstring)."""
    inner = base_model(model)
    backbone = getattr(inner, "base_model", None)
    layers = getattr(backbone, "layers", None)
    config = getattr(inner, "config", None)
    if backbone is None or backbone is inner or not layers or config is None:
        return False
    # SDPA takes the boolean mask as given; eager attention would add it.
    return all(type(layer).__name__ in _LAYERS for layer in layers) and full_sdpa_attention(config, backbone)


def packing_pays(rows: int, length: int, packed: int, layer_parameters: int, width: int, layers: int) -> bool:
    """Whether a packed sequence of `packed` tokens saves `MIN_SAVED_WORK` multiply-adds against `rows` rows of
    `length` tokens: linear layers (`layer_parameters` per token) plus attention scores and their sums (2 * `width`
    per query and key pair and layer)."""
    padded = rows * length * layer_parameters + rows * length**2 * 2 * width * layers
    shared = packed * layer_parameters + packed**2 * 2 * width * layers
    return padded - shared >= MIN_SAVED_WORK


def _first_seen(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of `keys` in the order they first appear, and the index of each row's among them."""
    distinct, inverse = torch.unique(keys, dim=0, return_inverse=True)
    rows = torch.arange(len(keys), device=keys.device)
    first = torch.full((len(distinct),), len(keys), device=keys.device).scatter_reduce(0, inverse, rows, "amin")
    order = first.argsort()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order), device=keys.device)
    return distinct[order], rank[inverse]


class PackedRows:
    """The packed sequence of a chunk of `rows` rows whose first `prefix` columns are the prompt but its last token."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prefix: int):
        rows, length = input_ids.shape
        distinct, row_prompt = _first_seen(torch.cat([input_ids[:, :prefix], attention_mask[:, :prefix]], dim=1))
        prompt_ids, kept = distinct[:, :prefix], distinct[:, prefix:].bool()
        columns = torch.arange(length, device=input_ids.device)
        groups = torch.arange(len(distinct), device=input_ids.device)
        tail = length - prefix  # a row's tokens in the pack: its last prompt token and its completion
        self.rows, self.tail, self.prefix, self.prompt_tokens = rows, tail, prefix, int(kept.sum())
        self.input_ids = torch.cat([prompt_ids[kept], input_ids[:, prefix:].reshape(-1)])
        prompt_positions = columns[:prefix].expand(len(distinct), prefix)[kept]
        self.positions = torch.cat([prompt_positions, columns[prefix:].repeat(rows)])
        # What the attention mask is built from (`mask`): each token's prompt group as a query and as a key, its row
        # as a query and as a key, and whether TRL's mask keeps it as a key. A query sees the keys of its prompt
        # group (prompt tokens) and those of its own row (row tokens). Row tokens belong to no group (-1); prompt
        # tokens to no row (-1 as keys, -2 as queries, so that they never match).
        row_of_token = torch.arange(rows, device=input_ids.device).repeat_interleave(tail)
        prompt_group = groups[:, None].expand(len(distinct), prefix)[kept]
        no_group = torch.full((rows * tail,), -1, device=input_ids.device)
        no_row = torch.full((self.prompt_tokens,), -1, device=input_ids.device)
        self._query_group = torch.cat([prompt_group, row_prompt[row_of_token]])
        self._key_group = torch.cat([prompt_group, no_group])
        self._query_row, self._key_row = torch.cat([no_row - 1, row_of_token]), torch.cat([no_row, row_of_token])
        self._key_kept = torch.cat([kept.new_ones(self.prompt_tokens), attention_mask[:, prefix:].reshape(-1).bool()])

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """`(len, len)` booleans: whether query i attends to key j (TRL's causal and padding mask, per row)."""
        same_prompt = self._query_group[:, None] == self._key_group[None, :]
        same_row = self._query_row[:, None] == self._key_row[None, :]
        causal = self.positions[None, :] <= self.positions[:, None]
        return causal & self._key_kept[None, :] & (same_prompt | same_row)

    def __len__(self) -> int:
        return self.input_ids.numel()

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        """TRL's labels of the rows (`(rows, length)`: -100 where not scored) at the packed tokens."""
        return torch.cat([labels.new_full((self.prompt_tokens,), _IGNORED), labels[:, self.prefix :].reshape(-1)])

    def unpack(self, per_token: torch.Tensor | None) -> torch.Tensor | None:
        """A packed per-token output of the fused head (`(1, len - 1)`: position i scores token i + 1) as the rows'
        `(rows, tail - 1)` values for their completion tokens."""
        if per_token is None:
            return None
        scored = torch.cat([per_token[0, self.prompt_tokens :], per_token.new_zeros(1)])
        return scored.view(self.rows, self.tail)[:, :-1]


class SharedPromptModel:
    """Called as TRL calls its model to score a chunk of rows (`input_ids`, `attention_mask`, `labels`,
    `fused_lm_head`), with rows of `prompt_length` prompt tokens followed by completion tokens."""

    def __init__(self, model: nn.Module, prompt_length: int):
        self.model, self.prompt_length = model, prompt_length
        inner = base_model(model)
        config = inner.config
        self.size = dict(
            layer_parameters=sum(p.numel() for p in inner.base_model.layers.parameters()),
            width=config.hidden_size,
            layers=config.num_hidden_layers,
        )

    def __call__(self, *, input_ids, attention_mask, labels, **kwargs):
        pack = self._pack(input_ids, attention_mask, kwargs)
        if pack is None:
            return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        out = self.model(
            input_ids=pack.input_ids[None],
            attention_mask=pack.mask[None, None],
            position_ids=pack.positions[None],
            labels=pack.labels(labels)[None],
            **kwargs,
        )
        return type(out)(log_probs=pack.unpack(out.log_probs), entropy=pack.unpack(out.entropy))

    def _pack(self, input_ids, attention_mask, kwargs: dict) -> PackedRows | None:
        """The chunk packed, or None where the model runs the rows as TRL calls it: a call other than TRL's fused
        head's, no prompt token to share, or too little work saved (`packing_pays`)."""
        prefix = self.prompt_length - 1  # the last prompt token is run with its row: its output scores token 1
        if kwargs.keys() != {"fused_lm_head"} or not kwargs["fused_lm_head"] or prefix < 1:
            return None
        rows, length = input_ids.shape
        pays = functools.partial(packing_pays, rows, length, **self.size)
        if not pays(rows * (length - prefix)):  # no pack is shorter than the rows' own tokens: none is built
            return None
        pack = PackedRows(input_ids, attention_mask, prefix)
        return pack if pays(len(pack)) else None
