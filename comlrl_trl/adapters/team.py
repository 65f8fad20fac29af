"""The TRL and transformers side of a team trainer: a `GRPOTrainer` that is no agent and owns the training loop.

A team trainer is a TRL `GRPOTrainer` (users pass it TRL's configs and callbacks, `report_to`, `save_strategy`, and
read its `TrainerState`), but it trains no model of its own: its `model` is `AgentModels`, every agent's model in
actor order, and every agent, agent 0 included, is an `AgentGRPOTrainer` with its own model, optimiser, scheduler and
Accelerator. `TeamGRPOTrainer` builds the transformers side of that (`Trainer.__init__`: arguments, the shared
Accelerator state, callbacks and reporting integrations, `TrainerState`) and offers the pieces of transformers' loop
the team's loop reuses under named methods: the step plan, the state restored on resume, the epoch's micro-steps
grouped by optimiser update (with the resumed epoch's skipped batches and RNG state), gradient synchronisation and
the RNG files of a checkpoint. The loop itself is `trainers/team/trainer.py`'s `TeamTrainer.train()`.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import skip_first_batches
from datasets import IterableDataset
from transformers import Trainer
from transformers.utils import logging
from trl import GRPOTrainer

from .grpo import accelerator_args_reusing_deepspeed
from .sampler import fill_small_training_set


logger = logging.get_logger(__name__)


class AgentModels(torch.nn.ModuleList):
    """Every agent's model, in actor order: the `model` of a team trainer.

    It is never called: each agent's own trainer runs its model's forward and backward passes.
    """


def _rows(features: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The team's data collator: a generation batch is the list of its task rows, as in TRL's GRPO."""
    return features


@dataclass(frozen=True)
class TrainingPlan:
    """How long `train()` runs, as transformers counts it (one micro-step per batch of the data loader)."""

    num_train_epochs: int
    updates_per_epoch: int  # optimiser updates (`global_step`s) per epoch
    micro_steps_per_epoch: int  # data-loader batches per epoch
    max_steps: int  # optimiser updates of the whole run
    num_train_samples: int


