"""`max_prompt_length`: prompts longer than it are truncated from the left, as TRL's trainers that have the option
do (the end of a prompt, where the question and the generation prompt sit, is kept), with a warning."""

from transformers.utils import logging


logger = logging.get_logger(__name__)


class PromptTruncationMixin:
    """Truncates the token ids of every prompt to the last `args.max_prompt_length` tokens before generation."""

    agent_index: int = 0
    _warned_truncation = False

    def _tokenize_prompts(self, prompts: list):
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        limit = getattr(self.args, "max_prompt_length", None)
        if limit is None:
            return prompt_ids, images, multimodal_fields
        lengths = [len(ids) for ids in prompt_ids]
        if max(lengths, default=0) <= limit:
            return prompt_ids, images, multimodal_fields
        if images is not None or multimodal_fields:
            raise ValueError(f"A prompt of agent {self.agent_index} has {max(lengths)} tokens, above "
                             f"max_prompt_length={limit}, and holds images, which cannot be truncated; shorten it or "
                             "raise max_prompt_length.")
        if not self._warned_truncation:
            self._warned_truncation = True
            logger.warning(
                "Agent %d: %d of %d prompts are longer than max_prompt_length=%d tokens (the longest has %d) and are "
                "truncated from the left. Shorten the prompts, or raise max_prompt_length (None: no limit). This "
                "warning is shown once per agent.",
                self.agent_index, sum(n > limit for n in lengths), len(lengths), limit, max(lengths))
        return [ids[-limit:] for ids in prompt_ids], images, multimodal_fields
