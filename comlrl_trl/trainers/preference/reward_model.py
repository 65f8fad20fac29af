"""The joint reward model of MARLHF: TRL's RewardTrainer on joint responses, and scoring with the frozen model."""

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.trainer_utils import set_seed

from ...adapters.reward import RewardTrainerAdapter, load_sequence_classifier
from ...formatters import format_prompt
from ...joint_reward import JointReward
from ...loading import base_model


_HEAD_NAMES = ("score", "classifier")


def load_reward_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """The reward model's own tokenizer, with a pad token (EOS when it has none)."""
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The reward model's tokenizer ({source!r}) has no EOS token, which ends every joint text.")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_reward_backbone(source: str, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A sequence-classification model with one output from `source` (a causal LM gets a new, seeded `score` head)."""
    set_seed(seed)  # the new head is random: seed it, as TRL's RewardTrainer does
    model = load_sequence_classifier(source)  # on no device: the Trainer places it
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # the last non-pad token is scored
    return model


def reward_head(model: torch.nn.Module) -> torch.nn.Module:
    """The scalar head of a sequence-classification model (`score` or `classifier`)."""
    base = base_model(model)
    for name in _HEAD_NAMES:
        head = getattr(base, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise ValueError(
        f"{type(base).__name__} has no reward head named {' or '.join(_HEAD_NAMES)}; reward_freeze_backbone needs one."
    )


def freeze_reward_backbone(model: torch.nn.Module) -> None:
    """Train only the scalar head."""
    head = reward_head(model)
    model.requires_grad_(False)
    head.requires_grad_(True)


def encode_joint_texts(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_length: int | None
) -> list[list[int]]:
    """Token ids of joint texts for the reward model: truncated to `max_length - 1` tokens, then EOS.

    Training and scoring both use this function, so the reward model sees the same inputs in both.
    """
    encoded = []
    for ids in tokenizer(list(texts))["input_ids"]:
        if max_length is not None:
            ids = ids[: max_length - 1]
        if not ids or ids[-1] != tokenizer.eos_token_id:
            ids = [*ids, tokenizer.eos_token_id]
        encoded.append(ids)
    return encoded


class JointRewardTrainer(RewardTrainerAdapter):
    """
    TRL's [`~trl.RewardTrainer`] for joint responses: Bradley-Terry loss, optional `margin` column and
    `center_rewards_coefficient`, PEFT, logging and Accelerate all stay TRL's.

    The training rows are `{"chosen": str, "rejected": str}` joint texts (optionally with `"prompt"`, prepended to
    both, and `"margin"`). Texts are tokenised with [`encode_joint_texts`]: `args.max_length` truncates (TRL would drop
    longer rows) and every sequence ends with EOS.

    Args:
        freeze_backbone (`bool`, *optional*, defaults to `False`):
            Train only the scalar head. Not combinable with `peft_config`.
        Other arguments: as [`~trl.RewardTrainer`].
    """

    model_tags = ("trl", "reward-trainer", "comlrl_trl", "marlhf")

    def __init__(
        self,
        model,
        args=None,
        train_dataset=None,
        processing_class=None,
        peft_config=None,
        freeze_backbone: bool = False,
        **kwargs,
    ):
        if freeze_backbone and peft_config is not None:
            raise ValueError(
                "reward_freeze_backbone=True trains only the head, so a reward peft_config has nothing "
                "to adapt; use one or the other."
            )
        super().__init__(
            model=model,
            args=args,
            train_dataset=train_dataset,
            processing_class=processing_class,
            peft_config=peft_config,
            **kwargs,
        )
        if freeze_backbone:
            freeze_reward_backbone(self.model)

    def tokenize_row(self, row: dict[str, Any], processing_class, args) -> dict[str, list[int]]:
        prefix = row.get("prompt") or ""
        chosen, rejected = encode_joint_texts(
            processing_class, [prefix + row["chosen"], prefix + row["rejected"]], args.max_length
        )
        return {"chosen_ids": chosen, "rejected_ids": rejected}


class RewardModelScorer:
    """Scores joint texts with a frozen reward model: right padding, the logit at the last non-pad token."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int | None,
        batch_size: int = 8,
        device: torch.device | str | None = None,
    ):
        self.model = model.eval().requires_grad_(False)
        if device is not None:
            self.model.to(device)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()  # not inference_mode: ZeRO-3's hooks gather and release the weights in place (as TRL scores)
    def score(self, texts: Sequence[str]) -> list[float]:
        scores = []
        encoded = encode_joint_texts(self.tokenizer, texts, self.max_length)
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(encoded), self.batch_size):
            batch = encoded[start : start + self.batch_size]
            width = max(len(ids) for ids in batch)
            input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in batch], device=self.device)
            attention_mask = torch.tensor(
                [[1] * len(ids) + [0] * (width - len(ids)) for ids in batch], device=self.device
            )
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores


def score_shared(scorer: RewardModelScorer, texts: Sequence[str], accelerator) -> list[float]:
    """Scores of `texts` (the same list on every process), each process scoring its share; every process gets all.

    The texts are dealt like evaluation items (`even_shard`: every process scores as many, padded with a repeat whose
    score is dropped, since ZeRO-3 gathers the weights collectively in every forward), so N processes run about 1/N
    of the forwards each instead of all of them on every process.
    """
    from accelerate.utils import gather_object

    from ...batching import even_shard

    processes = accelerator.num_processes
    indices, kept = even_shard(len(texts), accelerator.process_index, processes)
    scores = scorer.score([texts[i] for i in indices])
    if processes == 1:
        return scores
    scored = dict(gather_object(list(zip(indices[:kept], scores[:kept]))))
    return [scored[i] for i in range(len(texts))]


class LearnedJointReward:
    """
    The joint reward of the RL stage: the frozen reward model's score of every joint text.

    Called like a task reward, `(*agent_completions, batch_items=[item])`, it rebuilds every agent's prompt with its
    formatter and scores `joint_formatter(prompts, completions)` for each joint action. Learned scores do not go
    through `reward_processor`. Inside `task_reward_mode()` (evaluation) it returns the task reward instead,
    processed, with whatever count the task reward returns (the trainer checks it against its own contract).
    """

    def __init__(self, task_reward: JointReward, formatters: list[Callable], joint_formatter: Callable):
        self.task_reward = task_reward
        self.formatters = formatters
        self.joint_formatter = joint_formatter
        self.scorer: RewardModelScorer | None = None
        self._use_task_reward = False

    @contextlib.contextmanager
    def task_reward_mode(self):
        previous, self._use_task_reward = self._use_task_reward, True
        try:
            yield
        finally:
            self._use_task_reward = previous

    def joint_texts(self, item: dict[str, Any], agent_completions: Sequence[Sequence[str]]) -> list[str]:
        prompts = [format_prompt(formatter, item, a) for a, formatter in enumerate(self.formatters)]
        texts = []
        for j in range(len(agent_completions[0])):
            text = self.joint_formatter(prompts, [completions[j] for completions in agent_completions])
            if not isinstance(text, str):
                raise TypeError(f"joint_formatter must return a string, got {type(text).__name__}.")
            texts.append(text)
        return texts

    def __call__(self, *agent_completions, batch_items):
        item = batch_items[0]
        if self._use_task_reward:
            return self.task_reward.values([list(c) for c in agent_completions], item, "an evaluation item")
        if self.scorer is None:
            raise RuntimeError("The reward model is not trained yet: the RL stage runs after the preference stage.")
        return self.scorer.score(self.joint_texts(item, agent_completions))
