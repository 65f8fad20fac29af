"""The team loop every family shares, on TRL.

Shape: `TeamTrainer` is agent 0's TRL `GRPOTrainer` and owns the one real `Trainer.train()` loop, so TRL and
transformers callbacks, `report_to`, LR schedules and Accelerate preparation work unchanged. Agents 1..N-1 are
`FollowerGRPOTrainer`s, each with its own model (optionally LoRA), optimiser, scheduler and Accelerator, driven
from this loop. At every generation a `JointRolloutOrchestrator` generates for all agents, calls the joint reward
and returns every agent's scored batch and advantages; every agent, agent 0 included, receives them through the
same `fill_micro_batches`, and TRL's loss then runs once per agent per micro-step. TRL's internals are reached only
through `comlrl_trl.adapters.grpo`; checkpoints are `TeamCheckpoints`'. The families (reinforce, actor_critic,
preference) subclass it side by side.
"""

import contextlib
import copy
import gc
import importlib.util
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from accelerate.utils import is_peft_model
from datasets import Dataset, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback
from transformers.integrations import WandbCallback
from transformers.trainer_callback import ProgressCallback

from ...adapters.grpo import AgentGRPOTrainer, TeamGRPOTrainer, joint_reward
from ...adapters.helpers import call_save_model
from ...agent_overrides import agent_config
from ...checkpoint import model_fingerprint
from ...formatters import build_formatters
from ...inputs import (
    check_datasets,
    check_trainer_inputs,
    per_agent,
    resolve_agent_sources,
    resolve_tokenizers,
    saved_adapter_or,
)
from ...integrations.progress import TeamProgressCallback
from ...integrations.wandb import WandbRunCallback, validate_wandb_config, verbose_from_wandb_config
from ...joint_reward import JointReward
from ...loading import one_device_loading
from ...orchestrator import JointRolloutOrchestrator
from ...team_settings import write_team_settings
from ...value_models import low_precision_trainable
from .checkpoints import TeamCheckpoints
from .config import TeamConfig
from .evaluation import TeamEvaluation
from .metrics_hooks import EvalMetrics, MetricsHookName, check_metrics_hooks, eval_logger_metrics


class FollowerGRPOTrainer(AgentGRPOTrainer):
    """The trainer of an agent after the first: driven by the team trainer's loop, never by its own `train()`."""

    is_follower = True


