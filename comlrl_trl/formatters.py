"""Formatters turn a task item into one agent's prompt."""

from collections.abc import Callable, Sequence
from typing import Any

from .joint_reward import accepts_keyword


Formatter = Callable[[dict[str, Any]], Any]


def default_formatter(item: dict[str, Any]) -> str:
    """The prompt of an item is its `prompt` field."""
    if "prompt" not in item:
        raise KeyError(
            f"The default formatter reads the 'prompt' field, but this task item has only {sorted(item)}. "
            "Pass formatters=... to build prompts from other fields."
        )
    return item["prompt"]


def build_formatters(formatters: Formatter | Sequence[Formatter] | None, num_agents: int) -> list[Formatter]:
    """One formatter per agent, in actor order: `None` (read `prompt`), one callable for all, or a list of N."""
    if formatters is None:
        return [default_formatter] * num_agents
    if callable(formatters):
        return [formatters] * num_agents
    if isinstance(formatters, (list, tuple)):
        if len(formatters) != num_agents:
            raise ValueError(
                f"Got {len(formatters)} formatters for {num_agents} agents: pass one formatter for all agents or a "
                "list with one per agent, in actor order."
            )
        for i, formatter in enumerate(formatters):
            if not callable(formatter):
                raise TypeError(f"formatters[{i}] must be a callable item -> prompt, got {type(formatter).__name__}.")
        return list(formatters)
    raise TypeError(f"formatters must be None, a callable or a list of callables, got {type(formatters).__name__}.")


def format_prompt(
    formatter: Formatter,
    item: dict[str, Any],
    agent_idx: int,
    external_prompt: str | None = None,
    passthrough: bool = False,
    label: str = "a task item",
) -> Any:
    """One agent's prompt for a task item: a string or a list of chat messages.

    At the first turn the formatter sees the item. At later turns `external_prompt` (from the external
    transition) is used verbatim with `passthrough`, else given to formatters that accept `external_prompts`,
    else it replaces the item's `prompt` field before formatting. `label` names the item in errors.
    """
    try:
        if external_prompt is None:
            prompt = formatter(item)
        elif passthrough:
            prompt = external_prompt
        elif accepts_keyword(formatter, "external_prompts"):
            prompt = formatter(item, external_prompts=external_prompt)
        else:
            prompt = formatter({**item, "prompt": external_prompt})
    except Exception as error:
        error.add_note(f"comlrl_trl: raised by the formatter of agent {agent_idx} on {label}")
        raise
    check_prompt(prompt, agent_idx, label)
    return prompt


def check_prompt(prompt: Any, agent_idx: int, label: str, source: str = "the formatter") -> None:
    """A prompt is a non-empty string or a non-empty list of chat messages, each with a string `role` and
    `content`; anything else would fail deep inside generation."""
    where = f"{source} of agent {agent_idx} on {label}"
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(
                f"{where} gave an empty prompt; the model needs at least one prompt token. Return "
                "some text (e.g. the task statement), or drop items without one from the dataset."
            )
        return
    if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
        raise TypeError(
            f"{source} of agent {agent_idx} returned {type(prompt).__name__} on {label}; a prompt must be "
            "a string or a list of chat messages ({'role': ..., 'content': ...})."
        )
    if not prompt:
        raise ValueError(
            f"{where} gave an empty chat prompt []; give at least one message {{'role': 'user', 'content': ...}}."
        )
    for m, message in enumerate(prompt):
        if not isinstance(message.get("role"), str) or "content" not in message:
            raise ValueError(
                f"{where} gave a chat message without a string 'role' and a 'content' (message {m}: "
                f"{message!r}); every message needs both, e.g. {{'role': 'user', 'content': '...'}}."
            )
