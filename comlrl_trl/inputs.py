"""What a team trainer is given, resolved and checked at construction so that bad input fails before any work:
the agents' model sources, tokenizers and per-agent options, the trainer's callables, and the datasets."""

import copy
import inspect
import warnings
from collections.abc import Callable, Sequence, Sized
from typing import Any

from datasets import IterableDataset
from transformers import AutoTokenizer, PreTrainedModel

from .formatters import check_prompt
from .joint_reward import accepts_keyword
from .loading import load_saved_adapter


def check_datasets(train_dataset: Any, eval_dataset: Any, default_formatters: bool, eval_interval: int = 0) -> None:
    """An empty training or evaluation set is an error, not a run of 0 steps or a division by zero; training with
    periodic evaluation (`eval_interval` > 0) but no evaluation set is a warning, since nothing will be evaluated.

    With the default formatters (the `prompt` field is the prompt), every item's prompt is checked here too.
    """
    check_not_empty(train_dataset, "train_dataset")
    check_not_empty(eval_dataset, "eval_dataset", " Pass eval_dataset=None to train without evaluation.")
    if train_dataset is not None and eval_dataset is None and eval_interval > 0:
        warnings.warn(
            f"No eval_dataset: no evaluation will run during training (eval_interval={eval_interval} has nothing "
            "to evaluate) and evaluate() returns {}. Pass eval_dataset=... to evaluate; the recipes take it from "
            "the --dataset_test_split of --dataset_name, which a single JSON Lines file does not have (it is all "
            "'train': split it, or name a directory with train and test files). Set eval_interval=0 to train "
            "without evaluation and without this warning.",
            stacklevel=3,
        )
    if default_formatters:
        for name, dataset in (("task item", train_dataset), ("evaluation item", eval_dataset)):
            prompts = _prompt_column(dataset)
            for index, prompt in enumerate(prompts):
                check_prompt(prompt, 0, f"{name} {index} (its 'prompt' field, read by the default formatter)")


def check_not_empty(dataset: Any, name: str, hint: str = "") -> None:
    if dataset is not None and isinstance(dataset, Sized) and len(dataset) == 0:
        raise ValueError(f"{name} is empty: it holds no task items.{hint}")


def _prompt_column(dataset: Any) -> list:
    """The `prompt` column of a map-style dataset (the default formatter reports other layouts itself)."""
    names = getattr(dataset, "column_names", None)
    if dataset is None or not isinstance(dataset, Sized) or not names or "prompt" not in names:
        return []
    return list(dataset["prompt"])


# ----- agents -----


def resolve_agent_sources(agent_model, agents, num_agents, args) -> list:
    """The per-agent model sources, checked against `agent_model`, `num_agents` and `args.num_agents`."""
    if agents is not None:
        if isinstance(agents, (str, PreTrainedModel)) or not isinstance(agents, Sequence) or len(agents) == 0:
            raise TypeError("agents must be a non-empty list of model ids, paths or models (one per agent).")
        if any(agent is None for agent in agents):
            raise ValueError("agents entries must not be None.")
        sources = list(agents)
        if agent_model is not None:
            expected = model_name(agent_model)
            names = [model_name(agent) for agent in sources]
            if any(name != expected for name in names):
                raise ValueError(
                    f"agent_model and agents conflict: {expected!r} != {names}. Pass agents alone for a "
                    "heterogeneous team, or agent_model alone for copies of one model."
                )
        if num_agents is not None and num_agents != len(sources):
            raise ValueError(f"agents has {len(sources)} entries but num_agents={num_agents}.")
        return sources
    if agent_model is None:
        raise ValueError("Either agent_model (one model for all agents) or agents (one per agent) must be provided.")
    n = num_agents if num_agents is not None else (args.num_agents if args is not None else 2)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_agents must be a positive integer, got {n!r}.")
    if not isinstance(agent_model, str) and n > 1:
        raise ValueError(
            "agent_model must be a model id or path to build several agents (each agent gets its own copy); "
            "to pass model objects use agents=[model_0, model_1, ...]."
        )
    return [agent_model] * n


