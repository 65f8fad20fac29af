"""MAGRPO: multi-agent group relative policy optimisation on TRL, and its REINFORCE variants.

Shape: `MAGRPOTrainer` is agent 0's TRL `GRPOTrainer` and owns the one real `Trainer.train()` loop, so TRL and
transformers callbacks, `report_to`, LR schedules and Accelerate preparation work unchanged. Agents 1..N-1 are
`FollowerGRPOTrainer`s, each with its own model (optionally LoRA), optimiser, scheduler and Accelerator, driven
from this loop. A `JointRolloutOrchestrator` generates for all agents, calls the joint reward and hands every
agent its scored batch; TRL's loss then runs once per agent per micro-step.
"""

import contextlib
import copy
import gc
import itertools
import math
import os
import shutil
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate.utils import gather_object, is_peft_model
from datasets import Dataset, IterableDataset
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback
from transformers.integrations import WandbCallback
from transformers.integrations.deepspeed import deepspeed_load_checkpoint
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState, ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from ...agent_overrides import agent_config
from ...batching import even_shard
from ...checkpoint import (
    CHECKPOINT_VERSION,
    STATE_NAME,
    RunLock,
    check_checkpoint_options,
    check_compatible,
    check_writable,
    latest_checkpoint,
    model_fingerprint,
    new_staging_token,
    refuse_foreign_checkpoints,
    result_settings,
    save_staged,
    tokenizer_fingerprint,
    verify_checkpoint,
    write_metadata,
)
from ...formatters import build_formatters
from ...inputs import check_datasets, fill_small_training_set
from ...integrations.progress import TeamProgressCallback
from ...integrations.wandb import WandbRunCallback, validate_wandb_config, verbose_from_wandb_config
from ...joint_reward import JointReward
from ...loading import load_saved_adapter
from ...orchestrator import JointRolloutOrchestrator
from ...value_models import low_precision_trainable
from ..agent import AgentGRPOTrainer, FollowerGRPOTrainer, joint_reward
from .magrpo_config import MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig


