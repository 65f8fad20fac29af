"""The checkpoint system of every trainer family.

[`Checkpoints`] is the system: the checkpoint options of `train()`, one live run per checkpoint directory, the resume
checks (manifest, compatibility, other runs' checkpoints), the crash-safe writer (a staging directory renamed into
place by `checkpoint.save_staged`, with the metadata and its manifest written last, so a crash never leaves a
half-written checkpoint), the metadata, and the run's progress in `comlrl_trl_state.pt` with the stateful user objects.

[`TeamCheckpoints`] is what a team trainer (MAGRPO family, actor-critic, MADPO, the RL stage of MARLHF) writes with it:
`checkpoint-N/` holds `agent_i/` for every agent (weights or adapter, tokenizer, optimiser, scheduler, scaler),
`rng_state*.pth`, TRL's `trainer_state.json`, the team's progress (env_step, every agent's counters) and the metadata.
MARLHF's stages write theirs with the same system (`preference/marlhf_checkpoints.py`).
"""

import os
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import DistributedType
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

from ...adapters.helpers import call_save_model
from ...checkpoint import (
    CHECKPOINT_VERSION,
    STATE_NAME,
    RunLock,
    apply_ddp_timeout,
    build_manifest,
    check_checkpoint_options,
    check_compatible,
    check_world_size,
    check_writable,
    earlier_results,
    hold_output_dir,
    latest_checkpoint,
    new_staging_token,
    objects_state,
    on_every_process,
    on_main_process,
    refuse_foreign_checkpoints,
    refuse_overwriting_results,
    restore_objects,
    result_settings,
    save_staged,
    stateful_objects,
    tokenizer_fingerprint,
    verify_checkpoint,
    write_metadata,
)
from ...integrations.wandb import WandbRunCallback


logger = logging.get_logger(__name__)


