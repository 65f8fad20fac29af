"""Joint text: one string holding every agent's prompt (and response), for critics and reward models that see
the whole team.

The default layout, with agents numbered from 1 in actor order::

    [Agent 1 prompt]
    <agent 1's prompt>

    [Agent 1 response]
    <agent 1's response>

    [Agent 2 prompt]
    ...

Without responses only the prompt blocks are written. Chat prompts (lists of messages) are rendered one message
per line as `role: content`.
"""

from collections.abc import Sequence
from typing import Any


def prompt_text(prompt: Any) -> str:
    """A prompt as plain text: strings as they are, chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message['role']}: {message['content']}" for message in prompt)


def joint_text(prompts: Sequence[Any], completions: Sequence[str] | None = None) -> str:
    """The team's prompts (and responses, when given) as one string in the documented layout."""
    if completions is not None and len(completions) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} responses: pass one of each per agent.")
    blocks = []
    for i, prompt in enumerate(prompts, start=1):
        blocks.append(f"[Agent {i} prompt]\n{prompt_text(prompt)}")
        if completions is not None:
            blocks.append(f"[Agent {i} response]\n{completions[i - 1]}")
    return "\n\n".join(blocks)
