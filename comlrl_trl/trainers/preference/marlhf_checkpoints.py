"""Training checkpoints of MARLHF across its stages.

A boundary is reached after every preference stage (pairs collected, reward model trained) and after every RL
epoch; the `checkpoint_interval`-th boundaries are saved, and the last one of the run always is. A checkpoint
`checkpoint-N/` holds:

- `preference/pairs.json` and `preference/reward_model.safetensors`: the iteration's pairs and trained reward model
  (hard links to the previous checkpoint's files when they are the same);
- `rl/`: the RL stage trainer's own checkpoint (agents, optimisers, its progress and RNG) after an RL epoch, or
  `actors/` (the agents, and critics, as `save_model` writes them) after a preference stage;
- `rng_state.pth`, `comlrl_trl_state.pt` (iteration, env_step, log history, stateful user objects) and the metadata
  `comlrl_trl_checkpoint.json`, written last.

Resuming repeats the work since the checkpoint and gives the same result as an uninterrupted run.
"""

import os
import shutil
import uuid
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import TrainerCallback, TrainerState

from ...adapters.helpers import call_save_model
from ...checkpoint import (
    CHECKPOINT_VERSION,
    STATE_NAME,
    RunLock,
    check_checkpoint_options,
    check_compatible,
    check_writable,
    latest_checkpoint,
    new_staging_token,
    objects_state,
    refuse_foreign_checkpoints,
    restore_objects,
    result_settings,
    save_staged,
    stateful_objects,
    tokenizer_fingerprint,
    verify_checkpoint_once,
    write_metadata,
)
from .pairs import load_pairs, save_pairs


_PAIRS, _REWARD_MODEL = "pairs.json", "reward_model.safetensors"
_RL_ROOT = ".rl-stage"  # where the RL stage writes its epoch checkpoints before they are wrapped