class MAGRPOTrainer(AgentGRPOTrainer):
    """
    Trainer for cooperative LLM agents with one joint reward ([MAGRPO](https://huggingface.co/papers/2508.04652)).

    Every training step samples K completions per agent per task item (one batched `generate` per agent), scores
    the joint actions with `reward_func`, gives every completion a group-relative advantage per agent and updates
    every agent with TRL's GRPO loss.

    Args:
        agent_model (`str`, *optional*):
            Model id or local path shared by all agents (homogeneous team): each agent gets its own copy.
        agents (`list`, *optional*):
            One entry per agent, in actor order: model ids, local paths (a saved `agent_i` directory, with a LoRA
            adapter or full weights) or `PreTrainedModel` objects. If `agent_model` is also given, every entry
            must name the same model.
        num_agents (`int`, *optional*):
            Number of agents. Defaults to `len(agents)`, else `args.num_agents`; all given values must agree.
        tokenizer (`PreTrainedTokenizerBase` or `list`, *optional*):
            One tokenizer for all agents or one per agent. Required when agents are model objects; otherwise each
            agent's tokenizer is loaded from its path.
        formatters (`Callable` or `list[Callable]`, *optional*):
            Task item -> prompt (a string or chat messages), one for all agents or one per agent. Defaults to
            reading the item's `prompt` field.
        reward_func (`Callable`):
            `reward_func(agent_0_completions, ..., agent_{N-1}_completions[, batch_items=[item]])` returns one
            reward per joint action. It is called once per task item; position j of every list is joint action j.
        reward_processor (`Callable[[float], float]`, *optional*):
            Applied to every reward, e.g. `RewardProcessors.scale(10.0)`. Defaults to the identity.
        train_dataset, eval_dataset (`Dataset` or `IterableDataset`, *optional*):
            Task items (dict rows). Training keeps their order unless `args.shuffle_dataset=True`. Without a
            `train_dataset` the trainer can only `evaluate()` (e.g. saved agents); `train()` then raises.
        args ([`MAGRPOConfig`], *optional*):
            Configuration; defaults to the trainer's config class with `num_agents` set.
        external_transition (`Callable`, *optional*):
            Needed for `num_turns > 1`. Called once per joint action to expand, with keywords `prompt` (the
            item's prompt), `agent_completions` (one string per agent), `num_agents`,
            `prompt_history_per_agent`, `response_history_per_agent` (this branch, including the turn that just
            ended) and, if it accepts it, `batch_item`; returns one next-turn prompt (string) per agent.
        wandb_config (`dict`, *optional*):
            W&B run settings (`project`, `entity`, `name`/`run_name`, `tags`, `dir`, `config_sections`, ...).
            `None` disables W&B.
        eval_logger, eval_aggregator (`Callable`, *optional*):
            Custom evaluation metrics; given together. The logger gets `agent_completions_turns`
            (`[agent][item][turn]`), `batch_items` and raw `prompts` and returns one dict per item; the
            aggregator reduces those rows (with `num_turns`) to scalars, logged with the `eval/` prefix.
        peft_config (`PeftConfig` or `list`, *optional*):
            LoRA (or other PEFT) configuration for every agent, or one per agent (`None` entries train fully).
        callbacks (`list[TrainerCallback]`, *optional*):
            TRL/transformers callbacks; they see the team loop's state.

    Example:

    ```python
    >>> trainer = MAGRPOTrainer(agent_model="path/to/model", num_agents=2, reward_func=reward_func,
    ...                         train_dataset=dataset, args=MAGRPOConfig(num_agents=2))
    >>> trainer.train()
    ```
    """

    default_config_cls = MAGRPOConfig
    follower_cls = FollowerGRPOTrainer
    algorithm_name = "MAGRPO"
    _tag_names = ["trl", "grpo", "comlrl_trl", "magrpo"]

    def __init__(
        self,
        agent_model: str | PreTrainedModel | None = None,
        agents: Sequence[str | PreTrainedModel] | None = None,
        num_agents: int | None = None,
        tokenizer: PreTrainedTokenizerBase | Sequence[PreTrainedTokenizerBase] | None = None,
        formatters: Callable | Sequence[Callable] | None = None,
        reward_func: Callable | None = None,
        reward_processor: Callable[[float], float] | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | None = None,
        args: MAGRPOConfig | None = None,
        external_transition: Callable | None = None,
        wandb_config: dict[str, Any] | None = None,
        eval_logger: Callable | None = None,
        eval_aggregator: Callable | None = None,
        peft_config: Any = None,
        callbacks: list[TrainerCallback] | None = None,
    ):
        if args is not None and not isinstance(args, MAGRPOConfig):
            raise TypeError(f"args must be a MAGRPOConfig (or a subclass), got {type(args).__name__}.")
        sources = _resolve_agent_sources(agent_model, agents, num_agents, args)
        n = len(sources)
        if args is None:
            args = self.default_config_cls(num_agents=n)
        if args.num_agents != n:
            raise ValueError(
                f"{n} agents were given but args.num_agents={args.num_agents}; set {type(args).__name__}"
                f"(num_agents={n}) or pass the matching number of agents."
            )
        _validate_trainer_inputs(args, reward_func, external_transition, eval_logger, eval_aggregator, train_dataset)
        check_datasets(train_dataset, eval_dataset, default_formatters=formatters is None)
        validate_wandb_config(wandb_config)
        tokenizers = _resolve_tokenizers(tokenizer, sources)
        peft_configs = _per_agent(peft_config, n, "peft_config")
        formatter_list = build_formatters(formatters, n)
        joint = JointReward(reward_func, reward_processor)
        models = [_saved_adapter_or(source) for source in sources]
        args.fit_precision_to_models(models)
        if isinstance(train_dataset, Dataset):
            args.fit_batch_to_dataset(len(train_dataset), evaluates=eval_dataset is not None)
        # Every agent's args are copied before any trainer exists: creating TrainingArguments later would reset
        # the Accelerate state the live trainers share. `args.agent_overrides` gives an agent its own values.
        follower_args = [_follower_args(args, i) for i in range(1, n)]
        # Without a train_dataset the trainer can only evaluate: TRL's trainers get a one-row stand-in, dropped below.
        trl_dataset = train_dataset if train_dataset is not None else Dataset.from_dict({"prompt": [""]})

        super().__init__(
            model=models[0],
            reward_funcs=[joint_reward],
            args=agent_config(args, 0),
            train_dataset=trl_dataset,
            processing_class=tokenizers[0],
            callbacks=callbacks,
            peft_config=peft_configs[0],
        )
        followers = [
            self.follower_cls(model=models[i], reward_funcs=[joint_reward], args=follower_args[i - 1],
                                train_dataset=trl_dataset, processing_class=tokenizers[i],
                                peft_config=peft_configs[i])
            for i in range(1, n)
        ]
        for agent in [self, *followers]:
            agent.train_dataset = train_dataset
        self._team = [self, *followers]
        for index, agent in enumerate(self._team):
            agent.agent_index = index
        _warn_low_precision_weights(self._team, self.is_deepspeed_enabled)
        # Fingerprinted now, before training: DeepSpeed later casts weights (bf16) and ZeRO-3 empties partitioned
        # tensors, which would make a valid checkpoint look foreign on resume.
        self._model_fingerprints = [model_fingerprint(agent.model) for agent in self._team]
        self._share_frozen_base_weights()
        self.formatters = formatter_list
        self.eval_dataset = eval_dataset
        self.eval_logger = eval_logger
        self.eval_aggregator = eval_aggregator
        self.external_transition = external_transition
        self.wandb_config = wandb_config
        self.orchestrator = self._build_orchestrator(formatter_list, joint, external_transition)
        if args.early_termination_threshold is not None and self.accelerator.num_processes > 1:
            raise ValueError(
                "early_termination_threshold makes the rollout tree differ between processes, which data-parallel "
                "training cannot synchronise; leave it None when training on several processes."
            )
        self.env_step = 0
        self._epoch_items = 0  # training task items seen in this epoch (all processes), for eval_interval
        self._joint_metrics = defaultdict(list)
        self._last_logged_env_step = 0
        self._last_logged_global_step = 0
        self._configure_checkpoints(None, 1, None)
        self._resume_path = None
        self._run_id = None
        self._follower_loss = [0.0] * (n - 1)
        self._follower_grad_norms = [[] for _ in range(n - 1)]
        self._setup_callbacks(wandb_config)
        self._stateful_objects()  # a user object with only one of state_dict/load_state_dict is an error now

    def _build_orchestrator(self, formatters, joint: JointReward, external_transition) -> JointRolloutOrchestrator:
        return JointRolloutOrchestrator(self._team, formatters, joint, self.args, external_transition)

    # ----- the team -----

    @property
    def agents(self) -> list[PreTrainedModel]:
        """The agents' models, in actor order (PEFT models when training adapters)."""
        return [agent.model for agent in self._team]

    @property
    def tokenizers(self) -> list[PreTrainedTokenizerBase]:
        """The agents' tokenizers, in actor order."""
        return [agent.processing_class for agent in self._team]

    def _share_frozen_base_weights(self) -> None:
        """LoRA agents on the same base model keep one copy of its frozen weights instead of N.

        The base weights of a PEFT model never change (only adapters train, and the reference is the base with
        the adapter disabled), so agents whose frozen parameters are equal can point at the same tensors. Skipped
        under DeepSpeed and FSDP, which own parameter storage.
        """
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or not is_peft_model(self.model):
            return
        shared = {name: p for name, p in self.model.named_parameters() if not p.requires_grad}
        for follower in self._team[1:]:
            if not is_peft_model(follower.model):
                continue
            for name, p in follower.model.named_parameters():
                base = shared.get(name)
                if (not p.requires_grad and base is not None and base.shape == p.shape and base.dtype == p.dtype
                        and base.device == p.device and torch.equal(base, p)):
                    p.data = base.data

    def _setup_callbacks(self, wandb_config):
        self.add_callback(_TeamCallback(self))
        if wandb_config is not None:
            self.remove_callback(WandbCallback)  # one W&B writer: ours logs the spec's keys against env_step
            self.add_callback(WandbRunCallback(wandb_config, self._run_config()))
        if self.pop_callback(ProgressCallback) is not None and verbose_from_wandb_config(wandb_config):
            self.add_callback(TeamProgressCallback())  # a bar with the joint reward instead of every key

    def _run_config(self) -> dict[str, Any]:
        args = self.args
        return {
            "algorithm": self.algorithm_name,
            "model_names": [agent.model.config._name_or_path for agent in self._team],
            **{key: getattr(args, key) for key in (
                "num_agents", "num_turns", "num_generations", "joint_mode", "advantage_mode",
                "advantage_normalization", "learning_rate", "num_train_epochs", "max_completion_length",
                "temperature", "top_p", "top_k", "beta", "loss_type", "seed", "agent_overrides")},
        }

    # ----- training -----

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_interval: int = 1,
        checkpoint_total_limit: int | None = None,
        trial=None,
        ignore_keys_for_eval=None,
        **kwargs,
    ):
        """Train every agent for `args.num_train_epochs` epochs (the whole run, including resumed work).

        Args:
            resume_from_checkpoint (`str` or `bool`, *optional*):
                A `checkpoint-N` directory to resume from (`True`: the latest one in `checkpoint_dir`, else in
                `args.output_dir`). The trainer must be compatible: same class, agents, model shapes, tokenizers,
                `num_generations`, `joint_mode` and `num_turns`; `num_train_epochs` may be larger.
            checkpoint_dir (`str`, *optional*):
                Save a checkpoint into `checkpoint_dir/checkpoint-{epochs completed}` at every
                `checkpoint_interval`-th completed epoch and at the end. Without it (and with
                `args.save_strategy="no"`), no checkpoint is written. TRL's `save_strategy`/`save_steps` also
                work and save into `args.output_dir/checkpoint-{global step}`.
            checkpoint_total_limit (`int`, *optional*):
                Keep only this many of this run's newest checkpoints in `checkpoint_dir`.
        """
        if self.train_dataset is None:
            raise ValueError(f"This {type(self).__name__} was built without a train_dataset, so it can only evaluate(); "
                             "pass train_dataset=... when building it to train.")
        self._configure_checkpoints(checkpoint_dir, checkpoint_interval, checkpoint_total_limit)
        lock = self._claim_checkpoint_root()
        try:
            resume = self._prepare_resume(resume_from_checkpoint)
            with _long_lived_objects_frozen():
                output = super().train(resume_from_checkpoint=resume, trial=trial,
                                       ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            if self._checkpoint_dir is not None and self._last_saved_step != self.state.global_step:
                self._checkpoint_sequence += 1  # a final save after a run that stopped between epoch boundaries
                self._save_checkpoint(self.model_wrapped, trial)
        finally:
            lock.release()
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, TeamProgressCallback):
                    callback.close()
        return output

    def _claim_checkpoint_root(self) -> RunLock:
        """Check that the checkpoint root is writable and lock it for this run (one live run per directory)."""
        self._staging_token = new_staging_token()
        lock, root = RunLock(), self._checkpoint_root()
        if root is not None and self.args.should_save:
            check_writable(root, "checkpoint_dir" if self._checkpoint_dir is not None else "output_dir")
            lock.acquire(root)
        return lock

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

    def _checkpoint_root(self, trial=None) -> str | None:
        if self._checkpoint_dir is not None:
            return self._checkpoint_dir
        return self._get_output_dir(trial=trial) if self.args.save_strategy != "no" else None

    def _prepare_resume(self, resume_from_checkpoint) -> str | None:
        """Check the checkpoint against this trainer and the checkpoint root against other runs."""
        root = self._checkpoint_root()
        resume = resume_from_checkpoint
        if resume is True:
            resume = latest_checkpoint(root or self.args.output_dir)
            if resume is None:
                raise FileNotFoundError(f"resume_from_checkpoint=True but {root or self.args.output_dir!r} holds "
                                        "no complete checkpoint.")
        elif resume is False:
            resume = None
        self._resume_path = os.fspath(resume) if resume is not None else None
        if self._resume_path is not None:
            metadata = verify_checkpoint(self._resume_path)
            check_compatible(metadata["compat"], self._compatibility(), self._resume_path)
            self._run_id, self._checkpoint_sequence = metadata["run_id"], metadata["sequence"]
        else:
            self._run_id, self._checkpoint_sequence = uuid.uuid4().hex, 0
        refuse_foreign_checkpoints(root, self._run_id)
        return self._resume_path

    def _get_train_sampler(self, dataset=None):
        return fill_small_training_set(super()._get_train_sampler(dataset))

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """The team rollout. Returns agent 0's scored batch; the other agents' batches are buffered on them."""
        items = len(inputs) // self.args.num_generations * self.accelerator.num_processes
        self._maybe_evaluate(first_item=self._epoch_items, num_items=items)
        rollout = self.orchestrator.rollout(inputs, first_item_index=self._epoch_items)
        self._epoch_items += items
        for follower, batch in zip(self._team[1:], rollout.agent_batches[1:]):
            follower._buffered_inputs = split_tensor_dict(shuffle_sequence_dict(batch), self.args.steps_per_generation)
        self.env_step += rollout.env_steps
        for turn, (rewards, returns) in enumerate(zip(rollout.turn_rewards, rollout.turn_returns), start=1):
            self._joint_metrics[f"turn_{turn}/reward_mean"].extend(self._gather_lists(rewards))
            self._joint_metrics[f"turn_{turn}/expected_return"].extend(self._gather_lists(returns))
        for turn, kl in enumerate(rollout.turn_reference_kl, start=1):
            self._joint_metrics[f"turn_{turn}/reference_kl_mean"].append(kl)
            self._joint_metrics[f"turn_{turn}/reference_kl_penalty_mean"].append(self.beta * kl)
        return rollout.agent_batches[0]

    def _gather_lists(self, values: list) -> list:
        """Concatenate a list from every process, in process order.

        Plain `gather_object`, not `gather_for_metrics`: the latter trims to the remainder of whichever data
        loader is at its end (the training loader, during a rollout), which would drop real values here.
        """
        return gather_object(list(values))

    def training_step(self, model, inputs, num_items_in_batch=None):
        slot = self._step % self.args.steps_per_generation  # the buffered micro-batch every agent trains on now
        loss = super().training_step(model, inputs, num_items_in_batch)
        _check_finite_loss(loss, 0, self.state.global_step)
        for i, follower in enumerate(self._team[1:], start=1):
            follower.current_gradient_accumulation_steps = self.current_gradient_accumulation_steps
            sync = self.accelerator.sync_gradients
            context = contextlib.nullcontext() if sync else follower.accelerator.no_sync(follower.model_wrapped)
            with context:
                follower_loss = follower.training_step(follower.model_wrapped, follower._buffered_inputs[slot], None)
            _check_finite_loss(follower_loss, i, self.state.global_step)
            self._follower_loss[i - 1] += follower_loss.item()
        return loss

    def _prepare_followers(self):
        """Give every other agent its optimizer and scheduler (restored when resuming) and the team state."""
        resume = self._resume_path
        for i, follower in enumerate(self._team[1:], start=1):
            follower.model.train()
            follower.state.max_steps = self.state.max_steps
            agent_resume = os.path.join(resume, f"agent_{i}") if resume is not None else None
            follower._prepare_for_training(self.state.max_steps, None, agent_resume)
        if resume is not None:
            self._load_team_state(resume)

    def _step_followers(self):
        for i, follower in enumerate(self._team[1:]):
            if self.args.max_grad_norm > 0:
                grad_norm = follower._clip_grad_norm(follower.model_wrapped)
                if grad_norm is not None:  # DeepSpeed reports None when its engine computed no norm
                    self._follower_grad_norms[i].append(float(grad_norm))
            follower.optimizer.step()
            if not follower.accelerator.optimizer_step_was_skipped:
                follower.lr_scheduler.step()
            follower.model_wrapped.zero_grad()
            follower.state.global_step = self.state.global_step + 1
            follower.state.epoch = self.state.epoch

    # ----- logging -----

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and "train_runtime" not in logs:
            logs = self._team_training_logs(logs)
        Trainer.log(self, logs, start_time)

    def _team_training_logs(self, logs: dict[str, float]) -> dict[str, float]:
        steps = max(self.state.global_step - self._last_logged_global_step, 1)
        out = {"env_step": self.env_step}
        agent_losses = [logs.pop("loss")]
        for i, total in enumerate(self._follower_loss):
            mean = self.accelerator.gather(torch.tensor(total / steps, device=self.accelerator.device)).mean().item()
            agent_losses.append(mean)
            self._follower_loss[i] = 0.0
        out["loss"] = sum(agent_losses)  # the team objective: the sum of the agents' losses
        for i, agent_loss in enumerate(agent_losses):
            out[f"agent_{i}/loss"] = agent_loss
        if "grad_norm" in logs:
            out["agent_0/grad_norm"] = logs.pop("grad_norm")
        for i, norms in enumerate(self._follower_grad_norms, start=1):
            if norms:
                out[f"agent_{i}/grad_norm"] = sum(norms) / len(norms)
                norms.clear()
        out.update(logs)
        for i, agent in enumerate(self._team):
            for key, values in agent._metrics["train"].items():
                valid = [v for v in values if not math.isnan(v)]
                if valid:
                    out[f"agent_{i}/{key}"] = sum(valid) / len(valid)
            agent._metrics["train"].clear()
        for key, values in self._joint_metrics.items():
            if values:
                out[key] = sum(values) / len(values)
        self._joint_metrics.clear()
        self._last_logged_env_step = self.env_step
        self._last_logged_global_step = self.state.global_step
        return out

    # ----- checkpoints -----

    def _compatibility(self) -> dict[str, Any]:
        """What must not change between a checkpoint and the trainer resuming from it."""
        return {
            "trainer_class": f"{type(self).__module__}.{type(self).__qualname__}",
            "num_agents": len(self._team),
            "models": self._model_fingerprints,
            "tokenizers": [tokenizer_fingerprint(agent.processing_class) for agent in self._team],
            "num_generations": self.args.num_generations,
            "joint_mode": self.args.joint_mode,
            "num_turns": self.args.num_turns,
            **result_settings(self.args),
        }

    def _save_checkpoint(self, model, trial) -> None:
        """Write `checkpoint-N` for every agent into a staging directory, then rename it into place."""
        root = self._checkpoint_root(trial) or self._get_output_dir(trial=trial)
        sequence = self._checkpoint_sequence if self._checkpoint_dir is not None else self.state.global_step
        limit = self._checkpoint_total_limit if self._checkpoint_dir is not None else self.args.save_total_limit
        save_staged(root, f"{PREFIX_CHECKPOINT_DIR}-{sequence}", self._staging_token,
                    lambda staging: self._write_checkpoint_files(staging, sequence), self.accelerator,
                    self.args.should_save, limit, self._run_id)
        self._last_saved_step = self.state.global_step

    def _write_checkpoint_files(self, staging: str, sequence: int) -> None:
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        self.accelerator.wait_for_everyone()
        self.store_flos()
        self.save_model(staging, _internal_call=True)
        if not self.args.save_only_model:
            for i, agent in enumerate(self._team):
                Trainer._save_optimizer_and_scheduler(agent, os.path.join(staging, f"agent_{i}"))
            self._save_scaler(staging)
            self._save_rng_state(staging)
            self._save_extra_state(staging)
        if self.args.should_save:
            torch.save(self._team_state(), os.path.join(staging, STATE_NAME))
            for callback in self.callback_handler.callbacks + [self.control]:
                if isinstance(callback, ExportableState):
                    self.state.stateful_callbacks[type(callback).__name__] = callback.state()
            self.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
        self.accelerator.wait_for_everyone()  # every process's files are in place before the manifest
        if self.args.should_save:
            write_metadata(staging, self._checkpoint_metadata(sequence))  # last: marks the checkpoint complete

    def _save_extra_state(self, checkpoint: str) -> None:
        """Optimisation state beyond the agents' own (critics, ...); subclasses add theirs."""

    def _checkpoint_metadata(self, sequence: int) -> dict[str, Any]:
        wandb_callback = next((c for c in self.callback_handler.callbacks if isinstance(c, WandbRunCallback)), None)
        return {
            "version": CHECKPOINT_VERSION,
            "trainer_class": f"{type(self).__module__}.{type(self).__qualname__}",
            "sequence": sequence,
            "run_id": self._run_id,
            "wandb": wandb_callback.identity() if wandb_callback is not None else None,
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "compat": self._compatibility(),
        }

    def _stateful_objects(self) -> dict[str, Any]:
        """User objects that carry state across a resume: anything with `state_dict` and `load_state_dict`."""
        candidates = {"reward_func": self.orchestrator.joint_reward.reward_func,
                      "reward_processor": self.orchestrator.joint_reward.reward_processor,
                      "external_transition": self.external_transition, "eval_logger": self.eval_logger,
                      "eval_aggregator": self.eval_aggregator, "train_dataset": self.train_dataset,
                      "eval_dataset": self.eval_dataset}
        candidates.update({f"formatter_{i}": f for i, f in enumerate(self.formatters)})
        candidates.update({f"callback_{type(c).__name__}": c for c in self.callback_handler.callbacks})
        return {name: obj for name, obj in candidates.items() if _is_stateful(obj, name)}

    def _team_state(self) -> dict[str, Any]:
        return {
            "env_step": self.env_step,
            "epoch_items": self._epoch_items,
            "last_logged_env_step": self._last_logged_env_step,
            "followers": [{"global_step": f.state.global_step, "num_input_tokens_seen": f.state.num_input_tokens_seen}
                          for f in self._team[1:]],
            "objects": {name: obj.state_dict() for name, obj in self._stateful_objects().items()},
        }

    def _load_team_state(self, checkpoint: str) -> None:
        state = torch.load(os.path.join(checkpoint, STATE_NAME), map_location="cpu", weights_only=True)
        self.env_step = state["env_step"]
        self._epoch_items = state["epoch_items"]
        self._last_logged_env_step = state["last_logged_env_step"]
        self._last_logged_global_step = self.state.global_step
        for follower, saved in zip(self._team[1:], state["followers"]):
            follower.state.global_step = saved["global_step"]
            follower.state.num_input_tokens_seen = saved["num_input_tokens_seen"]
        objects = self._stateful_objects()
        if set(objects) != set(state["objects"]):
            raise ValueError(f"Cannot resume from {checkpoint}: the stateful objects differ (checkpoint: "
                             f"{sorted(state['objects'])}, this trainer: {sorted(objects)}).")
        for name, obj in objects.items():
            obj.load_state_dict(state["objects"][name])

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(os.path.join(resume_from_checkpoint, "agent_0"), model)
        for i, follower in enumerate(self._team[1:], start=1):
            Trainer._load_from_checkpoint(follower, os.path.join(resume_from_checkpoint, f"agent_{i}"))
        self._load_extra_state(resume_from_checkpoint)

    def _load_extra_state(self, checkpoint: str) -> None:
        """Restore what `_save_extra_state` wrote (critics, ...); subclasses add theirs."""

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if resume_from_checkpoint is None or not self.is_deepspeed_enabled:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        # Under DeepSpeed, Trainer loads the engine state from the checkpoint directory itself and skips
        # `_load_from_checkpoint`; agent 0's engine state is in checkpoint-N/agent_0, and the team's other state
        # (critics, value heads, their optimisers) is restored here. Followers load theirs in _prepare_followers.
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        deepspeed_load_checkpoint(self.model_wrapped, os.path.join(resume_from_checkpoint, "agent_0"),
                                  load_module_strict=not is_peft_model(self.model))
        self._load_optimizer_and_scheduler(resume_from_checkpoint)  # maps to agent_0
        self._load_scaler(os.path.join(resume_from_checkpoint, "agent_0"))
        self._load_extra_state(resume_from_checkpoint)
        return model, train_dataloader

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None:
            checkpoint = os.path.join(checkpoint, "agent_0")
        super()._load_optimizer_and_scheduler(checkpoint)

    # ----- evaluation -----

    def _maybe_evaluate(self, first_item: int, num_items: int) -> None:
        interval = self.args.eval_interval
        if interval > 0 and self.eval_dataset is not None:
            if any(index % interval == 0 for index in range(first_item, first_item + num_items)):
                self.evaluate()

    def evaluate(self, num_eval_samples: int | None = None) -> dict[str, float]:
        """Sample one response per agent for the first `num_eval_samples` evaluation items and score them.

        Every item follows one path: one response per agent per turn, with the external transition between
        turns. Returns `eval/turn_k/reward_mean` and `eval/turn_k/expected_return` (the discounted return from
        turn k) for every turn k, plus the custom metrics of `eval_logger`/`eval_aggregator`, or `{}` without an
        eval_dataset. An evaluation set that yields no item is a ValueError. Model weights are not updated.
        """
        if self.eval_dataset is None:
            return {}
        count = self.args.eval_num_samples if num_eval_samples is None else num_eval_samples
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"num_eval_samples must be a positive integer, got {count!r}.")
        items = list(itertools.islice(iter(self.eval_dataset), count))
        if not items:
            raise ValueError("eval_dataset yielded no evaluation items; pass a non-empty eval_dataset, or None to "
                             "skip evaluation.")
        process, processes = self.accelerator.process_index, self.accelerator.num_processes
        indices, kept = even_shard(len(items), process, processes)  # the repeated ones' results are dropped
        sampled = [items[index] for index in indices]
        labels = [f"evaluation item {index}" for index in indices]
        local = sampled[:kept]
        completions = [[] for _ in self._team]  # [agent][local item][turn]
        prompts = [[] for _ in self._team]  # [agent][local item][turn]
        rewards, returns = [], []  # [local item][turn]
        training = [agent.model.training for agent in self._team]
        try:
            for agent in self._team:
                agent.model.eval()
            for start in range(0, len(sampled), self.args.eval_batch_size):
                end = start + self.args.eval_batch_size
                batch_completions, batch_rewards, batch_returns, batch_prompts = self.orchestrator.evaluate_path(
                    sampled[start:end], labels[start:end])
                for agent_completions, new in zip(completions, batch_completions):
                    agent_completions.extend(new)
                for agent_prompts, new in zip(prompts, batch_prompts):
                    agent_prompts.extend(new)
                rewards.extend(batch_rewards)
                returns.extend(batch_returns)
        finally:
            for agent, was_training in zip(self._team, training):
                agent.model.train(was_training)
                agent._metrics["eval"].clear()
        completions, prompts = [c[:kept] for c in completions], [p[:kept] for p in prompts]
        metrics = {}
        all_rewards = self._gather_lists(rewards[:kept])
        all_returns = self._gather_lists(returns[:kept])
        for turn in range(self.args.num_turns):
            metrics[f"eval/turn_{turn + 1}/reward_mean"] = sum(r[turn] for r in all_rewards) / len(all_rewards)
            metrics[f"eval/turn_{turn + 1}/expected_return"] = sum(r[turn] for r in all_returns) / len(all_returns)
        custom = self._custom_eval_metrics(local, completions, prompts)
        metrics.update({f"eval/{key}": value for key, value in custom.items()})
        self.log({"env_step": self.env_step, **metrics})
        return metrics

    def _custom_eval_metrics(self, items: list, completions: list, prompts: list) -> dict[str, float]:
        """`eval_logger` rows for the local items, gathered and reduced by `eval_aggregator` (no prefix)."""
        if self.eval_logger is None:
            return {}
        rows = self.eval_logger(agent_completions_turns=completions, batch_items=items,
                                prompts=[item.get("prompt") for item in items])
        return self.eval_aggregator(self._gather_lists(rows), num_turns=self.args.num_turns)

    # ----- saving -----

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Export every agent to `output_dir/agent_i/` (config, weights or LoRA adapter, tokenizer).

        An export, not a checkpoint: optimiser state is not saved. Each `agent_i` directory can be passed back
        as an entry of `agents=[...]` to continue training.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        for i, agent in enumerate(self._team):
            path = os.path.join(output_dir, f"agent_{i}")
            if agent is self:
                super().save_model(path, _internal_call=_internal_call)
            else:
                agent.save_model(path, _internal_call=_internal_call)