def class_path(obj) -> str:
    """`module.QualifiedName` of an object's class, as checkpoints record it."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


class Checkpoints:
    """The checkpoint system of a trainer: configuration, resume checks, the writer and the run's progress.

    A trainer using it provides `args` (its `TrainingArguments`), `accelerator`, `model_fingerprints`, `tokenizers`,
    `wandb_identity()`, `stateful_objects()`, and its progress as `_team_state()` and `_restore_team_state()`.
    """

    # Subdirectories of a checkpoint that hold a checkpoint of their own, which resuming verifies when it loads it
    # (MARLHF's RL stage): the resume check leaves their files to that verification.
    nested_checkpoints: tuple[str, ...] = ()

    # ----- configuration and resume -----

    def _configure_checkpoints(self, checkpoint_dir, interval, total_limit) -> None:
        check_checkpoint_options(interval, total_limit)
        if checkpoint_dir is not None and self.args.save_strategy != "no":
            raise ValueError(
                "Pass either checkpoint_dir to train() (a checkpoint per completed epoch) or TRL's save_strategy "
                f"(here {self.args.save_strategy.value!r}), not both."
            )
        self._checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self._checkpoint_interval = interval
        self._checkpoint_total_limit = total_limit
        self._last_saved_step = None

    def _claim_checkpoint_root(self) -> RunLock:
        """Check that the checkpoint root is writable and lock it for this run (one live run per directory), after
        `output_dir` (see `_claim_output_dir`)."""
        apply_ddp_timeout(getattr(self.args, "ddp_timeout", None))  # bounds every wait for another process
        self._claim_output_dir()
        self._staging_token = new_staging_token()
        lock, root = RunLock(), self._checkpoint_root()
        if root is not None and getattr(self.args, "save_on_each_node", False):
            self._refuse_save_on_each_node_across_nodes()
        if root is not None and self.args.should_save:
            check_writable(root, "checkpoint_dir" if self._checkpoint_dir is not None else "output_dir")
            lock.acquire(root)
        return lock

    def _refuse_save_on_each_node_across_nodes(self) -> None:
        """`save_on_each_node=True` on several nodes cannot give each node a complete copy: transformers'
        `save_pretrained` writes the weights on global rank 0 only (whatever `is_main_process` says), so the other
        nodes' checkpoints would lack every agent's weights. Refused on every process (the local main processes are
        counted with one gather), before anything is written."""
        local_mains = on_every_process(
            lambda: self.accelerator.is_local_main_process, self.accelerator, "counting the nodes"
        )
        if sum(local_mains) > 1:
            raise ValueError(
                f"save_on_each_node=True on {sum(local_mains)} nodes is not supported: transformers writes the model "
                "weights (save_pretrained) on the global main process only, so the checkpoints of the other nodes "
                "would lack every agent's weights and could not be resumed. Put checkpoint_dir (or output_dir) on a "
                "filesystem that every node sees and leave save_on_each_node off: the checkpoint is then written "
                "once, and every process verifies its share of it."
            )

    def _claim_output_dir(self) -> None:
        """One live run per `output_dir`, whatever the save strategy: the main process locks it at the first `train()`
        and holds it while this trainer lives (the results are written after training); every process gets its
        verdict. The results of an earlier run found there are checked against resuming in `_prepare_resume`."""
        output_dir = self.args.output_dir

        def claim() -> list[str]:
            return earlier_results(output_dir) if hold_output_dir(output_dir, self) else []

        self._earlier_results = on_main_process(claim, self.accelerator) if output_dir else []

    def _checkpoint_root(self, trial=None) -> str | None:
        """Where this run writes its checkpoints: `checkpoint_dir`, or None (no checkpoint)."""
        return self._checkpoint_dir

    def _prepare_resume(self, resume_from_checkpoint) -> str | None:
        """Check the checkpoint against this trainer and the checkpoint root against other runs."""
        root = self._checkpoint_root()
        resume = resume_from_checkpoint
        if resume is True:  # resolved by the main process, so that every process resumes the same checkpoint
            resume = on_main_process(lambda: _latest(root or self.args.output_dir), self.accelerator)
        elif resume is False:
            resume = None
        self._resume_path = os.fspath(resume) if resume is not None else None
        if self._resume_path is not None:
            metadata = self._verify(self._resume_path)
            check_world_size(
                metadata.get("world_size"),
                self.accelerator.num_processes,
                self._resume_path,
                self.accelerator.distributed_type == DistributedType.DEEPSPEED,
            )
            check_compatible(metadata["compat"], self.compatibility(), self._resume_path)
            self._run_id, self.checkpoint_sequence = metadata["run_id"], metadata["sequence"]
        else:
            # one run id on every process (with save_on_each_node each node's saving process writes it)
            self._run_id = on_main_process(lambda: uuid.uuid4().hex, self.accelerator)
            self.checkpoint_sequence = 0
            if not getattr(self.args, "overwrite_output_dir", False):
                refuse_overwriting_results(self.args.output_dir, getattr(self, "_earlier_results", []))
        refuse_foreign_checkpoints(root, self._run_id)
        return self._resume_path

    def _verify(self, checkpoint: str) -> dict[str, Any]:
        """The checkpoint's metadata once its files are verified, every process its share (`verify_checkpoint`).

        With `save_on_each_node` each node holds the copy its own saving process wrote and hashed, which the other
        nodes may not see: the main process verifies its copy alone and every process takes its verdict.
        """
        skip = self.nested_checkpoints
        if getattr(self.args, "save_on_each_node", False):
            return on_main_process(lambda: verify_checkpoint(checkpoint, skip=skip), self.accelerator)
        return verify_checkpoint(checkpoint, self.accelerator, skip)

    def _announce_resume(self, checkpoint: str) -> None:
        """Say where the run resumed (on the main process, through transformers' logger, shown by default)."""
        if self.accelerator.is_main_process:
            logger.warning(
                "Resuming from %s at step %d (epoch %.4g of %d).",
                checkpoint,
                self.state.global_step,
                self.state.epoch or 0.0,
                self.state.num_train_epochs,
            )

    def compatibility(self) -> dict[str, Any]:
        """What must not change between a checkpoint and the trainer resuming from it; families add their settings."""
        return {
            "trainer_class": class_path(self),
            "models": list(self.model_fingerprints),  # taken at construction, before DeepSpeed changes tensors
            "tokenizers": [tokenizer_fingerprint(tokenizer) for tokenizer in self.tokenizers],
        }

    # ----- writing -----

    def _write_checkpoint(
        self, root: str, sequence: int, limit: int | None, write_files: Callable[[str], None]
    ) -> str:
        """Write `root/checkpoint-{sequence}` crash-safely; returns its path.

        `write_files(staging)` runs on every process once the staging directory exists; then the run's progress and,
        last, the metadata with the manifest of every file (which marks the checkpoint complete) are written.
        """
        should_save = self.args.should_save

        def write(staging: str) -> None:
            if should_save:
                shutil.rmtree(staging, ignore_errors=True)
                os.makedirs(staging)
            self.accelerator.wait_for_everyone()
            write_files(staging)
            if should_save:
                state = {**self._team_state(), "objects": objects_state(self.stateful_objects())}
                torch.save(state, os.path.join(staging, STATE_NAME))
            self.accelerator.wait_for_everyone()  # every process's files are in place before the manifest
            manifest = self._build_manifest(staging, should_save)
            if should_save:
                write_metadata(staging, self.checkpoint_metadata(sequence), manifest)

        name = f"{PREFIX_CHECKPOINT_DIR}-{sequence}"
        return save_staged(root, name, self._staging_token, write, self.accelerator, should_save, limit, self._run_id)

    def _build_manifest(self, staging: str, should_save: bool) -> dict[str, Any] | None:
        """The manifest of `staging`, hashed by every process, each its share of the files (`build_manifest`).

        With `save_on_each_node` every node writes its own copy, which the other nodes may not see: each saving process
        hashes its copy alone (the others return None).
        """
        if not getattr(self.args, "save_on_each_node", False):
            return build_manifest(staging, self.accelerator)
        return build_manifest(staging) if should_save else None

    def checkpoint_metadata(self, sequence: int) -> dict[str, Any]:
        """What `read_checkpoint_metadata` returns (but the manifest); families add their progress."""
        return {
            "version": CHECKPOINT_VERSION,
            "trainer_class": class_path(self),
            "sequence": sequence,
            "run_id": self._run_id,
            "world_size": self.accelerator.num_processes,  # a resume must have as many (check_world_size)
            "wandb": self.wandb_identity(),
            "compat": self.compatibility(),
        }

    # ----- loading -----

    def _load_team_state(self, checkpoint: str) -> None:
        """Restore the run's progress and the stateful user objects from `checkpoint`."""
        state = torch.load(os.path.join(checkpoint, STATE_NAME), map_location="cpu", weights_only=True)
        self._restore_team_state(state, checkpoint)
        restore_objects(self.stateful_objects(), state["objects"], checkpoint)


def _latest(root: str) -> str:
    """The latest complete checkpoint under `root`, for `resume_from_checkpoint=True`."""
    path = latest_checkpoint(root)
    if path is None:
        raise FileNotFoundError(f"resume_from_checkpoint=True but {root!r} holds no complete checkpoint.")
    return path


class TeamCheckpoints(Checkpoints):
    """The checkpoint half of [`MAGRPOTrainer`]: what a team trainer writes and loads with [`Checkpoints`].

    It needs the trainer's `agent_trainers`, `model_fingerprints`, `args`, `state`, `accelerator` and the stateful
    user objects (`reward_func`, formatters, datasets, ...).
    """

    def _checkpoint_root(self, trial=None) -> str | None:
        if self._checkpoint_dir is not None:
            return self._checkpoint_dir
        return self.checkpoint_root(trial) if self.args.save_strategy != "no" else None

    def compatibility(self) -> dict[str, Any]:
        return {
            **super().compatibility(),
            "num_agents": len(self.agent_trainers),
            "num_generations": self.args.num_generations,
            "joint_mode": self.args.joint_mode,
            "num_turns": self.args.num_turns,
            **result_settings(self.args),
        }

    # ----- saving -----

    def save_checkpoint(self, trial=None) -> None:
        """Write `checkpoint-N` for every agent into a staging directory, then rename it into place."""
        root = self._checkpoint_root(trial) or self.checkpoint_root(trial)
        sequence = self.checkpoint_sequence if self._checkpoint_dir is not None else self.state.global_step
        limit = self._checkpoint_total_limit if self._checkpoint_dir is not None else self.args.save_total_limit
        self._write_checkpoint(root, sequence, limit, self._write_checkpoint_files)
        self._last_saved_step = self.state.global_step

    def _write_checkpoint_files(self, staging: str) -> None:
        self.store_flos()
        call_save_model(self.save_model, staging, internal_call=True)
        if not self.args.save_only_model:
            for i, agent in enumerate(self.agent_trainers):  # every agent's optimiser, scheduler and scaler (fp16)
                agent.save_optimizer_state(os.path.join(staging, f"agent_{i}"))
                agent.save_scaler(os.path.join(staging, f"agent_{i}"))
            self.save_rng_state(staging)
            self.save_team_extra_state(staging)
        if self.args.should_save:
            for callback in self.callback_handler.callbacks + [self.control]:
                if isinstance(callback, ExportableState):
                    self.state.stateful_callbacks[type(callback).__name__] = callback.state()
            self.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))

    def save_team_extra_state(self, checkpoint: str) -> None:
        """Optimisation state beyond the agents' own (critics, ...); subclasses add theirs."""

    def wandb_identity(self) -> dict[str, str] | None:
        """The W&B run of this trainer (`id`, `project`), kept in checkpoints so that a resume continues it."""
        callback = next((c for c in self.callback_handler.callbacks if isinstance(c, WandbRunCallback)), None)
        return callback.identity() if callback is not None else None

    def checkpoint_metadata(self, sequence: int) -> dict[str, Any]:
        return {
            **super().checkpoint_metadata(sequence),
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
        }

    def stateful_objects(self) -> dict[str, Any]:
        """User objects that carry state across a resume: anything with `state_dict` and `load_state_dict`."""
        candidates = {
            "reward_func": self.orchestrator.joint_reward.reward_func,
            "reward_processor": self.orchestrator.joint_reward.reward_processor,
            "external_transition": self.external_transition,
            "eval_logger": self.eval_logger,
            "eval_aggregator": self.eval_aggregator,
            "metrics_callback": self.metrics_callback,
            "train_dataset": self.train_dataset,
            "eval_dataset": self.eval_dataset,
        }
        candidates.update({f"formatter_{i}": f for i, f in enumerate(self.formatters)})
        candidates.update({f"callback_{type(c).__name__}": c for c in self.callback_handler.callbacks})
        return stateful_objects(candidates)

    def _team_state(self) -> dict[str, Any]:
        return {
            "env_step": self.env_step,
            "epoch_items": self._epoch_items,
            "last_logged_env_step": self._last_logged_env_step,
            "agents": [{"num_input_tokens_seen": agent.state.num_input_tokens_seen} for agent in self.agent_trainers],
        }

    # ----- loading -----

    def load_agent_weights(self, checkpoint: str) -> None:
        """Every agent's weights (full or adapter) from `checkpoint/agent_i` (not under DeepSpeed, whose engines load
        their own when prepared)."""
        for i, agent in enumerate(self.agent_trainers):
            agent.load_weights(os.path.join(checkpoint, f"agent_{i}"))

    def load_team_extra_state(self, checkpoint: str) -> None:
        """Restore state beyond the agents' own (critics, value heads, ...); subclasses add theirs."""

    def _restore_team_state(self, state: dict[str, Any], checkpoint: str) -> None:
        self.env_step = state["env_step"]
        self._epoch_items = state["epoch_items"]
        self._last_logged_env_step = state["last_logged_env_step"]
        self._last_logged_global_step = self.state.global_step
        # Checkpoints written before the agents were equal kept agent 0's counter in trainer_state.json.
        agents = state.get("agents") or [
            {"num_input_tokens_seen": self.state.num_input_tokens_seen},
            *state["followers"],
        ]
        for agent, saved in zip(self.agent_trainers, agents):
            agent.state.num_input_tokens_seen = saved["num_input_tokens_seen"]