class PreferenceCheckpoints:
    """Checkpoint logic of [`MARLHFTrainer`]; it needs the trainer's `rl_trainer`, `args`, `log_history`,
    `preference_pairs`, `reward_model` and `iteration`."""

    def _configure_checkpoints(self, checkpoint_dir, interval, total_limit) -> None:
        check_checkpoint_options(interval, total_limit)
        self._checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self._checkpoint_interval = interval
        self._checkpoint_total_limit = total_limit
        self._sequence, self._assets = 0, None
        self._run_id = uuid.uuid4().hex

    def _claim_checkpoint_dir(self) -> RunLock:
        """Check that `checkpoint_dir` is writable and lock it for this run (one live run per directory)."""
        self._staging_token = new_staging_token()
        lock = RunLock()
        if self._checkpoint_dir is not None and self.rl_trainer.args.should_save:
            check_writable(self._checkpoint_dir, "checkpoint_dir")
            lock.acquire(self._checkpoint_dir)
        return lock

    def _check_foreign_checkpoints(self) -> None:
        refuse_foreign_checkpoints(self._checkpoint_dir, self._run_id)

    @property
    def _rl_root(self) -> str | None:
        return os.path.join(self._checkpoint_dir, _RL_ROOT) if self._checkpoint_dir is not None else None

    # ----- saving -----

    def _boundary(self, rl_checkpoint: str | None = None, final: bool = False) -> None:
        """A completed stage or RL epoch: save it when it is due (every `checkpoint_interval`-th, and the last)."""
        self._sequence += 1
        if self._checkpoint_dir is None:
            return
        if final or self._sequence % self._checkpoint_interval == 0:
            self._write_checkpoint(rl_checkpoint)
        elif rl_checkpoint is not None and self.rl_trainer.args.should_save:
            shutil.rmtree(rl_checkpoint, ignore_errors=True)

    def _write_checkpoint(self, rl_checkpoint: str | None) -> None:
        rl = self.rl_trainer
        final = save_staged(
            self._checkpoint_dir,
            f"checkpoint-{self._sequence}",
            self._staging_token,
            lambda staging: self._write_checkpoint_files(staging, rl_checkpoint),
            rl.accelerator,
            rl.args.should_save,
            self._checkpoint_total_limit,
            self._run_id,
        )
        self._assets = (self.iteration, os.path.join(final, "preference"))

    def _write_checkpoint_files(self, staging: str, rl_checkpoint: str | None) -> None:
        rl = self.rl_trainer
        main = rl.args.should_save
        if main:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
            if rl_checkpoint is not None:
                os.replace(rl_checkpoint, os.path.join(staging, "rl"))
            self._write_preference_assets(os.path.join(staging, "preference"))
        rl.accelerator.wait_for_everyone()
        if rl_checkpoint is None:
            actors = os.path.join(staging, "actors")
            call_save_model(rl.save_model, actors, internal_call=True)
            rl.save_team_extra_state(actors)
        rl.save_rng_state(staging)
        if main:
            torch.save(self._progress_state(), os.path.join(staging, STATE_NAME))
        rl.accelerator.wait_for_everyone()  # every process's files are in place before the manifest
        if main:
            write_metadata(staging, self._checkpoint_metadata())  # last: marks the checkpoint complete

    def _write_preference_assets(self, directory: str) -> None:
        os.makedirs(directory)
        iteration, source = self._assets or (None, None)
        if iteration == self.iteration and os.path.isdir(source):
            for name in (_PAIRS, _REWARD_MODEL):  # unchanged since the last checkpoint: link, do not copy
                try:
                    os.link(os.path.join(source, name), os.path.join(directory, name))
                except OSError:
                    shutil.copy2(os.path.join(source, name), os.path.join(directory, name))
            return
        save_pairs(os.path.join(directory, _PAIRS), self.preference_pairs)
        save_model(self.reward_model, os.path.join(directory, _REWARD_MODEL))

    def _progress_state(self) -> dict[str, Any]:
        rl = self.rl_trainer
        return {
            "iteration": self.iteration,
            "env_step": rl.env_step,
            "total_pairs": self._total_pairs,
            "log_history": self.log_history,
            "objects": objects_state(self._stateful_objects()),
        }

    def _checkpoint_metadata(self) -> dict[str, Any]:
        return {
            "version": CHECKPOINT_VERSION,
            "trainer_class": self._class_path(),
            "sequence": self._sequence,
            "run_id": self._run_id,
            "wandb": self.rl_trainer.wandb_identity(),
            "iteration": self.iteration,
            "compat": self._compatibility(),
        }

    def _class_path(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def _compatibility(self) -> dict[str, Any]:
        """What must not change between a checkpoint and the trainer resuming from it (epoch and iteration totals
        may grow)."""
        rl, args = self.rl_trainer, self.args
        return {
            "trainer_class": self._class_path(),
            "rl_trainer_class": f"{type(rl).__module__}.{type(rl).__qualname__}",
            "models": list(rl.model_fingerprints),  # taken at construction, before DeepSpeed changes tensors
            "tokenizers": [tokenizer_fingerprint(tokenizer) for tokenizer in rl.tokenizers],
            "reward_tokenizer": tokenizer_fingerprint(self.reward_tokenizer),
            "reward_peft": self.reward_peft_config is not None,
            **{
                name: getattr(args, name)
                for name in (
                    "rl_algorithm",
                    "num_generations",
                    "preference_num_candidates",
                    "preference_pairs_per_sample",
                    "pair_selection",
                    "reward_freeze_backbone",
                    "reward_max_length",
                )
            },
            **result_settings(
                args,
                extra=(
                    "reward_model_name",
                    "reward_learning_rate",
                    "reward_train_batch_size",
                    "reward_center_rewards_coefficient",
                    "reward_use_margin",
                    "use_separate_critic",
                    "rl_num_iterations",
                ),
                # MARLHFIter's num_iterations counts preference iterations (GRPO's mu is
                # rl_num_iterations there): it may grow
                exclude=("num_iterations",) if hasattr(args, "rl_num_iterations") else (),
            ),
        }

    def _stateful_objects(self) -> dict[str, Any]:
        """User objects with `state_dict`/`load_state_dict`: the task reward and its processor, the joint formatter,
        and those the RL stage trainer keeps (datasets, formatters, callbacks)."""
        candidates = {
            "reward_func": self.task_reward.reward_func,
            "reward_processor": self.task_reward.reward_processor,
            "joint_formatter": self.joint_formatter,
        }
        objects = {f"rl_stage/{name}": obj for name, obj in self.rl_trainer.stateful_objects().items()}
        return {**objects, **stateful_objects(candidates)}

    # ----- resuming -----

    def _resolve_resume(self, resume) -> str | None:
        if resume is True:
            root = self._checkpoint_dir
            resume = latest_checkpoint(root) if root is not None else None
            if resume is None:
                raise FileNotFoundError(
                    f"resume_from_checkpoint=True but checkpoint_dir={root!r} holds no complete checkpoint."
                )
        return None if resume in (None, False) else os.fspath(resume)

    def _restore(self, checkpoint: str) -> tuple[str | None, int | None]:
        """Load a checkpoint; returns the RL stage checkpoint to resume (or None) and its global step."""
        metadata = verify_checkpoint_once(checkpoint, self.rl_trainer.accelerator)
        check_compatible(metadata["compat"], self._compatibility(), checkpoint)
        state = torch.load(os.path.join(checkpoint, STATE_NAME), map_location="cpu", weights_only=True)
        if state["iteration"] >= self.num_iterations:
            raise ValueError(
                f"{checkpoint} is in iteration {state['iteration'] + 1}, but this run has "
                f"num_iterations={self.num_iterations}; num_iterations counts the whole run."
            )
        self._run_id, self._sequence = metadata["run_id"], metadata["sequence"]
        self.iteration, self._total_pairs = state["iteration"], state["total_pairs"]
        self.log_history = list(state["log_history"])
        preference = os.path.join(checkpoint, "preference")
        self.preference_pairs = load_pairs(os.path.join(preference, _PAIRS))
        model = self._new_reward_model(self.iteration)
        load_model(model, os.path.join(preference, _REWARD_MODEL))
        self._set_reward_model(model)
        self._assets = (self.iteration, preference)
        restore_objects(self._stateful_objects(), state["objects"], checkpoint)
        rl, rl_dir = self.rl_trainer, os.path.join(checkpoint, "rl")
        rl.restore_env_step(state["env_step"])
        if os.path.isdir(rl_dir):
            resume = rl_dir, TrainerState.load_from_json(os.path.join(rl_dir, TRAINER_STATE_NAME)).global_step
        else:
            rl.load_checkpoint(os.path.join(checkpoint, "actors"))
            resume = None, None
        rl.load_rng_state(checkpoint)  # last: loading the reward model seeds its head
        return resume

    def _wrap_leftover(self, resumed_step: int | None, checkpoint: str | None) -> None:
        """After the RL stage: an epoch checkpoint it wrote outside an epoch end (the run stopped early) becomes a
        boundary; one written after a resume that trained nothing is dropped, and the RNG of `checkpoint` restored."""
        rl, root = self.rl_trainer, self._rl_root
        if resumed_step is not None and rl.state.global_step == resumed_step:
            rl.load_rng_state(checkpoint)  # TRL restores it only when it trains
        elif root is not None and latest_checkpoint(root) is not None:
            self._boundary(latest_checkpoint(root), final=self.iteration + 1 == self.num_iterations)
        if root is not None and rl.args.should_save:
            shutil.rmtree(root, ignore_errors=True)


class StageCheckpointCallback(TrainerCallback):
    """Wraps every epoch checkpoint of the RL stage into a MARLHF checkpoint as soon as it is written."""

    def __init__(self, owner: PreferenceCheckpoints):
        self.owner = owner

    def on_save(self, args, state, control, **kwargs):
        owner = self.owner
        rl = owner.rl_trainer
        path = os.path.join(owner._rl_root, f"checkpoint-{rl.checkpoint_sequence}")
        if os.path.isdir(path) or not args.should_save:
            done = state.global_step >= state.max_steps
            owner._boundary(path, final=done and owner.iteration + 1 == owner.num_iterations)
        return control