class _TeamCallback(TrainerCallback):
    """Drives the follower agents from the team loop and gates training logs on env_step."""

    def __init__(self, trainer: MAGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._prepare_followers()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer._epoch_items = 0

    def on_epoch_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer._checkpoint_dir is not None:
            trainer._checkpoint_sequence = round(state.epoch)
            if trainer._checkpoint_sequence % trainer._checkpoint_interval == 0 or state.global_step >= state.max_steps:
                control.should_save = True
                control.should_log = True  # flush the metrics, so that a resumed run logs exactly the same
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._step_followers()

    def on_step_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "steps":
            gap = self.trainer.env_step - self.trainer._last_logged_env_step
            # The first step always logs, so that a run shorter than logging_steps still reports its rewards.
            control.should_log = gap >= args.logging_steps or state.global_step == 1
        return control


class MAREINFORCETrainer(MAGRPOTrainer):
    """MAGRPO with `advantage_mode="raw"` by default: REINFORCE on the joint return."""

    default_config_cls = MAREINFORCEConfig
    algorithm_name = "MAREINFORCE"


class MARLOOTrainer(MAGRPOTrainer):
    """MAGRPO with `advantage_mode="rloo"` by default: leave-one-out baseline."""

    default_config_cls = MARLOOConfig
    algorithm_name = "MARLOO"


class MAReMaxTrainer(MAGRPOTrainer):
    """MAGRPO with `advantage_mode="max"` by default: the group's best return is the baseline."""

    default_config_cls = MAReMaxConfig
    algorithm_name = "MAReMax"


# ----- construction helpers -----


def _resolve_agent_sources(agent_model, agents, num_agents, args) -> list:
    """The per-agent model sources, checked against `agent_model`, `num_agents` and `args.num_agents`."""
    if agents is not None:
        if isinstance(agents, (str, PreTrainedModel)) or not isinstance(agents, Sequence) or len(agents) == 0:
            raise TypeError("agents must be a non-empty list of model ids, paths or models (one per agent).")
        if any(agent is None for agent in agents):
            raise ValueError("agents entries must not be None.")
        sources = list(agents)
        if agent_model is not None:
            expected = _model_name(agent_model)
            names = [_model_name(agent) for agent in sources]
            if any(name != expected for name in names):
                raise ValueError(
                    f"agent_model and agents conflict: {expected!r} != {names}. Pass agents alone for a "
                    "heterogeneous team, or agent_model alone for copies of one model."
                )
        if num_agents is not None and num_agents != len(sources):
            raise ValueError(f"agents has {len(sources)} entries but num_agents={num_agents}.")
        return sources
    if agent_model is None:
        raise ValueError("Either agent_model (one model for all agents) or agents (one per agent) must be provided.")
    n = num_agents if num_agents is not None else (args.num_agents if args is not None else 2)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_agents must be a positive integer, got {n!r}.")
    if not isinstance(agent_model, str) and n > 1:
        raise ValueError(
            "agent_model must be a model id or path to build several agents (each agent gets its own copy); "
            "to pass model objects use agents=[model_0, model_1, ...]."
        )
    return [agent_model] * n


def _model_name(source) -> str:
    return source if isinstance(source, str) else source.config._name_or_path


def _resolve_tokenizers(tokenizer, sources) -> list:
    n = len(sources)
    if isinstance(tokenizer, (list, tuple)):
        if len(tokenizer) != n:
            raise ValueError(f"Got {len(tokenizer)} tokenizers for {n} agents: pass one tokenizer or one per agent.")
        return list(tokenizer)
    if tokenizer is not None:
        return [tokenizer] * n
    if any(not isinstance(source, str) for source in sources):
        raise ValueError(
            "Tokenizer(s) must be provided when agents are model objects: pass tokenizer=... (one for all agents "
            "or a list with one per agent)."
        )
    return [AutoTokenizer.from_pretrained(source, padding_side="left") for source in sources]


def _saved_adapter_or(source):
    """A saved LoRA agent directory is loaded trainable here; any other source goes to TRL as it is."""
    adapter = load_saved_adapter(source)
    return adapter if adapter is not None else source


def _per_agent(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} agents: pass one for all or one per agent.")
        return list(value)
    return [copy.deepcopy(value) for _ in range(n)]


def _follower_args(args: MAGRPOConfig, index: int) -> MAGRPOConfig:
    follower = copy.deepcopy(agent_config(args, index))
    follower.report_to = []  # only the team loop reports
    return follower


def _validate_trainer_inputs(args, reward_func, external_transition, eval_logger, eval_aggregator, train_dataset):
    if reward_func is None:
        raise ValueError("reward_func is required: a callable returning one reward per joint action.")
    if args.num_turns > 1 and external_transition is None:
        raise ValueError(f"num_turns={args.num_turns} needs an external_transition that builds the next turn's prompts.")
    if external_transition is not None and not callable(external_transition):
        raise TypeError(f"external_transition must be a callable, got {type(external_transition).__name__}.")
    if (eval_logger is None) != (eval_aggregator is None):
        raise ValueError("eval_logger and eval_aggregator work together: pass both or neither.")
    k = args.num_generations
    local_rows = args.per_device_train_batch_size * args.steps_per_generation
    if local_rows % k != 0:
        raise ValueError(
            f"per_device_train_batch_size * steps_per_generation = {local_rows} must be a multiple of "
            f"num_generations = {k}, so that every task item's {k} completions per agent stay on one device and "
            "the joint reward sees whole groups."
        )
    if args.log_completions:
        raise ValueError("log_completions is not supported by multi-agent trainers yet; leave it False.")
    if args.use_vllm:
        raise ValueError("use_vllm is not supported by multi-agent trainers yet (one vLLM engine per agent).")
    if isinstance(train_dataset, IterableDataset) and args.max_steps <= 0:
        raise ValueError("An IterableDataset has no length: set max_steps in the config to bound training.")


@contextlib.contextmanager
def _long_lived_objects_frozen():
    """Keep the garbage collector off the objects that exist before training (modules, weights, datasets, code).

    Accelerate's `free_memory()` at the start of `train()` runs a full `gc.collect()`, which walks every object of the
    process: about 0.3-0.4 s of CPU with torch, transformers and TRL loaded, more than a whole step of a small model.
    Frozen objects are skipped by every collection during training; they are unfrozen afterwards, so cyclic garbage
    from before training is still collected later. Objects created during training are collected as usual.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _warn_low_precision_weights(team, deepspeed: bool) -> None:
    """Warn when an agent trains weights stored in bf16/fp16 without DeepSpeed (whose optimiser keeps fp32 master
    weights): AdamW then updates in that precision and small steps vanish."""
    if deepspeed:
        return
    for agent in team:
        names = low_precision_trainable(agent.model)
        if names:
            dtype = dict(agent.model.named_parameters())[names[0]].dtype
            warnings.warn(
                f"Agent {agent.agent_index} trains {len(names)} parameters stored in {dtype} without DeepSpeed: "
                "AdamW then updates in that precision and small steps (e.g. lr 5e-6) are lost. Load the weights in "
                "float32 (model_init_kwargs={'dtype': 'float32'}, the default) and keep bf16=True for mixed "
                "precision, use LoRA, or launch with a DeepSpeed config (fp32 master weights).",
                stacklevel=3,
            )


def _is_stateful(obj, name: str) -> bool:
    """Whether a user object's state is checkpointed: it has both `state_dict` and `load_state_dict`.

    One without the other is an error: its state could be saved but not restored (or the reverse), and leaving
    it out silently would make a resumed run differ.
    """
    methods = [method for method in ("state_dict", "load_state_dict") if callable(getattr(obj, method, None))]
    if len(methods) == 1:
        missing = "load_state_dict" if methods == ["state_dict"] else "state_dict"
        raise TypeError(f"{name} ({type(obj).__name__}) defines {methods[0]}() but not {missing}(); define both so "
                        "that checkpoints save and restore its state, or neither to leave it out of them.")
    if obj is None or not methods:
        return False
    # A streaming dataset's position is restored by the data loader, not by its own state.
    return not (isinstance(obj, IterableDataset) and type(obj).state_dict is IterableDataset.state_dict)


def _check_finite_loss(loss: torch.Tensor, agent_idx: int, step: int) -> None:
    if not torch.isfinite(loss).all():
        raise FloatingPointError(f"Agent {agent_idx} produced a non-finite loss ({loss.item()}) at step {step}.")

