"""Centralised collaboration: one joint policy writes every role's output in one completion.

An adapter builds the joint prompt from every role's formatted prompt and splits a joint completion into one
output per role; `CentralizedCollaboration` turns the user's role formatters and joint reward into the single
formatter and reward of a one-agent team. Used by [`CentralizedMAGRPOTrainer`].
"""

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .formatters import Formatter, build_formatters, format_prompt
from .inputs import check_reward_arity
from .joint_reward import JointReward


class CentralizedComparatorParseError(ValueError):
    """A joint completion holds none of the role sections (the collaboration then gives every role `""`)."""


class CentralizedComparatorAdapter(Protocol):
    """Builds the joint prompt and splits joint completions (CoMLRL's protocol)."""

    def build_prompt(self, batch_item: dict[str, Any], agent_prompts: Sequence[str]) -> str: ...

    def parse_completion(self, completion: str, batch_item: dict[str, Any], num_agents: int) -> Sequence[str]: ...


@dataclass(frozen=True)
class TaggedCentralizedComparatorAdapter:
    """Asks for `<agent_i>...</agent_i>` sections (CoMLRL's prompt, word for word) and reads them back."""

    def build_prompt(self, batch_item: dict[str, Any], agent_prompts: Sequence[str]) -> str:
        sections = "\n\n".join(f"Agent {i} original prompt:\n{prompt}" for i, prompt in enumerate(agent_prompts))
        outputs = "\n".join(f"<agent_{i}>\n...\n</agent_{i}>" for i in range(len(agent_prompts)))
        return (
            f"You are a centralized coordinator producing the separate outputs of {len(agent_prompts)} agents.\n"
            "Each output must satisfy its corresponding original prompt. Keep the outputs separate;\n"
            "do not merge them or add commentary outside the required tags.\n\n"
            f"{sections}\n\nReturn exactly one section for each agent in this format:\n{outputs}\n"
        )

    def parse_completion(self, completion: str, batch_item: dict[str, Any], num_agents: int) -> list[str]:
        outputs, found = [], False
        for i in range(num_agents):
            match = re.search(
                rf"<\s*agent_{i}\s*>(.*?)<\s*/\s*agent_{i}\s*>", str(completion), flags=re.IGNORECASE | re.DOTALL
            )
            found = found or match is not None
            outputs.append(match.group(1).strip() if match is not None else "")
        if not found:
            raise CentralizedComparatorParseError("The joint completion holds no <agent_i> section.")
        return outputs


class CentralizedCollaboration:
    """The one formatter and the one reward of a joint policy, from the roles' formatters and joint reward.

    The reward is called like a team's: once per task item with one list per role (the role outputs of the K
    joint completions, position j of every list from completion j), and returns one reward per joint completion.
    A completion the adapter cannot parse gives every role an empty output, with a warning at the first such
    completion and again each time their count reaches a power of ten (`unparsed` counts them, `scored` every joint
    completion the reward saw).
    """

    def __init__(
        self, adapter, formatters: Formatter | Sequence[Formatter] | None, reward_func: Callable, num_roles: int
    ):
        for method in ("build_prompt", "parse_completion"):
            if not callable(getattr(adapter, method, None)):
                raise TypeError(f"centralized_adapter.{method} must be callable.")
        self.adapter = adapter
        self.num_roles = num_roles
        self.formatters = build_formatters(formatters, num_roles)
        check_reward_arity(reward_func, num_roles, lists="role")
        self.role_reward = JointReward(reward_func)
        self.reward_func = reward_func
        self.unparsed = 0
        self.scored = 0

    def build_prompt(self, item: dict[str, Any]) -> str:
        role_prompts = [format_prompt(formatter, item, role) for role, formatter in enumerate(self.formatters)]
        prompt = self.adapter.build_prompt(item, role_prompts)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"centralized_adapter.build_prompt must return a non-empty string, got {prompt!r}.")
        return prompt

    def split(self, completion: str, item: dict[str, Any]) -> list[str]:
        """One output per role."""
        outputs = self._parse(completion, item)
        return [""] * self.num_roles if outputs is None else outputs

    def _parse(self, completion: str, item: dict[str, Any]) -> list[str] | None:
        """One output per role, or None when the adapter finds no role section."""
        try:
            outputs = self.adapter.parse_completion(completion, item, self.num_roles)
        except CentralizedComparatorParseError:
            return None
        if isinstance(outputs, (str, bytes)) or len(outputs) != self.num_roles:
            raise ValueError(
                f"centralized_adapter.parse_completion must return {self.num_roles} outputs (one per "
                f"role), got {outputs!r}."
            )
        if not all(isinstance(output, str) for output in outputs):
            raise TypeError(f"centralized_adapter.parse_completion must return strings, got {outputs!r}.")
        return list(outputs)

    def __call__(self, completions: list[str], *, batch_items: list[dict[str, Any]]) -> list[float]:
        item = batch_items[0]
        parsed = [self._parse(completion, item) for completion in completions]
        self._count_unparsed(sum(output is None for output in parsed), len(parsed))
        outputs = [[""] * self.num_roles if output is None else output for output in parsed]
        roles = [[output[role] for output in outputs] for role in range(self.num_roles)]
        return self.role_reward(roles, item, "the role outputs of a task item")

    def _count_unparsed(self, unparsed: int, scored: int) -> None:
        """Warn at the first unparsed joint completion and whenever their count passes a power of ten."""
        before, self.unparsed, self.scored = self.unparsed, self.unparsed + unparsed, self.scored + scored
        if unparsed and (before == 0 or len(str(self.unparsed)) > len(str(before))):
            warnings.warn(
                f"{self.unparsed} of {self.scored} joint completions so far held no role section "
                f"({type(self.adapter).__name__} found none), so every role got '' for them and the reward scored "
                "empty outputs. An untrained policy often ignores the format; if this persists, check the joint "
                "prompt (centralized_adapter.build_prompt), max_new_tokens (sections cut off) and the adapter's "
                "parse_completion.",
                stacklevel=2,
            )

    def split_turns(self, joint_turns: list, items: list[dict[str, Any]]) -> list:
        """`[1][item][turn]` joint completions -> `[role][item][turn]` role outputs (for `eval_logger`)."""
        parsed = [[self.split(completion, item) for completion in turns] for turns, item in zip(joint_turns[0], items)]
        return [[[outputs[role] for outputs in turns] for turns in parsed] for role in range(self.num_roles)]
