"""Loading models from the places trainers accept: ids, local directories (full weights or a PEFT adapter
written by `save_model`) and model objects, and reloading exported weights into a live model."""

import copy
import os
import sys
from contextlib import contextmanager
from typing import Any

from peft import PeftModel
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from transformers import AutoModelForCausalLM, PreTrainedModel

from .adapters.helpers import zero_partition_dtype


# Config entries that name, identify or place a model, or pick its attention backend, without shaping its computation
# (`architectures` gives way to the model's class: a model built in memory has none until it is saved).
_NOT_ARCHITECTURE = frozenset(
    {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "use_cache", "architectures"}
    | {"bos_token_id", "eos_token_id", "pad_token_id", "_attn_implementation_autoset", "_attn_implementation"}
)


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model`, without the DDP, DeepSpeed or torch.compile wrapper Accelerate may have put around it, is a
    PEFT model: Accelerate's `is_peft_model` without its reads of package metadata at every call (1.1 ms, asked at
    every generation, value forward and MADPO reference pass). peft is a dependency of this package."""
    deepspeed = sys.modules.get("deepspeed")  # a DeepSpeed engine exists only once deepspeed is imported
    wrappers = (DistributedDataParallel, DataParallel) + ((deepspeed.DeepSpeedEngine,) if deepspeed else ())
    model = getattr(model, "_orig_mod", model)  # torch.compile
    if isinstance(model, wrappers):
        model = getattr(model.module, "_orig_mod", model.module)
    return isinstance(model, PeftModel)


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model of `model`: a PEFT model's base model (also through `torch.compile`, whose module
    forwards the attribute), any other model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def architecture(model: nn.Module) -> dict[str, Any]:
    """What two models must share to run through one computation: the transformers model's class (a PEFT model's
    base) and its config, without names, token ids, dtype and attention backend."""
    base = base_model(model)
    config = {key: value for key, value in base.config.to_dict().items() if key not in _NOT_ARCHITECTURE}
    return {"model class": type(base).__name__, **config}


_MODEL_FILES = ("config.json", "adapter_config.json")  # a model directory, or a PEFT adapter saved by save_model


def check_model_source(source, name: str) -> None:
    """Refuse, naming the argument (`name`), a model string that cannot load: a local-looking path that does not
    exist, a directory without `config.json` (or a PEFT adapter's `adapter_config.json`), a file, or, with
    `HF_HUB_OFFLINE` set, a Hub id that is not in the local cache. Model objects pass.

    A string is a local path when it starts with `.`, `/` or `~`, has more than the one `/` of a Hub id
    (`namespace/name`), or its parent directory exists; anything else is a Hub id.
    """
    if not isinstance(source, (str, os.PathLike)):
        return
    text = os.fspath(source)
    path = os.path.expanduser(text)
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, file)) for file in _MODEL_FILES):
            raise ValueError(
                f"{name}={text!r} is a directory without config.json, so it is not a model. Pass the directory that "
                "holds the model's config.json and weights (what save_pretrained writes, or an agent_i directory of "
                "save_model)."
            )
        return
    if os.path.exists(path):
        raise ValueError(f"{name}={text!r} is a file, not a model: pass the directory that holds config.json.")
    parent = os.path.dirname(path.rstrip("/"))
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or (parent and os.path.isdir(parent)):
        raise ValueError(
            f"{name}={text!r}: no such directory ({os.path.abspath(path)!r}). Pass an existing model directory (one "
            "with config.json) or a Hub model id such as 'Qwen/Qwen2.5-0.5B-Instruct'."
        )
    if _hub_offline() and not _in_hub_cache(text):
        raise ValueError(
            f"{name}={text!r} is not a local directory, and HF_HUB_OFFLINE is set, so it must come from the Hub "
            "cache, which does not hold it. Download it once with network access (`hf download "
            f"{text}`), pass a local model directory, or unset HF_HUB_OFFLINE."
        )


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode()) if hasattr(constants, "is_offline_mode") else constants.HF_HUB_OFFLINE


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    for file in _MODEL_FILES:
        try:
            if isinstance(try_to_load_from_cache(repo_id, file), str):
                return True
        except ValueError:  # not a valid repo id (HFValidationError)
            return False
    return False


def load_causal_lm(source, model_kwargs: dict | None = None, what: str = "critic", weights=None) -> PreTrainedModel:
    """A critic backbone from a model id, a local directory (full weights or a PEFT adapter) or a model object,
    loaded inside the `weights()` block (default `whole_weights`: whole on this process)."""
    if isinstance(source, nn.Module):
        return source
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"{what} must be a model id, a local path or a model object, got {type(source).__name__}.")
    source = os.fspath(source)
    with (weights or whole_weights)():
        adapter = load_saved_adapter(source, model_kwargs)
        return adapter if adapter is not None else AutoModelForCausalLM.from_pretrained(source, **(model_kwargs or {}))


def one_device_loading(model_init_kwargs: dict | None) -> dict:
    """The agents' loading settings (`model_init_kwargs`, which TRL passes to `from_pretrained`) with
    `device_map=None` unless one is given.

    Without a `device_map` TRL picks `"auto"` for a single process on a GPU machine, which spreads each agent's
    layers over every visible GPU (several agents then share all of them, and compute hops between cards). With
    `None` the model loads whole and the Trainer moves it to the process's one device (`cuda:0`, or `LOCAL_RANK`'s
    under a launcher), as TRL already does for DDP and DeepSpeed. An explicit `device_map` is kept.
    """
    return {"device_map": None, **(model_init_kwargs or {})}


