"""One decoding loop for a whole team on a CPU: every agent's rows in one batch, each row through its own agent's weights.

Every agent of a team samples its completions in its own `generate` call, one after the other. On a CPU a decoding
step of a small model costs nearly the same for 16 rows as for 8 (reading the weights and the Python around each
operation dominate), so N calls of B rows cost nearly N times one call of N * B rows. `team_view` lets the lean
decoding loop (`fast/decoding.py`) run the agents' rows as one batch, operation by operation:

- a module whose weights every agent shares runs once on all rows: frozen parameters equal across agents (a LoRA
  team's base model: its linear layers, norms, embedding and head);
- a LoRA layer whose base layer is shared runs the base once on all rows, then adds each agent's own LoRA update to
  its rows (peft's vanilla LoRA forward, `_lora_added`);
- any other module (trainable weights: full fine-tuning) runs per agent on that agent's rows;
- attention, rotary embeddings, the sampling and the stopping criteria run once on all rows (they hold no weights
  that differ: `team_view` requires one architecture and configuration).

The tokens are drawn from the same distributions as in separate calls, but not the same tokens: the draws of one
step cover every agent's rows at once (a different order of torch's random numbers), and left padding to the longest
prompt of the team changes the rounding of the attention sums.
"""

import torch
from torch import nn

from ..adapters.tensors import tensor_version
from .decoding import rotary_function


try:  # peft is a dependency of LoRA teams only
    from peft.tuners.lora.layer import Linear as LoraLinear
except ImportError:  # pragma: no cover
    LoraLinear = None


class _PerAgent:
    """A module position whose weights differ between agents: each agent's module on its own rows."""

    def __init__(self, modules: list[nn.Module], sizes: list[int]):
        self.modules, self.sizes = modules, sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = x.split(self.sizes)
        return torch.cat([module.forward(part) for module, part in zip(self.modules, parts, strict=True)])

    __call__ = forward


class _SharedBaseLora:
    """LoRA layers on one shared base layer: the base once on all rows, each agent's LoRA update on its rows."""

    def __init__(self, layers: list[nn.Module], sizes: list[int]):
        self.layers, self.sizes = layers, sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.layers[0].base_layer.forward(x)
        parts = zip(self.layers, x.split(self.sizes), result.split(self.sizes), strict=True)
        return torch.cat([_lora_added(layer, part, base) for layer, part, base in parts])

    __call__ = forward


def _lora_added(layer: nn.Module, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """peft's `lora.Linear.forward` after its base layer's product (`result`), for vanilla LoRA adapters."""
    dtype = result.dtype
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        x = layer._cast_input_dtype(x, layer.lora_A[name].weight.dtype)
        result = result + layer.lora_B[name](layer.lora_A[name](layer.lora_dropout[name](x))) * layer.scaling[name]
    return result.to(dtype)


def _is_vanilla_lora(module: nn.Module) -> bool:
    """A peft LoRA linear layer whose forward is its base layer plus its adapters' updates (`_lora_added`)."""
    return (
        LoraLinear is not None
        and type(module) is LoraLinear
        and not module.disable_adapters
        and not module.merged
        and not any(name in module.lora_variant for name in module.active_adapters)
    )


class _View:
    """A stand-in for a module of the first agent: its own attributes, except the positions given as overrides."""

    def __init__(self, base: nn.Module, **overrides):
        self._base = base
        self.__dict__.update(overrides)

    def __getattr__(self, name: str):
        return getattr(self._base, name)


class SharedWeights:
    """Which modules a team shares: frozen parameters and buffers equal across agents, remembered per tensor version.

    Frozen parameters do not change, so a team's comparison is made once; a changed tensor (a new `_version`) is
    compared again.
    """

    def __init__(self):
        self._known: dict[tuple, bool] = {}

    def __call__(self, modules: list[nn.Module]) -> bool:
        tensors = [list(module.parameters()) + list(module.buffers()) for module in modules]
        if any(p.requires_grad for group in tensors for p in group if isinstance(p, nn.Parameter)):
            return False
        key = tuple((id(t), tensor_version(t)) for group in tensors for t in group)
        if key not in self._known:
            first = tensors[0]
            self._known[key] = all(
                len(group) == len(first) and all(_same(a, b) for a, b in zip(first, group, strict=True))
                for group in tensors[1:]
            )
        return self._known[key]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))


def team_view(models: list[nn.Module], sizes: list[int], shared: SharedWeights) -> _View:
    """The first agent's transformers model with every weighted module replaced by the team's (see the module
    docstring); `sizes[a]` rows of each batch are agent `a`'s, in agent order. Decide before generation (autocast
    marks frozen weights as trainable while it runs: see `AgentGRPOTrainer.generation_contexts`, entered first)."""
    first = models[0]

    def site(path: str):
        modules = [model.get_submodule(path) for model in models]
        if shared(modules):
            return modules[0]
        if all(_is_vanilla_lora(m) for m in modules) and shared([m.base_layer for m in modules]):
            return _SharedBaseLora(modules, sizes)
        return _PerAgent(modules, sizes)

    layers = []
    for i, layer in enumerate(first.model.layers):
        prefix = f"model.layers.{i}"
        attention = {name: site(f"{prefix}.self_attn.{name}") for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        mlp = {name: site(f"{prefix}.mlp.{name}") for name in ("gate_proj", "up_proj", "down_proj")}
        layers.append(
            _View(
                layer,
                apply_rotary_pos_emb=rotary_function(layer),
                input_layernorm=site(f"{prefix}.input_layernorm"),
                post_attention_layernorm=site(f"{prefix}.post_attention_layernorm"),
                self_attn=_View(layer.self_attn, **attention),
                mlp=_View(layer.mlp, **mlp),
            )
        )
    inner = _View(first.model, layers=layers, embed_tokens=site("model.embed_tokens"), norm=site("model.norm"))
    return _View(first, model=inner, lm_head=site("lm_head"))


def until_eos(tokens: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """Each row's tokens up to and including its first end-of-sequence token (all of them without one), as TRL
    keeps a completion of transformers' `generate`."""
    completions = []
    for row in tokens.tolist():
        end = next((i for i, token in enumerate(row) if token in eos_token_ids), len(row) - 1)
        completions.append(row[: end + 1])
    return completions


def weight_dtypes(model: nn.Module) -> set[torch.dtype]:
    """The dtypes of `model`'s parameters (a team decodes in one loop only where its agents' are the same)."""
    return {parameter.dtype for parameter in model.parameters()}