def model_name(source) -> str:
    """The model id or path of a source: the string itself, or a model object's `config.name_or_path`."""
    return source if isinstance(source, str) else source.config.name_or_path


def resolve_tokenizers(tokenizer, sources) -> list:
    """One tokenizer per agent: the given one for all, the given list, or each agent's own (loaded, left padding)."""
    n = len(sources)
    if isinstance(tokenizer, (list, tuple)):
        if len(tokenizer) != n:
            raise ValueError(f"Got {len(tokenizer)} tokenizers for {n} agents: pass one tokenizer or one per agent.")
        return list(tokenizer)
    if tokenizer is not None:
        return [tokenizer] * n
    if any(not isinstance(source, str) for source in sources):
        raise ValueError(
            "Tokenizer(s) must be provided when agents are model objects: pass tokenizer=... (one for all agents "
            "or a list with one per agent)."
        )
    return [AutoTokenizer.from_pretrained(source, padding_side="left") for source in sources]


def saved_adapter_or(source):
    """A saved LoRA agent directory is loaded trainable here; any other source goes to TRL as it is."""
    adapter = load_saved_adapter(source)
    return adapter if adapter is not None else source


def per_agent(value, n: int, name: str) -> list:
    """`value` for every agent (copied), or the given list of one per agent."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} agents: pass one for all or one per agent.")
        return list(value)
    return [copy.deepcopy(value) for _ in range(n)]


def check_trainer_inputs(args, reward_func, external_transition, train_dataset) -> None:
    """The team trainer's callables and batch shape, checked before any model is loaded."""
    if reward_func is None:
        raise ValueError("reward_func is required: a callable returning one reward per joint action.")
    check_reward_arity(reward_func, args.num_agents)
    if args.num_turns > 1 and external_transition is None:
        raise ValueError(
            f"num_turns={args.num_turns} needs an external_transition that builds the next turn's prompts."
        )
    if external_transition is not None and not callable(external_transition):
        raise TypeError(f"external_transition must be a callable, got {type(external_transition).__name__}.")
    k = args.num_generations
    local_rows = args.per_device_train_batch_size * args.steps_per_generation
    if local_rows % k != 0:
        raise ValueError(
            f"per_device_train_batch_size * steps_per_generation = {local_rows} must be a multiple of "
            f"num_generations = {k}, so that every task item's {k} completions per agent stay on one device and "
            "the joint reward sees whole groups."
        )
    if args.log_completions:
        raise ValueError("log_completions is not supported by multi-agent trainers yet; leave it False.")
    if isinstance(train_dataset, IterableDataset) and args.max_steps <= 0:
        raise ValueError("An IterableDataset has no length: set max_steps in the config to bound training.")


def check_reward_arity(reward_func: Callable, num_agents: int, lists: str = "agent") -> None:
    """A TypeError when `reward_func` certainly cannot be called the documented way, with one list of completions
    per agent (`num_agents` of them, positional) and `batch_items=` if it names that keyword.

    Checked before any model loads, by binding those arguments to the signature: defaults, `*args` and `**kwargs`
    are taken as Python takes them. A callable without a signature (some builtins) is not checked.
    """
    try:
        signature = inspect.signature(reward_func)
    except (TypeError, ValueError):
        return
    keywords = {"batch_items": [{}]} if accepts_keyword(reward_func, "batch_items") else {}
    try:
        signature.bind(*[[] for _ in range(num_agents)], **keywords)
    except TypeError as error:
        name = getattr(reward_func, "__name__", type(reward_func).__name__)
        expected = ", ".join(f"{lists}_{i}_completions" for i in range(num_agents))
        raise TypeError(
            f"reward_func {name}{signature} cannot take num_agents={num_agents} lists of completions ({error}). It "
            f"is called once per task item as reward_func({expected}, *, batch_items) (batch_items only if it "
            f"takes that keyword): give it {num_agents} positional parameters (or *completions), or set "
            f"num_agents to the number of lists it takes."
        ) from None
