"""The seam through which an agent's log-probability forward runs this package's training-side kernels.

TRL's `GRPOTrainer._get_per_token_logps_and_entropies` calls its `model` argument once per chunk of rows, as
`model(input_ids=..., attention_mask=..., labels=..., fused_lm_head=True)`. The agent hands it an
`AgentLogProbForward` in the model's place, which for that call, and for the agent's own model only:

- runs each distinct prompt of a chunk once (`adapters/shared_prompt.py`), where the agent allows it;
- on a CPU, scores the completion positions only, with the in-place backward (`adapters/cpu_logprob.py`,
  `cpu_fused_head`).

No module-level state of TRL, transformers or torch is changed (`tests/test_no_global_patches.py`).
"""

from typing import Any

from torch import nn

from .cpu_logprob import cpu_fused_head
from .shared_prompt import SharedPromptModel


class AgentLogProbForward:
    """`model` as an agent's log-probability forward calls it: with its prompts shared when `prompt_length` is given
    (the rows' prompt columns; None: rows run as TRL runs them) and the CPU head of `cpu_fused_head` inside each
    call."""

    def __init__(self, model: nn.Module, prompt_length: int | None = None):
        self.model = model
        self._call = model if prompt_length is None else SharedPromptModel(model, prompt_length=prompt_length)

    def __call__(self, **kwargs: Any) -> Any:
        with cpu_fused_head(self.model):
            return self._call(**kwargs)
