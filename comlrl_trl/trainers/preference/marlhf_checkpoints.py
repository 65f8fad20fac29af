"""MARLHF's stages on the team's checkpoint system ([`Checkpoints`]).

A boundary is reached after every preference stage (pairs collected, reward model trained) and after every RL
epoch; the `checkpoint_interval`-th boundaries are saved, and the last one of the run always is. The team's writer,
resume checks, metadata and progress file are used as they are; a MARLHF checkpoint `checkpoint-N/` holds:

- `preference/pairs.json` and `preference/reward_model.safetensors`: the iteration's pairs and trained reward model
  (hard links to the previous checkpoint's files when they are the same);
- the stage it closes: `rl/`, the RL stage trainer's own team checkpoint, after an RL epoch; `actors/` (the agents,
  and critics, as `save_model` writes them) after a preference stage;
- `rng_state.pth`, `comlrl_trl_state.pt` (iteration, env_step, log history, stateful user objects) and the metadata
  `comlrl_trl_checkpoint.json`, written last.

Resuming repeats the work since the checkpoint and gives the same result as an uninterrupted run.
"""

import os
import shutil
from typing import Any

from safetensors.torch import load_model, save_model
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import TrainerCallback, TrainerState

from ...adapters.helpers import call_save_model
from ...checkpoint import (
    latest_checkpoint,
    on_main_process,
    result_settings,
    stateful_objects,
    tokenizer_fingerprint,
)
from ..team.checkpoints import Checkpoints, class_path
from .pairs import load_pairs, save_pairs


_PAIRS, _REWARD_MODEL = "pairs.json", "reward_model.safetensors"
_RL_ROOT = ".rl-stage"  # where the RL stage writes its epoch checkpoints before they are wrapped
_RL = "rl"  # where a MARLHF checkpoint holds the RL stage's epoch checkpoint

# MARLHF settings a resume must keep, beyond the team's result settings (`checkpoint.RESULT_SETTINGS`, which has the
# pair settings already).
_RESULT_SETTINGS = (
    "rl_algorithm",
    "reward_model_name",
    "reward_learning_rate",
    "reward_train_batch_size",
    "reward_max_length",
    "reward_freeze_backbone",
    "reward_center_rewards_coefficient",
    "reward_use_margin",
    "use_separate_critic",
    "rl_num_iterations",
)