class TeamTrainer(TeamCheckpoints, TeamEvaluation, TeamGRPOTrainer):
    """The team loop every family shares: N agents' TRL trainers, the joint rollout, checkpoints and evaluation.

    Users train with a family's class ([`MAGRPOTrainer`], [`IACTrainer`], [`MADPOTrainer`], ...); its docstring
    lists the arguments, which are the ones of `__init__` here plus the family's own.
    """

    default_config_cls = TeamConfig
    follower_cls = FollowerGRPOTrainer
    metrics_hooks: tuple[MetricsHookName, ...] = ("eval_logger",)  # the custom-metrics names it honours
    algorithm_name = "team"  # each family names its algorithm (logged, saved with the run)
    model_tags = ("trl", "grpo", "comlrl_trl")

    def __init__(
        self,
        agent_model: str | PreTrainedModel | None = None,
        *,
        agents: Sequence[str | PreTrainedModel] | None = None,
        num_agents: int | None = None,
        tokenizer: PreTrainedTokenizerBase | Sequence[PreTrainedTokenizerBase] | None = None,
        formatters: Callable | Sequence[Callable] | None = None,
        reward_func: Callable | None = None,
        reward_processor: Callable[[float], float] | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | IterableDataset | None = None,
        args: TeamConfig | None = None,
        external_transition: Callable | None = None,
        wandb_config: dict[str, Any] | None = None,
        eval_logger: Callable | None = None,
        eval_aggregator: Callable | None = None,
        metrics_callback: Callable | None = None,
        peft_config: Any = None,
        callbacks: list[TrainerCallback] | None = None,
    ):
        if args is not None and not isinstance(args, TeamConfig):
            name = self.default_config_cls.__name__
            raise TypeError(f"args must be a {name} (or a subclass), got {type(args).__name__}.")
        check_metrics_hooks(type(self).__name__, self.metrics_hooks, eval_logger, eval_aggregator, metrics_callback)
        sources = resolve_agent_sources(agent_model, agents, num_agents, args)
        n = len(sources)
        if args is None:
            args = self.default_config_cls(num_agents=n)
        if args.num_agents != n:
            raise ValueError(
                f"{n} agents were given but args.num_agents={args.num_agents}; set {type(args).__name__}"
                f"(num_agents={n}) or pass the matching number of agents."
            )
        check_trainer_inputs(args, reward_func, external_transition, train_dataset)
        args.model_init_kwargs = one_device_loading(args.model_init_kwargs)  # no "auto" spread over every GPU
        check_datasets(train_dataset, eval_dataset, default_formatters=formatters is None)
        validate_wandb_config(wandb_config)
        tokenizers = resolve_tokenizers(tokenizer, sources)
        peft_configs = per_agent(peft_config, n, "peft_config")
        formatter_list = build_formatters(formatters, n)
        joint = JointReward(reward_func, reward_processor)
        models = [saved_adapter_or(source) for source in sources]
        args.fit_precision_to_models(models)
        if isinstance(train_dataset, Dataset):
            args.fit_generation_to_dataset(len(train_dataset), evaluates=eval_dataset is not None)
        # Every agent's args are copied before any trainer exists: creating TrainingArguments later would reset
        # the Accelerate state the live trainers share. `args.agent_overrides` gives an agent its own values.
        agent_args = [agent_config(args, 0), *(_follower_args(args, i) for i in range(1, n))]
        # Without a train_dataset the trainer can only evaluate: TRL's trainers get a one-row stand-in, dropped below.
        trl_dataset = train_dataset if train_dataset is not None else Dataset.from_dict({"prompt": [""]})

        with _without_trl_engines(agent_args):  # with use_vllm, the team's engines replace one TRL engine per agent
            super().__init__(
                model=models[0],
                reward_funcs=[joint_reward],
                args=agent_args[0],
                train_dataset=trl_dataset,
                processing_class=tokenizers[0],
                callbacks=callbacks,
                peft_config=peft_configs[0],
            )
            followers = [
                self.follower_cls(
                    model=models[i],
                    reward_funcs=[joint_reward],
                    args=agent_args[i],
                    train_dataset=trl_dataset,
                    processing_class=tokenizers[i],
                    peft_config=peft_configs[i],
                )
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
        self.model_fingerprints = [model_fingerprint(agent.model) for agent in self._team]
        self._share_frozen_base_weights()
        self.generation_engines = self._start_generation_engines() if args.use_vllm else None
        self.formatters = formatter_list
        self.eval_dataset = eval_dataset
        self.eval_logger = eval_logger
        self.eval_aggregator = eval_aggregator
        self.metrics_callback = metrics_callback
        self.eval_metrics = self._build_eval_metrics(eval_logger, eval_aggregator, metrics_callback)
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
        self.stateful_objects()  # a user object with only one of state_dict/load_state_dict is an error now

    def _build_eval_metrics(self, eval_logger, eval_aggregator, metrics_callback) -> EvalMetrics | None:
        """The custom-metrics hook from the documented names this trainer takes (`metrics_hooks`)."""
        return eval_logger_metrics(eval_logger, eval_aggregator) if eval_logger is not None else None

    def _build_orchestrator(self, formatters, joint: JointReward, external_transition) -> JointRolloutOrchestrator:
        return JointRolloutOrchestrator(self._team, formatters, joint, self.args, external_transition)

    # ----- the team -----

    @property
    def agents(self) -> list[PreTrainedModel]:
        """The agents' models, in actor order (PEFT models when training adapters)."""
        return [agent.model for agent in self._team]

    @property
    def agent_trainers(self) -> list[AgentGRPOTrainer]:
        """Every agent's TRL trainer, in actor order (this trainer is agent 0's)."""
        return self._team

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
                if (
                    not p.requires_grad
                    and base is not None
                    and base.shape == p.shape
                    and base.dtype == p.dtype
                    and base.device == p.device
                    and torch.equal(base, p)
                ):
                    p.data = base.data

    def _start_generation_engines(self):
        """`use_vllm=True`: the team's vLLM engine (one per process; each agent's weights or adapter in turn), or,
        with `vllm_mode="server"`, a running vLLM server that serves every LoRA agent as an adapter."""
        args = self.args
        server = args.vllm_mode == "server"
        if not server and importlib.util.find_spec("vllm") is None:
            raise ImportError(
                "use_vllm=True needs vLLM, which is not installed: `make install-vllm` (a venv with the "
                "CPU build) or `pip install 'comlrl-trl[vllm]'`."
            )
        if self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            raise ValueError(
                "use_vllm=True with DeepSpeed ZeRO-3 is not supported yet (the engines read each agent's "
                "full weights after every step); use ZeRO-2 or LoRA agents."
            )
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length")
        settings = {tuple(getattr(agent.args, key) for key in keys) for agent in self._team}
        if len(settings) > 1:
            raise ValueError(
                f"use_vllm=True samples every agent with the same {', '.join(keys)}; agent_overrides "
                "sets different ones. Give the agents the same sampling settings, or use_vllm=False."
            )
        models = [agent.accelerator.unwrap_model(agent.model) for agent in self._team]
        tokenizers = [agent.processing_class for agent in self._team]
        sampling = dict(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k or 0,
            min_p=args.min_p or 0.0,
            repetition_penalty=args.repetition_penalty,
            max_completion_length=args.max_completion_length,
            seed=args.seed,
        )
        if server:
            from ...generation import TeamVLLMServer

            engines = TeamVLLMServer(
                models,
                tokenizers,
                base_url=args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}",
                adapter_dir=os.path.join(os.path.abspath(args.output_dir), "vllm-adapters"),
                timeout=args.vllm_server_timeout,
                request_timeout=args.vllm_server_request_timeout,
                **sampling,
            )
        else:
            from ...generation import TeamVLLM

            engines = TeamVLLM(
                models,
                tokenizers,
                gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                max_model_length=args.vllm_max_model_length,
                dtype="bfloat16" if args.bf16 else "auto",
                lora_mode=args.vllm_lora_mode,
                # on wherever vLLM offers it (CUDA); TRL's vllm_enable_sleep_mode=True insists on it
                sleep_mode=True if args.vllm_enable_sleep_mode else None,
                **sampling,
            )
        for agent in self._team:
            agent.use_generation_engines(engines)
        return engines

    def _setup_callbacks(self, wandb_config):
        self.add_callback(_TeamCallback(self))
        if wandb_config is not None:
            self.remove_callback(WandbCallback)  # one W&B writer: ours logs CoMLRL's documented keys against env_step
            self.add_callback(WandbRunCallback(wandb_config, self._run_config()))
        if self.pop_callback(ProgressCallback) is not None and verbose_from_wandb_config(wandb_config):
            self.add_callback(TeamProgressCallback())  # a bar with the joint reward instead of every key

    def _run_config(self) -> dict[str, Any]:
        args = self.args
        return {
            "algorithm": self.algorithm_name,
            "model_names": [agent.model.config.name_or_path for agent in self._team],
            **{
                key: getattr(args, key)
                for key in (
                    "num_agents",
                    "num_turns",
                    "num_generations",
                    "joint_mode",
                    "advantage_mode",
                    "advantage_normalization",
                    "learning_rate",
                    "num_train_epochs",
                    "max_completion_length",
                    "temperature",
                    "top_p",
                    "top_k",
                    "beta",
                    "loss_type",
                    "seed",
                    "agent_overrides",
                )
            },
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
            raise ValueError(
                f"This {type(self).__name__} was built without a train_dataset, so it can only evaluate(); "
                "pass train_dataset=... when building it to train."
            )
        self._configure_checkpoints(checkpoint_dir, checkpoint_interval, checkpoint_total_limit)
        lock = self._claim_checkpoint_root()
        try:
            resume = self._prepare_resume(resume_from_checkpoint)
            with _long_lived_objects_frozen():
                output = super().train(
                    resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
                )
            if self._checkpoint_dir is not None and self._last_saved_step != self.state.global_step:
                self.checkpoint_sequence += 1  # a final save after a run that stopped between epoch boundaries
                self.save_checkpoint(trial)
        finally:
            lock.release()
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, TeamProgressCallback):
                    callback.close()
        return output

    def generation_step(self, rows: list[dict[str, Any]]) -> None:
        """The team rollout of the local generation batch; fills every agent's micro-batches."""
        items = len(rows) // self.args.num_generations * self.accelerator.num_processes
        self._maybe_evaluate(first_item=self._epoch_items, num_items=items)
        rollout = self.orchestrator.rollout(rows, first_item_index=self._epoch_items)
        self._epoch_items += items
        for agent, batch, advantages in zip(self._team, rollout.agent_batches, rollout.agent_advantages):
            agent.fill_micro_batches(batch, advantages)
        self.env_step += rollout.env_steps
        for turn, (rewards, returns) in enumerate(zip(rollout.turn_rewards, rollout.turn_returns), start=1):
            self._joint_metrics[f"turn_{turn}/reward_mean"].extend(self._gather_lists(rewards))
            self._joint_metrics[f"turn_{turn}/expected_return"].extend(self._gather_lists(returns))
        for turn, kl in enumerate(rollout.turn_reference_kl, start=1):
            self._joint_metrics[f"turn_{turn}/reference_kl_mean"].append(kl)
            self._joint_metrics[f"turn_{turn}/reference_kl_penalty_mean"].append(self.beta * kl)

    def training_step(self, model, inputs, num_items_in_batch=None):
        slot = self.slot  # the micro-batch every agent trains on now
        loss = super().training_step(model, inputs, num_items_in_batch)
        _check_finite_loss(loss, 0, self.state.global_step)
        for i, follower in enumerate(self._team[1:], start=1):
            follower.current_gradient_accumulation_steps = self.current_gradient_accumulation_steps
            sync = self.accelerator.sync_gradients
            context = contextlib.nullcontext() if sync else follower.accelerator.no_sync(follower.model_wrapped)
            with context:
                follower_loss = follower.training_step(follower.model_wrapped, follower.micro_batch(slot), None)
            _check_finite_loss(follower_loss, i, self.state.global_step)
            self._follower_loss[i - 1] += follower_loss.item()
        return loss

    def reset_for_new_stage(self) -> None:
        """Prepare a trainer that already trained for another `train()` (MARLHF's RL stage): fresh optimisers and
        schedulers for every agent, no buffered rollout, the previous stage's counters cleared (env_step keeps
        counting)."""
        for agent in self._team:
            agent.reset_training_state()
        self._epoch_items = 0
        self._joint_metrics.clear()
        self._last_logged_env_step = self.env_step
        self._last_logged_global_step = 0
        self._follower_loss = [0.0] * (len(self._team) - 1)
        for norms in self._follower_grad_norms:
            norms.clear()

    def restore_env_step(self, env_step: int) -> None:
        """Continue counting environment steps from `env_step` (a resumed run)."""
        self.env_step = self._last_logged_env_step = env_step

    def _prepare_followers(self):
        """Give every other agent its optimizer and scheduler (restored when resuming) and the team state."""
        resume = self._resume_path
        for i, follower in enumerate(self._team[1:], start=1):
            follower.model.train()
            follower.state.max_steps = self.state.max_steps
            agent_resume = os.path.join(resume, f"agent_{i}") if resume is not None else None
            follower.prepare_for_training(self.state.max_steps, agent_resume)
        if resume is not None:
            self._load_team_state(resume)

    def _step_followers(self):
        for i, follower in enumerate(self._team[1:]):
            grad_norm = follower.optimizer_step()
            if grad_norm is not None:
                self._follower_grad_norms[i].append(grad_norm)
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
            for key, values in agent.metrics("train").items():
                valid = [v for v in values if not math.isnan(v)]
                if valid:
                    out[f"agent_{i}/{key}"] = sum(valid) / len(valid)
            agent.metrics("train").clear()
        for key, values in self._joint_metrics.items():
            if values:
                out[key] = sum(values) / len(values)
        self._joint_metrics.clear()
        self._last_logged_env_step = self.env_step
        self._last_logged_global_step = self.state.global_step
        return out

    # ----- saving -----

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Export every agent to `output_dir/agent_i/` (config, weights or LoRA adapter, tokenizer), and the team's
        sampling settings to `output_dir/team_settings.json` (see `comlrl_trl.team_settings`).

        An export, not a checkpoint: optimiser state is not saved. Each `agent_i` directory can be passed back
        as an entry of `agents=[...]` to continue training; `recipes/evaluate.py --model_dir output_dir` evaluates
        the team with the settings it was trained with.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        for i, agent in enumerate(self._team):
            path = os.path.join(output_dir, f"agent_{i}")
            if agent is self:
                call_save_model(super().save_model, path, _internal_call)
            else:
                call_save_model(agent.save_model, path, _internal_call)
        if self.args.should_save:
            write_team_settings(output_dir, self.args)


