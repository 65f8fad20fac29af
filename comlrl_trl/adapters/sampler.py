"""TRL's `RepeatSampler` for training sets smaller than one generation batch.

`FilledRepeatSampler` subclasses TRL's sampler (`trl.trainer.utils`, not TRL's public API) and copies its state, so
it lives in `adapters/`: `TeamGRPOTrainer._get_train_sampler` passes TRL's sampler through `fill_small_training_set`.
"""

import torch
from transformers.utils import logging
from trl.trainer.utils import RepeatSampler


logger = logging.get_logger(__name__)


class FilledRepeatSampler(RepeatSampler):
    """TRL's `RepeatSampler` for a training set with fewer task items than one generation batch: the items are
    repeated (in order, or in this epoch's shuffled order) to fill exactly one batch, instead of yielding nothing."""

    def __iter__(self):
        order = (
            torch.randperm(self.num_samples, generator=self.generator).tolist()
            if self.shuffle
            else list(range(self.num_samples))
        )
        chunk = [order[i % self.num_samples] for i in range(self.batch_size)]
        for _ in range(self.repeat_count):
            for index in chunk:
                yield from [index] * self.mini_repeat_count

    def __len__(self) -> int:
        return self.batch_size * self.mini_repeat_count * self.repeat_count


def fill_small_training_set(sampler):
    """`sampler` itself, or a `FilledRepeatSampler` (with a warning) when the training set cannot fill one batch.

    TRL's sampler yields whole generation batches only: a remainder of items is left out of every epoch (the same
    items without `shuffle_dataset=True`), which is worth a warning on many processes with small data sets.
    """
    if not isinstance(sampler, RepeatSampler):
        return sampler
    left_out = sampler.num_samples % sampler.batch_size
    if sampler.num_samples > sampler.batch_size and left_out:
        logger.warning(
            "train_dataset has %d task items and a generation batch takes %d, so %d items are left out of every "
            "epoch (%s). Use a number of items divisible by per_device_train_batch_size * steps_per_generation * "
            "processes / num_generations, or fewer processes.",
            sampler.num_samples,
            sampler.batch_size,
            left_out,
            "other items each epoch, shuffle_dataset=True"
            if sampler.shuffle
            else "always the last ones: shuffle_dataset=True varies them",
        )
    if not 0 < sampler.num_samples < sampler.batch_size:
        return sampler
    logger.warning(
        "train_dataset has %d task items, fewer than one generation batch (%d items: per_device_train_batch_size * "
        "steps_per_generation * processes / num_generations); its items are repeated to fill that batch.",
        sampler.num_samples,
        sampler.batch_size,
    )
    filled = FilledRepeatSampler.__new__(FilledRepeatSampler)
    filled.__dict__.update(sampler.__dict__)
    return filled