def load_saved_adapter(source, model_kwargs: dict | None = None):
    """A local directory holding a PEFT adapter (from `save_model` with LoRA), loaded trainable; otherwise None."""
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(os.path.join(source, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM

        return AutoPeftModelForCausalLM.from_pretrained(source, is_trainable=True, **(model_kwargs or {}))
    return None


@contextmanager
def whole_weights():
    """Load a model with all its weights on this process even while DeepSpeed ZeRO-3 is configured.

    For what must be whole on every process: a critic outside ZeRO-3 (under ZeRO-3 critics load partitioned, see
    `actor_critic.critic_loading.load_critic_backbone`) and the tiny test models `testing.py` writes to disk.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    reference = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = reference


def load_exported_weights(model, path: str) -> None:
    """Load the weights that `save_pretrained` wrote into `path` back into `model` (full weights or an adapter)."""
    if is_peft_model(model):
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        set_peft_model_state_dict(model, load_peft_weights(path, device=str(model.device)))
        return
    from transformers.trainer_utils import load_sharded_checkpoint

    if os.path.isfile(os.path.join(path, "model.safetensors")):
        from safetensors.torch import load_file

        state = load_file(os.path.join(path, "model.safetensors"), device=str(model.device))
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or {})
        if unexpected or [key for key in missing if key not in tied]:
            raise ValueError(f"Weights in {path} do not match the critic: missing {missing}, unexpected {unexpected}.")
        return
    load_sharded_checkpoint(model, path, strict=False)


def attach_value_head(model, head: nn.Module) -> None:
    """Register `head` as the actor's `value_head`, kept out of `save_pretrained` (it is saved as value_head.pt).

    A backbone that ZeRO-3 partitioned while loading holds DeepSpeed's precision (bf16 under bf16 mixed precision),
    and DeepSpeed casts no parameter added later; its optimiser takes one dtype per partition. The head is therefore
    cast to the backbone's dtype there (DeepSpeed keeps fp32 master weights for it all the same).
    """
    partition_dtype = zero_partition_dtype(model)
    if partition_dtype is not None:
        head.to(partition_dtype)
    model.value_head = head
    if isinstance(model, PreTrainedModel):
        ignored = set(model._keys_to_ignore_on_save or ())
        model._keys_to_ignore_on_save = ignored | {f"value_head.{key}" for key in head.state_dict()}


def shared_lora_bases(models: list, peft_configs: list, agent_args: list) -> list:
    """The agents' models with one copy of each frozen LoRA base per process: the sources TRL would load separately
    for LoRA agents on the same base (same model id or path, same loading settings) are loaded once here, and every
    further agent gets a model object of its own whose parameters are that model's `Parameter` objects.

    `models` holds each agent's source as the trainer passes it to TRL (a model id or path, or a model object),
    `peft_configs` and `agent_args` each agent's `peft_config` and config. A source is shared when it is a string, its
    agent trains a `peft_config` that keeps the base frozen (`bias="none"`) and at least one other agent has the same
    source and loading settings
    (`adapters.agent_models.agent_load_kwargs`); every other entry is returned as it is, for TRL to load.

    The copies are made before TRL wraps any model in PEFT: `copy.deepcopy` with every parameter in the memo, so
    each agent has its own modules (PEFT replaces its target layers in that agent's tree only, and the adapters are
    each agent's own) around the same frozen tensors. Peak memory is one base plus the buffers (rotary tables) and
    adapters, instead of N bases until `_share_frozen_base_weights` pointed them at one. The parameters are the
    same objects, not equal tensors, so in-place moves keep them shared: the Trainer's `.to(device)` of agent 0 moves
    every agent's base, and DeepSpeed ZeRO-1/2 (which partitions only the trainable adapters) casting or placing the
    module of each engine in turn finds the base already done.

    Under ZeRO-3 (every parameter partitioned, each engine its own partitions) and FSDP (each wrapped model flattens
    its parameters) nothing is shared: each agent loads its own base, as before.
    """
    from .adapters.agent_models import agent_load_kwargs, load_agent_model

    if len(models) != len(peft_configs) or len(models) != len(agent_args):
        raise ValueError(
            f"shared_lora_bases needs one entry per agent: got {len(models)} models, {len(peft_configs)} "
            f"peft_configs and {len(agent_args)} configs."
        )
    groups: dict[str, list[int]] = {}  # (source, loading settings) -> the agents that load it
    for i, (source, peft_config, args) in enumerate(zip(models, peft_configs, agent_args)):
        if isinstance(source, str) and _frozen_base(peft_config) and not _partitions_parameters(args):
            groups.setdefault(repr((source, sorted(agent_load_kwargs(args).items(), key=str))), []).append(i)
    shared = list(models)
    for agents in groups.values():
        if len(agents) < 2:
            continue
        base = load_agent_model(models[agents[0]], agent_args[agents[0]])
        shared[agents[0]] = base
        for i in agents[1:]:
            shared[i] = copy_sharing_parameters(base)
    return shared


def copy_sharing_parameters(model: nn.Module) -> nn.Module:
    """A copy of `model`'s module tree (modules, buffers, config) that holds `model`'s own `Parameter` objects."""
    memo = {id(parameter): parameter for _, parameter in model.named_parameters(remove_duplicate=False)}
    return copy.deepcopy(model, memo)


def _frozen_base(peft_config) -> bool:
    """Whether an agent trains a PEFT adapter that leaves every base parameter frozen (`bias="none"`: PEFT's
    `bias="all"` or `"lora_only"` would train the base's biases in place, which agents cannot share)."""
    return peft_config is not None and getattr(peft_config, "bias", "none") == "none"


def _partitions_parameters(args) -> bool:
    """Whether `args` trains under DeepSpeed ZeRO-3 or FSDP, where each model's parameters are its own engine's."""
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is not None and plugin.zero_stage == 3:
        return True
    fsdp_env = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes")
    return bool(getattr(args, "fsdp", None)) or fsdp_env
