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

import copy
import logging
from contextlib import ExitStack

import torch
from torch import nn
from trl import GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from ..adapters.grpo import Rollout
from ..adapters.helpers import attribute_replaced
from ..loading import architecture, base_model
from .decoding import JointDecodingUnavailable, lean_decoding_applies, rotary_function


logger = logging.getLogger(__name__)


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
        key = tuple((id(t), t._version) for group in tensors for t in group)
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
    marks frozen weights as trainable while it runs: see `AgentGRPOTrainer.generation_contexts`)."""
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


class TeamGeneration:
    """Every agent's `generate` for one set of prompts per agent, as one joint decoding loop where it applies.

    TRL's side stays each agent's own: its tokenisation (`_tokenize_prompts`, with our truncation), and from the
    sampled tokens on its `_generate` (the completion ids up to the first end-of-sequence token, decoding, metrics),
    through its `rollout_func` seam. In between, the first agent's `generate` runs the team's rows, every agent's
    generation contexts entered (autocast, packed weights, our sampling). Elsewhere (`unavailable` names why), and
    where transformers' own loop would run, every agent generates in its own call.
    """

    def __init__(self, agents: list):
        self.agents = agents
        self.shared = SharedWeights()
        self._told = False

    def __call__(self, prompts: list[list]) -> list:
        """`prompts[a]`: agent `a`'s prompts; its `Rollout`, in agent order."""
        reason = self.unavailable()
        if reason is None:
            try:
                return self._joint(prompts)
            except JointDecodingUnavailable as error:
                reason = str(error)
        if not self._told:
            self._told = True
            logger.info("The agents generate one after the other: %s.", reason)
        return [agent.generate(agent_prompts) for agent, agent_prompts in zip(self.agents, prompts, strict=True)]

    def unavailable(self) -> str | None:
        """Why the team cannot decode in one loop, or None where it can."""
        agents = self.agents
        first = agents[0]
        if len(agents) < 2:
            return "one agent"
        if not first.args.joint_generation:
            return "joint_generation=False"
        if any(agent.use_vllm or agent.accelerator.device.type != "cpu" for agent in agents):
            return "not every agent generates with transformers on a CPU"
        if any(agent.is_deepspeed_enabled or agent.is_fsdp_enabled for agent in agents):
            return "DeepSpeed and FSDP gather each agent's parameters for its own call"
        if any(agent.rollout_func is not None or agent.tools for agent in agents):
            return "an agent has its own rollout function or tools"
        models = [base_model(agent.model) for agent in agents]
        if not all(lean_decoding_applies(model) for model in models):
            return "not every agent's model is one the lean decoding loop runs (Llama or Qwen2, SDPA, no hooks)"
        first_architecture, first_dtypes = architecture(models[0]), _weight_dtypes(models[0])
        if any(architecture(model) != first_architecture for model in models[1:]):
            return "the agents' models have different architectures"
        if any(_weight_dtypes(model) != first_dtypes for model in models[1:]):
            return "the agents' weights have different dtypes"
        settings = [(a.generation_config.to_dict(), a.generation_kwargs, a.eos_token_ids) for a in agents]
        if any(setting != settings[0] for setting in settings):
            return "the agents sample with different settings"
        return None

    def _joint(self, prompts: list[list]) -> list:
        agents, first = self.agents, self.agents[0]
        prompt_ids = []
        for agent, agent_prompts in zip(agents, prompts, strict=True):
            ids, images, multimodal_fields = agent._tokenize_prompts(copy.deepcopy(agent_prompts))
            if images is not None or multimodal_fields:
                raise JointDecodingUnavailable("the prompts hold images")
            prompt_ids.append(ids)
        sizes = [len(ids) for ids in prompt_ids]
        view = team_view([base_model(agent.model) for agent in agents], sizes, self.shared)
        rows = [torch.tensor(ids) for agent_ids in prompt_ids for ids in agent_ids]
        device = first.accelerator.device
        input_ids = pad(rows, padding_value=first._tokenizer.pad_token_id, padding_side="left").to(device)
        mask = pad([torch.ones_like(row) for row in rows], padding_value=0, padding_side="left").to(device)
        with ExitStack() as stack:
            for a, agent in enumerate(agents):
                stack.enter_context(agent.generation_contexts(rows=sizes[a], team=view if a == 0 else None))
            model = stack.enter_context(
                unwrap_model_for_generation(
                    first.model_wrapped,
                    first.accelerator,
                    gather_deepspeed3_params=first.args.ds3_gather_for_generation,
                    generation_kwargs=first.generation_kwargs,
                    gradient_checkpointing_kwargs=first.args.gradient_checkpointing_kwargs,
                )
            )
            config = first.generation_config
            sequences = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
        new_tokens = sequences[:, input_ids.shape[1] :].cpu().split(sizes)
        rollouts = []
        for agent, agent_prompts, ids, tokens in zip(agents, prompts, prompt_ids, new_tokens, strict=True):
            output = {"prompt_ids": ids, "completion_ids": until_eos(tokens, agent.eos_token_ids), "logprobs": None}
            with attribute_replaced(agent, "rollout_func", lambda _prompts, _trainer, output=output: output):
                rollouts.append(Rollout(*GRPOTrainer._generate(agent, agent_prompts)))
        return rollouts


def until_eos(tokens: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """Each row's tokens up to and including its first end-of-sequence token (all of them without one), as TRL
    keeps a completion of transformers' `generate`."""
    completions = []
    for row in tokens.tolist():
        end = next((i for i, token in enumerate(row) if token in eos_token_ids), len(row) - 1)
        completions.append(row[: end + 1])
    return completions


def _weight_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {parameter.dtype for parameter in model.parameters()}
