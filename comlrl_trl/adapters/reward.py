"""The one place that knows TRL's `RewardTrainer` internals (MARLHF's joint reward model).

`RewardTrainerAdapter` lets a reward trainer live beside the agents' Accelerator (under DeepSpeed it reuses the
process's active plugin) and tokenises plain-text preference rows through a named hook, `tokenize_row`.
`active_deepspeed_plugin` swaps the reward configuration's DeepSpeed plugin in while that trainer is built and trained.
`load_sequence_classifier` loads the reward model as TRL's `RewardTrainer` does (with TRL's internal loader).
`zero3_scoring_engine` swaps a trained ZeRO-3 reward model's training engine for TRL's inference engine.
"""

import contextlib
from typing import Any

from accelerate.state import AcceleratorState
from accelerate.utils.deepspeed import get_active_deepspeed_plugin
from transformers import AutoModelForSequenceClassification, PreTrainedModel
from trl import RewardTrainer
from trl.data_utils import get_dataset_column_names
from trl.models.utils import prepare_deepspeed
from trl.trainer.reward_trainer import suppress_seqcls_warning
from trl.trainer.utils import create_model_from_path

from .grpo import deepspeed_state_exists, release_accelerator


@contextlib.contextmanager
def active_deepspeed_plugin(plugin):
    """Make `plugin` (a `TrainingArguments.deepspeed_plugin`) the process's active DeepSpeed plugin inside the block.

    The agents' Accelerator, created first, owns the process's DeepSpeed plugin, and Accelerate refuses a plugin on
    any later Accelerator. The reward model's trainer has its own batch size, learning rate and schedule, so its
    engine must be configured from its own plugin, not from the agents' (whose "auto" values are already filled):
    this swaps the reward config's plugin in while its trainer is built and trained, and restores the agents' after.
    Does nothing without DeepSpeed.
    """
    if plugin is None or not deepspeed_state_exists():
        yield
        return
    state = AcceleratorState()
    previous = state.deepspeed_plugins
    state.deepspeed_plugins = plugin
    plugin.select(_from_accelerator_state=True)
    try:
        yield
    finally:
        state.deepspeed_plugins = previous
        get_active_deepspeed_plugin(state).select(_from_accelerator_state=True)  # transformers' ZeRO-3 flag too


def zero3_scoring_engine(trainer: RewardTrainer):
    """The engine that scores with `trainer`'s model once it has trained under ZeRO-3, where its weights stay
    partitioned and only an engine's hooks gather them for a forward.

    The training engine is released (AdamW's moments, the fp32 master and gradient partitions, the reduce buckets:
    with DeepSpeed's default bucket of 5e8 elements, 2 GB in fp32 on every process) and the partitioned module is
    wrapped in TRL's inference engine (`prepare_deepspeed`, as TRL does for its reference models: ZeRO-3, no
    optimiser). Call it with the reward configuration's DeepSpeed plugin active. Release the engine with
    `release_engine`.
    """
    model, accelerator = trainer.model, trainer.accelerator
    release_accelerator(accelerator)
    return prepare_deepspeed(model, accelerator)


def load_sequence_classifier(source: str) -> PreTrainedModel:
    """A sequence-classification model with one output from `source`, loaded as TRL's `RewardTrainer` loads one: a
    causal LM gets a new `score` head, without transformers' warning about the head's newly initialised weights.

    No device map: TRL's default is "auto" on CUDA, which Accelerate refuses for a model trained under DDP or
    DeepSpeed (and ZeRO-3 partitions the weights itself). The Trainer places the model.
    """
    with suppress_seqcls_warning():
        return create_model_from_path(source, AutoModelForSequenceClassification, num_labels=1, device_map=None)


class RewardTrainerAdapter(RewardTrainer):
    """TRL's `RewardTrainer` with the seams MARLHF needs; subclasses implement `tokenize_row`."""

    # Tags of the models this trainer pushes to the Hub (TRL's `_tag_names`).
    model_tags: tuple[str, ...] = ("trl", "reward-trainer", "comlrl_trl")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._tag_names = list(cls.model_tags)

    def tokenize_row(self, row: dict[str, Any], processing_class, args) -> dict[str, list[int]]:
        """`{"chosen_ids", "rejected_ids"}` of one row with text `chosen`/`rejected` (and optional `prompt`)."""
        raise NotImplementedError

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        columns = get_dataset_column_names(dataset)
        first = next(iter(dataset)) if "chosen" in columns else None
        if first is not None and "chosen_ids" not in columns and isinstance(first["chosen"], str):
            removed = [name for name in ("prompt", "chosen", "rejected") if name in columns]
            dataset = dataset.map(
                lambda row: self.tokenize_row(row, processing_class, args),
                remove_columns=removed,
                desc=f"Tokenizing {dataset_name} joint texts",
            )
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        # Under DeepSpeed the agents' Accelerator came first; Accelerate refuses a plugin on a second one. This
        # trainer uses the active plugin, which MARLHF makes the reward config's own (`active_deepspeed_plugin`).
        if deepspeed_state_exists():
            args["deepspeed_plugin"] = None
        return args