class TeamGRPOTrainer(GRPOTrainer):
    """A `GRPOTrainer` that coordinates agent trainers instead of training a model itself (see the module docstring).

    `GRPOTrainer.__init__` (one policy, its reference model and reward functions) is not run; `Trainer.__init__`
    is, with `AgentModels` as the model, before any agent exists: the first Accelerator of the process is the
    team's, and every agent's reuses its state (and its DeepSpeed plugin).
    """

    def __init__(self, args, train_dataset, processing_class, callbacks):
        if isinstance(train_dataset, IterableDataset):
            # As GRPOTrainer does: batches of an iterable set hold strings, which Accelerate's dispatching (collating
            # on the main process) cannot concatenate, and its prompt repeats must be read by one worker.
            if args.accelerator_config.dispatch_batches:
                raise ValueError(
                    "An iterable train_dataset needs dispatch_batches=False, but accelerator_config sets it to True; "
                    "set accelerator_config={'dispatch_batches': False}."
                )
            args.accelerator_config.dispatch_batches = False
            if args.dataloader_num_workers != 0:
                logger.warning(
                    "An iterable train_dataset is read by one worker (its prompt repeats would be split between "
                    "workers): dataloader_num_workers=%d is overridden with 0.",
                    args.dataloader_num_workers,
                )
                args.dataloader_num_workers = 0
        Trainer.__init__(
            self,
            model=AgentModels(),
            args=args,
            data_collator=_rows,
            train_dataset=train_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
        )
        if self.is_deepspeed_enabled:
            # The agents load their models next; under ZeRO-3, transformers loads them inside `deepspeed.zero.Init`,
            # whose config check counts the processes through DeepSpeed's own communication layer, which is not
            # set up until a first engine exists (it would count one process and refuse the batch sizes).
            import deepspeed

            deepspeed.init_distributed()
        # What GRPOTrainer's data loading reads (its sampler repeats each prompt num_generations times).
        self.num_generations = args.num_generations
        self.num_iterations = args.num_iterations
        self.shuffle_dataset = args.shuffle_dataset

    def attach_agent_models(self, models: list[torch.nn.Module]) -> None:
        """Make the agents' models this trainer's `model` (callbacks and `Trainer` utilities see all of them)."""
        self.model.extend(models)

    # ----- the loop's pieces -----

    def training_plan(self, dataloader) -> TrainingPlan:
        """Epochs, updates and micro-steps of this run, from `num_train_epochs` or `max_steps` (transformers' rules)."""
        epochs, updates_per_epoch, _, num_samples, _, micro_steps, max_steps = self.set_initial_training_values(
            self.args, dataloader
        )
        return TrainingPlan(epochs, updates_per_epoch, micro_steps, max_steps, num_samples)

    def start_training_state(self, plan: TrainingPlan, resume: str | None, trial) -> tuple[int, int]:
        """A fresh `TrainerState`, or the checkpoint's (with the callbacks' saved states) when resuming.

        Returns the epochs already trained and the micro-steps already trained in the current epoch.
        """
        return self._init_training_state(plan.max_steps, plan.updates_per_epoch, plan.num_train_epochs, resume, trial)

    def epoch_updates(
        self, dataloader, epoch: int, plan: TrainingPlan, resume: str | None, first_epoch: int, skip: int
    ) -> Iterator[tuple[list[list[dict[str, Any]]], int]]:
        """One epoch's micro-steps grouped by optimiser update: yields each update's generation batches (one per
        micro-step, `gradient_accumulation_steps` of them, fewer for the last update of an epoch that does not divide
        evenly) and the number of micro-steps of the epoch done after it.

        A resumed run skips the micro-steps already trained in its first epoch and restores the checkpoint's RNG
        state where transformers does (after drawing the first update's batches, or at the epoch's start).
        """
        accumulation = self.args.gradient_accumulation_steps
        done, restore_rng_after_first = 0, False
        if epoch == first_epoch and resume is not None:
            if skip > 0 and not self.args.ignore_data_skip:
                dataloader, done, restore_rng_after_first = skip_first_batches(dataloader, skip), skip, True
            elif skip == 0:
                self._load_rng_state(resume)
        if hasattr(dataloader, "set_epoch"):
            dataloader.set_epoch(epoch)
        underlying = getattr(getattr(dataloader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(underlying, "set_epoch"):
            underlying.set_epoch(epoch)
        batches = iter(dataloader)
        remainder = plan.micro_steps_per_epoch % accumulation or accumulation
        for update in range(done // accumulation, plan.updates_per_epoch):
            count = accumulation if update != plan.updates_per_epoch - 1 else remainder
            micro = [batch for _, batch in zip(range(count), batches)]
            if not micro:
                return
            if restore_rng_after_first:
                self._load_rng_state(resume)
                restore_rng_after_first = False
            done += len(micro)
            yield micro, done

    def set_sync_gradients(self, sync: bool) -> None:
        """Whether the next backward passes end an optimiser update (all agents' Accelerators share this state)."""
        self.accelerator.gradient_state._set_sync_gradients(sync)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # transformers' log (history, callbacks, reporting); TRL's adds one policy's metrics, which a team has per agent
        Trainer.log(self, logs, start_time)

    # ----- checkpoint files -----

    def save_rng_state(self, output_dir: str) -> None:
        """Write the Python, NumPy, torch and device RNG states of this process into `output_dir`."""
        Trainer._save_rng_state(self, output_dir)

    def load_rng_state(self, checkpoint: str) -> None:
        Trainer._load_rng_state(self, checkpoint)

    def checkpoint_root(self, trial=None) -> str:
        """Where TRL's `save_strategy` writes `checkpoint-N` directories (`args.output_dir`, per trial)."""
        return self._get_output_dir(trial=trial)

    # ----- transformers hooks -----

    def _build_accelerator_args(self, **kwargs):
        return accelerator_args_reusing_deepspeed(super()._build_accelerator_args(**kwargs))

    def _get_train_sampler(self, dataset=None):
        return fill_small_training_set(super()._get_train_sampler(dataset))

    def _save_checkpoint(self, model, trial) -> None:
        self.save_checkpoint(trial)

    def save_checkpoint(self, trial=None) -> None:
        """Write a checkpoint of the whole team."""
        raise NotImplementedError