class MARLHFCheckpoints(Checkpoints):
    """What [`MARLHFTrainer`] adds to the team's checkpoint system: its stages, preference data and settings.

    It needs the trainer's `rl_trainer` (the team trainer of the RL stage: accelerator, agents, W&B run), `args`,
    `log_history`, `preference_pairs`, `reward_model` and `iteration`.
    """

    nested_checkpoints = (_RL,)  # the RL stage's epoch checkpoint, verified when the RL stage resumes it

    # ----- the team's system, with MARLHF's progress and settings -----

    @property
    def accelerator(self):
        return self.rl_trainer.accelerator

    @property
    def model_fingerprints(self) -> list[str]:
        return self.rl_trainer.model_fingerprints

    def wandb_identity(self) -> dict[str, str] | None:
        return self.rl_trainer.wandb_identity()

    def compatibility(self) -> dict[str, Any]:
        """The team's identity fields and result settings, the RL stage's class and MARLHF's own settings (epoch and
        iteration totals may grow)."""
        args = self.args
        return {
            **super().compatibility(),
            "rl_trainer_class": class_path(self.rl_trainer),
            "reward_tokenizer": tokenizer_fingerprint(self.reward_tokenizer),
            "reward_peft": self.reward_peft_config is not None,
            # MARLHFIter's num_iterations counts preference iterations (GRPO's mu is rl_num_iterations there): it may
            # grow
            **result_settings(
                args,
                extra=_RESULT_SETTINGS,
                exclude=("num_iterations",) if hasattr(args, "rl_num_iterations") else (),
            ),
        }

    def checkpoint_metadata(self, sequence: int) -> dict[str, Any]:
        return {**super().checkpoint_metadata(sequence), "iteration": self.iteration}

    def stateful_objects(self) -> dict[str, Any]:
        """User objects with `state_dict`/`load_state_dict`: the task reward and its processor, the joint formatter,
        and those the RL stage trainer keeps (datasets, formatters, callbacks)."""
        candidates = {
            "reward_func": self.task_reward.reward_func,
            "reward_processor": self.task_reward.reward_processor,
            "joint_formatter": self.joint_formatter,
        }
        objects = {f"rl_stage/{name}": obj for name, obj in self.rl_trainer.stateful_objects().items()}
        return {**objects, **stateful_objects(candidates)}

    def _team_state(self) -> dict[str, Any]:
        return {
            "iteration": self.iteration,
            "env_step": self.rl_trainer.env_step,
            "total_pairs": self._total_pairs,
            "log_history": self.log_history,
        }

    def _restore_team_state(self, state: dict[str, Any], checkpoint: str) -> None:
        if state["iteration"] >= self.num_iterations:
            raise ValueError(
                f"{checkpoint} is in iteration {state['iteration'] + 1}, but this run has "
                f"num_iterations={self.num_iterations}; num_iterations counts the whole run."
            )
        self.iteration, self._total_pairs = state["iteration"], state["total_pairs"]
        self.log_history = list(state["log_history"])
        self.rl_trainer.restore_env_step(state["env_step"])

    # ----- the stages -----

    @property
    def _rl_root(self) -> str | None:
        return os.path.join(self._checkpoint_dir, _RL_ROOT) if self._checkpoint_dir is not None else None

    def _boundary(self, rl_checkpoint: str | None = None, final: bool = False) -> None:
        """A completed stage or RL epoch: save it when it is due (every `checkpoint_interval`-th, and the last)."""
        self.checkpoint_sequence += 1
        if self._checkpoint_dir is None:
            return
        if final or self.checkpoint_sequence % self._checkpoint_interval == 0:
            final_path = self._write_checkpoint(
                self._checkpoint_dir,
                self.checkpoint_sequence,
                self._checkpoint_total_limit,
                lambda staging: self._write_stage_files(staging, rl_checkpoint),
            )
            self._assets = (self.iteration, os.path.join(final_path, "preference"))
        elif rl_checkpoint is not None and self.args.should_save:
            shutil.rmtree(rl_checkpoint, ignore_errors=True)

    def _write_stage_files(self, staging: str, rl_checkpoint: str | None) -> None:
        """The preference assets and the stage: the RL stage's epoch checkpoint (moved in) or the agents."""
        rl = self.rl_trainer
        if self.args.should_save:
            if rl_checkpoint is not None:
                os.replace(rl_checkpoint, os.path.join(staging, _RL))
            self._write_preference_assets(os.path.join(staging, "preference"))
        if rl_checkpoint is None:
            actors = os.path.join(staging, "actors")
            call_save_model(rl.save_model, actors, internal_call=True)
            rl.save_team_extra_state(actors)
        rl.save_rng_state(staging)

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

    def _load_stage(self, checkpoint: str) -> tuple[str | None, int | None]:
        """Load a checkpoint that `_prepare_resume` accepted; returns the RL stage checkpoint to resume (or None) and
        its global step."""
        self._load_team_state(checkpoint)
        preference = os.path.join(checkpoint, "preference")
        self.preference_pairs = load_pairs(os.path.join(preference, _PAIRS))
        self._release_reward_model()
        model = self._new_reward_model(self.iteration)
        load_model(model, os.path.join(preference, _REWARD_MODEL))
        self._set_reward_model(model)
        self._assets = (self.iteration, preference)
        rl, rl_dir = self.rl_trainer, os.path.join(checkpoint, _RL)
        if os.path.isdir(rl_dir):
            resume = rl_dir, TrainerState.load_from_json(os.path.join(rl_dir, TRAINER_STATE_NAME)).global_step
        else:
            rl.load_agent_weights(os.path.join(checkpoint, "actors"))
            rl.load_team_extra_state(os.path.join(checkpoint, "actors"))
            resume = None, None
        rl.load_rng_state(checkpoint)  # last: loading the reward model seeds its head
        return resume

    def _wrap_leftover(self, resumed_step: int | None, checkpoint: str | None) -> None:
        """After the RL stage: an epoch checkpoint it wrote outside an epoch end (the run stopped early) becomes a
        boundary; one written after a resume that trained nothing is dropped, and the RNG of `checkpoint` restored."""
        rl, root = self.rl_trainer, self._rl_root
        if resumed_step is not None and rl.state.global_step == resumed_step:
            rl.load_rng_state(checkpoint)  # TRL restores it only when it trains
        elif root is not None and (leftover := on_main_process(lambda: latest_checkpoint(root), rl.accelerator)):
            self._boundary(leftover, final=self.iteration + 1 == self.num_iterations)  # the same on every process
        if root is not None and self.args.should_save:
            shutil.rmtree(root, ignore_errors=True)


class StageCheckpointCallback(TrainerCallback):
    """Wraps every epoch checkpoint of the RL stage into a MARLHF checkpoint as soon as it is written."""

    def __init__(self, owner: MARLHFCheckpoints):
        self.owner = owner

    def on_save(self, args, state, control, **kwargs):
        owner = self.owner
        rl = owner.rl_trainer
        path = os.path.join(owner._rl_root, f"checkpoint-{rl.checkpoint_sequence}")
        if os.path.isdir(path) or not args.should_save:
            done = state.global_step >= state.max_steps
            owner._boundary(path, final=done and owner.iteration + 1 == owner.num_iterations)
        return control