class _TeamCallback(TrainerCallback):
    """Drives the follower agents from the team loop and gates training logs on env_step."""

    def __init__(self, trainer: TeamTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._prepare_followers()

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer._epoch_items = 0

    def on_epoch_end(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer._checkpoint_dir is not None:
            trainer.checkpoint_sequence = round(state.epoch)
            if trainer.checkpoint_sequence % trainer._checkpoint_interval == 0 or state.global_step >= state.max_steps:
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


# ----- construction helpers -----


def _follower_args(args: TeamConfig, index: int) -> TeamConfig:
    follower = copy.deepcopy(agent_config(args, index))
    follower.report_to = []  # only the team loop reports
    return follower


@contextlib.contextmanager
def _without_trl_engines(agent_args: list[TeamConfig]):
    """Build the agents' TRL trainers with `use_vllm` off, so that TRL starts no engine of its own per agent; the
    configurations say `use_vllm=True` again afterwards (the team's engines are attached after construction)."""
    saved = [config.use_vllm for config in agent_args]
    for config in agent_args:
        config.use_vllm = False
    try:
        yield
    finally:
        for config, value in zip(agent_args, saved):
            config.use_vllm = value


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


def _check_finite_loss(loss: torch.Tensor, agent_idx: int, step: int) -> None:
    if not torch.isfinite(loss).all():
        raise FloatingPointError(f"Agent {agent_idx} produced a non-finite loss ({loss.item()}) at step {step}.")
