"""The team loop every family shares, on TRL.

Shape: `TeamTrainer` is a TRL `GRPOTrainer` that trains no model of its own (`comlrl_trl.adapters.team`). It owns
the loop, and drives N agents that are equal: every agent, agent 0 included, is an `AgentGRPOTrainer` of the family's
`agent_cls` with its own model (optionally LoRA), optimiser, scheduler, Accelerator and `agent_i/` checkpoint files.
TRL and transformers callbacks, `report_to`, `save_strategy`, LR schedules and `TrainerState` are the team's.

One optimiser update (`optimizer_update`) reads top-down: at every generation a `JointRolloutOrchestrator` generates
for all agents, calls the joint reward and fills every agent's micro-batches with its scored rows and advantages;
then every agent runs TRL's loss and backward pass on each micro-batch, every agent's optimiser steps (then the
critics', in the actor-critic families), and the team logs, evaluates and saves. TRL's internals are reached only
through `comlrl_trl.adapters`; checkpoints are `TeamCheckpoints`'. The families (reinforce, actor_critic, preference)
subclass it side by side.
"""

import contextlib
import copy
import gc
import importlib.util
import math
import os
import time
import warnings
from collections import defaultdict
from typing import Any, Unpack

import torch
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations import WandbCallback
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import TrainOutput, speed_metrics

from ...adapters.grpo import AgentGRPOTrainer, joint_reward, zero3_enabled
from ...adapters.helpers import call_save_model
from ...adapters.team import TeamGRPOTrainer, TrainingPlan
from ...agent_overrides import agent_config
from ...checkpoint import model_fingerprint
from ...fast.memory import keep_freed_cpu_memory
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
from ...loading import check_model_source, is_peft_model, one_device_loading, shared_lora_bases
from ...orchestrator import JointRolloutOrchestrator
from ...precision import rollout_dtype
from ...team_settings import write_team_settings
from ...value_models import low_precision_trainable
from .checkpoints import TeamCheckpoints
from .config import TeamConfig
from .evaluation import TeamEvaluation
from .inputs import TeamKwargs, team_init, team_inputs
from .metrics_hooks import EvalMetrics, MetricsHookName, check_metrics_hooks, eval_logger_metrics


class TeamTrainer(TeamCheckpoints, TeamEvaluation, TeamGRPOTrainer):
    """The team loop every family shares: N agents' TRL trainers, the joint rollout, checkpoints and evaluation.

    Users train with a family's class ([`MAGRPOTrainer`], [`IACTrainer`], [`MADPOTrainer`], ...). The arguments
    every family shares after `agent_model` are declared once, as `TeamKwargs` (`trainers/team/inputs.py`), and
    documented in [`MAGRPOTrainer`]'s docstring; a family's `__init__` declares only its own and passes
    `**team_kwargs` on (`team_init` gives it the full signature and names a misspelt keyword).

    The team has no tokenizer of its own (`processing_class` is None): every agent tokenises with its own.
    """

    default_config_cls = TeamConfig
    agent_cls = AgentGRPOTrainer  # the class of every agent's trainer (families add their loss to it)
    metrics_hooks: tuple[MetricsHookName, ...] = ("eval_logger",)  # the custom-metrics names it honours
    algorithm_name = "team"  # each family names its algorithm (logged, saved with the run)
    model_tags: tuple[str, ...] = ("trl", "grpo", "comlrl_trl")  # every agent's model's Hub tags

    @team_init
    def __init__(self, agent_model: str | PreTrainedModel | None = None, **team_kwargs: Unpack[TeamKwargs]):
        (
            agents,
            num_agents,
            tokenizer,
            formatters,
            reward_func,
            reward_processor,
            train_dataset,
            eval_dataset,
            args,
            external_transition,
            wandb_config,
            eval_logger,
            eval_aggregator,
            metrics_callback,
            peft_config,
            callbacks,
        ) = team_inputs(team_kwargs).values()  # TeamKwargs' order
        if args is not None and not isinstance(args, TeamConfig):
            name = self.default_config_cls.__name__
            raise TypeError(f"args must be a {name} (or a subclass), got {type(args).__name__}.")
        check_metrics_hooks(type(self).__name__, self.metrics_hooks, eval_logger, eval_aggregator, metrics_callback)
        sources = resolve_agent_sources(agent_model, agents, num_agents, args)
        for i, source in enumerate(sources):  # a clear error for a path that is no model, before any loading
            check_model_source(source, "agent_model" if agents is None else f"agents[{i}]")
        n = len(sources)
        if args is None:
            args = self.default_config_cls(num_agents=n)
        if args.num_agents != n:
            raise ValueError(
                f"{n} agents were given but args.num_agents={args.num_agents}; set {type(args).__name__}"
                f"(num_agents={n}) or pass the matching number of agents."
            )
        check_trainer_inputs(args, reward_func, external_transition, train_dataset)
        if args.use_cpu and args.keep_freed_cpu_memory:
            keep_freed_cpu_memory()
        args.model_init_kwargs = one_device_loading(args.model_init_kwargs)  # no "auto" spread over every GPU
        check_datasets(train_dataset, eval_dataset, formatters is None, args.eval_interval)
        validate_wandb_config(wandb_config)
        tokenizers = resolve_tokenizers(tokenizer, sources)
        peft_configs = per_agent(peft_config, n, "peft_config")
        formatter_list = build_formatters(formatters, n)
        joint = JointReward(reward_func, reward_processor)
        models = [saved_adapter_or(source) for source in sources]
        args.fit_precision_to_models(models)
        if isinstance(train_dataset, Dataset):
            args.fit_generation_to_dataset(len(train_dataset), evaluates=eval_dataset is not None)
        # Every agent's args are copied before any agent exists: creating TrainingArguments later would reset the
        # Accelerate state the live trainers share. `args.agent_overrides` gives an agent its own values.
        agent_args = [_agent_args(args, i) for i in range(n)]
        models = shared_lora_bases(models, peft_configs, agent_args)  # one frozen LoRA base per process, not N
        # Without a train_dataset the trainer can only evaluate: TRL's trainers get a one-row stand-in, dropped below.
        trl_dataset = train_dataset if train_dataset is not None else Dataset.from_dict({"prompt": [""]})

        # The team's Trainer first: its Accelerator is the process's first, whose state (and DeepSpeed plugin) every
        # agent's reuses. It has no tokenizer of its own: every agent tokenises with its own. Then the agents, all alike.
        super().__init__(args, train_dataset, None, callbacks)
        with _without_trl_engines(agent_args):  # with use_vllm, the team's engines replace one TRL engine per agent
            agents = [
                self.agent_cls(
                    model=models[i],
                    reward_funcs=[joint_reward],
                    args=agent_args[i],
                    train_dataset=trl_dataset,
                    processing_class=tokenizers[i],
                    peft_config=peft_configs[i],
                    agent_index=i,
                )
                for i in range(n)
            ]
        for agent in agents:
            agent.train_dataset = train_dataset
            agent.tag_model(self.model_tags)
        self.agent_trainers: list[AgentGRPOTrainer] = agents
        self.attach_agent_models([agent.model for agent in agents])
        _warn_low_precision_weights(agents, self.is_deepspeed_enabled)
        # Fingerprinted now, before training: DeepSpeed later casts weights (bf16) and ZeRO-3 empties partitioned
        # tensors, which would make a valid checkpoint look foreign on resume.
        self.model_fingerprints = [model_fingerprint(agent.model) for agent in agents]
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
        # micro-steps of this train() call; a generation starts every steps_per_generation * num_iterations of them
        self._micro_steps = 0
        self._agent_loss_totals = torch.zeros(n, device=self.accelerator.device)  # since the last log
        self._agent_grad_norms: list[list[float]] = [[] for _ in range(n)]  # since the last log
        self._setup_callbacks(wandb_config)
        self.stateful_objects()  # a user object with only one of state_dict/load_state_dict is an error now

    def _build_eval_metrics(self, eval_logger, eval_aggregator, metrics_callback) -> EvalMetrics | None:
        """The custom-metrics hook from the documented names this trainer takes (`metrics_hooks`)."""
        return eval_logger_metrics(eval_logger, eval_aggregator) if eval_logger is not None else None

    def _build_orchestrator(self, formatters, joint: JointReward, external_transition) -> JointRolloutOrchestrator:
        return JointRolloutOrchestrator(
            self.agent_trainers, formatters, joint, self.args, self.accelerator, external_transition
        )

    # ----- the team -----

    @property
    def agents(self) -> list[PreTrainedModel]:
        """The agents' models, in actor order (PEFT models when training adapters)."""
        return [agent.model for agent in self.agent_trainers]

    @property
    def tokenizers(self) -> list[PreTrainedTokenizerBase]:
        """The agents' tokenizers, in actor order."""
        return [agent.processing_class for agent in self.agent_trainers]

    def _share_frozen_base_weights(self) -> None:
        """LoRA agents passed as separate model objects keep one copy of their equal frozen weights instead of N.

        Agents loaded from one model id or path already hold the same frozen `Parameter` objects from the start
        (`loading.shared_lora_bases`, under DeepSpeed ZeRO-1/2 too); this covers model objects the user loaded. The
        base weights of a PEFT model never change (only adapters train, and the reference is the base with the
        adapter disabled), so equal frozen tensors can be one. Skipped under DeepSpeed and FSDP, which own parameter
        storage once they have prepared the models.
        """
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return
        first_copy: dict[str, torch.nn.Parameter] = {}  # parameter name -> the first LoRA agent's frozen tensor
        for agent in self.agent_trainers:
            if not is_peft_model(agent.model):
                continue
            for name, p in agent.model.named_parameters():
                if p.requires_grad:
                    continue
                base = first_copy.setdefault(name, p)
                if (
                    base is not p
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
        if zero3_enabled(self):
            raise ValueError(
                "use_vllm=True with DeepSpeed ZeRO-3 is not supported yet (the engines read each agent's "
                "full weights after every step); use ZeRO-2 or LoRA agents."
            )
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_completion_length")
        settings = {tuple(getattr(agent.args, key) for key in keys) for agent in self.agent_trainers}
        if len(settings) > 1:
            raise ValueError(
                f"use_vllm=True samples every agent with the same {', '.join(keys)}; agent_overrides "
                "sets different ones. Give the agents the same sampling settings, or use_vllm=False."
            )
        models = [agent.accelerator.unwrap_model(agent.model) for agent in self.agent_trainers]
        tokenizers = [agent.processing_class for agent in self.agent_trainers]
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
                max_prompt_length=args.max_prompt_length,
                dtype=rollout_dtype(args.fp16, args.bf16),
                lora_mode=args.vllm_lora_mode,
                # on wherever vLLM offers it (CUDA); TRL's vllm_enable_sleep_mode=True insists on it
                sleep_mode=True if args.vllm_enable_sleep_mode else None,
                **sampling,
            )
        for agent in self.agent_trainers:
            agent.use_generation_engines(engines)
        return engines

    def _setup_callbacks(self, wandb_config):
        if wandb_config is not None:
            self.remove_callback(WandbCallback)  # one W&B writer: ours logs CoMLRL's documented keys against env_step
            self.add_callback(WandbRunCallback(wandb_config, self._run_config()))
        if self.pop_callback(ProgressCallback) is not None and verbose_from_wandb_config(wandb_config):
            self.add_callback(TeamProgressCallback())  # a bar with the joint reward instead of every key

    def _run_config(self) -> dict[str, Any]:
        args = self.args
        return {
            "algorithm": self.algorithm_name,
            "model_names": [agent.model.config.name_or_path for agent in self.agent_trainers],
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
    ) -> TrainOutput:
        """Train every agent for `args.num_train_epochs` epochs (the whole run, including resumed work).

        Args:
            resume_from_checkpoint (`str` or `bool`, *optional*):
                A `checkpoint-N` directory to resume from (`True`: the latest one in `checkpoint_dir`, else in
                `args.output_dir`). The trainer must be compatible: same class, agents, model shapes, tokenizers,
                `num_generations`, `joint_mode` and `num_turns`; `num_train_epochs` may be larger.
            checkpoint_dir (`str`, *optional*):
                Save a checkpoint into `checkpoint_dir/checkpoint-N` at every `checkpoint_interval`-th completed
                epoch and at the end, N being the epoch it was taken in, counted from 1: `checkpoint-1`,
                `checkpoint-2`, ... at the end of each epoch; a run that stops inside epoch N (`max_steps`) saves
                `checkpoint-N`, and a resumed run that completes epoch N replaces it. Without it (and with
                `args.save_strategy="no"`), no checkpoint is written. TRL's `save_strategy`/`save_steps` also
                work and save into `args.output_dir/checkpoint-{global step}`, as TRL names them.
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
        self.is_in_train = True
        try:
            resume = self._prepare_resume(resume_from_checkpoint)
            with _long_lived_objects_frozen():
                output = self._run_epochs(resume, trial)
            if self._checkpoint_dir is not None and self._last_saved_step != self.state.global_step:
                self.checkpoint_sequence = self.checkpoint_epoch()  # a run stopped inside an epoch (a callback)
                self.save_checkpoint(trial)
        finally:
            self.is_in_train = False
            lock.release()
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, TeamProgressCallback):
                    callback.close()
        return output

    def _run_epochs(self, resume: str | None, trial) -> TrainOutput:
        """transformers' loop, owned by the team: the plan, every agent prepared, the epochs, the final metrics."""
        self.accelerator.free_memory()
        dataloader = self.get_train_dataloader()
        plan = self.training_plan(dataloader)
        first_epoch, skip = self.start_training_state(plan, resume, trial)
        if resume is not None:
            self._announce_resume(resume)
        self._prepare_agents(plan, resume)
        self.callback_handler.train_dataloader = dataloader
        self.control = self.callback_handler.on_train_begin(self.args, self.state, self.control)
        start_time, start_step = time.time(), self.state.global_step
        for epoch in range(first_epoch, plan.num_train_epochs):
            self._epoch_items = 0
            self.control = self.callback_handler.on_epoch_begin(self.args, self.state, self.control)
            for micro_batches, done in self.epoch_updates(dataloader, epoch, plan, resume, first_epoch, skip):
                self.optimizer_update(micro_batches, epoch + done / plan.micro_steps_per_epoch, trial)
                if self.control.should_epoch_stop or self.control.should_training_stop:
                    break
            self.control = self.callback_handler.on_epoch_end(self.args, self.state, self.control)
            self._save_at_epoch_end()
            self._log_save_evaluate(trial)
            if self.control.should_training_stop:
                break
        return self._finish_training(plan, start_time, start_step)

    def optimizer_update(self, micro_batches: list[list[dict[str, Any]]], epoch: float, trial=None) -> None:
        """One optimiser update of the whole team, from its micro-steps' generation batches (`micro_batches`).

        At each micro-step, a new generation starts when one is due: the joint rollout scores every agent's samples
        with the joint reward and fills every agent's micro-batches. Then every agent trains on its micro-batch of
        that step (TRL's loss and backward pass), and the critics on theirs. After the last micro-step every agent's
        optimiser and scheduler step, then the critics'; the team then logs, evaluates and saves as TRL's
        strategies (and `train(checkpoint_dir=...)`) say.
        """
        args, agents = self.args, self.agent_trainers
        self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
        self.current_gradient_accumulation_steps = len(micro_batches)
        for agent in agents:
            agent.current_gradient_accumulation_steps = len(micro_batches)
        for k, rows in enumerate(micro_batches):
            if self._micro_steps % (args.steps_per_generation * args.num_iterations) == 0:
                self.generation_step(rows)  # rollout -> joint reward -> every agent's micro-batches
                if self.generation_engines is not None:
                    self.generation_engines.sleep()  # frees the engine's GPU memory for training (sleep mode)
            slot, last = self._micro_steps % args.steps_per_generation, k == len(micro_batches) - 1
            self.set_sync_gradients(last)
            losses = [agent.train_micro_batch(slot, sync_gradients=last) for agent in agents]
            self.critic_micro_step(slot)
            self._agent_loss_totals += torch.stack(losses).to(self._agent_loss_totals)
            self._micro_steps += 1
            if not last:
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
        self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
        for agent, norms in zip(agents, self._agent_grad_norms):
            grad_norm = agent.optimizer_step()
            if grad_norm is not None:  # None: not clipped, or DeepSpeed computed no norm
                norms.append(grad_norm)
        self.critic_optimizer_step()
        self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
        self.state.global_step += 1
        self.state.epoch = epoch
        for agent in agents:
            agent.state.global_step, agent.state.epoch = self.state.global_step, epoch
        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        self._log_first_update()
        self._log_save_evaluate(trial)

    def generation_step(self, rows: list[dict[str, Any]]) -> None:
        """The team rollout of the local generation batch `rows`; fills every agent's micro-batches."""
        items = len(rows) // self.args.num_generations * self.accelerator.num_processes
        self._maybe_evaluate(first_item=self._epoch_items, num_items=items)
        rollout = self.orchestrator.rollout(rows, first_item_index=self._epoch_items)
        self._epoch_items += items
        for agent, batch, advantages in zip(self.agent_trainers, rollout.agent_batches, rollout.agent_advantages):
            agent.fill_micro_batches(batch, advantages)
        self.env_step += rollout.env_steps
        for turn, (rewards, returns) in enumerate(zip(rollout.turn_rewards, rollout.turn_returns), start=1):
            self._joint_metrics[f"turn_{turn}/reward_mean"].extend(self._gather_lists(rewards))
            self._joint_metrics[f"turn_{turn}/expected_return"].extend(self._gather_lists(returns))
        for turn, kl in enumerate(rollout.turn_reference_kl, start=1):
            self._joint_metrics[f"turn_{turn}/reference_kl_mean"].append(kl)
            self._joint_metrics[f"turn_{turn}/reference_kl_penalty_mean"].append(self.args.beta * kl)

    def critic_micro_step(self, slot: int) -> None:
        """Train the critics on micro-batch `slot` (the actor-critic families; the others have none)."""

    def critic_optimizer_step(self) -> None:
        """Step the critics' optimisers after the agents' (the actor-critic families; the others have none)."""

    def _prepare_agents(self, plan: TrainingPlan, resume: str | None) -> None:
        """Give every agent its optimiser and scheduler (DeepSpeed: its engine), restored with the team's state when
        resuming, and clear the counters of a previous `train()`."""
        if resume is not None and not self.is_deepspeed_enabled:
            self.load_agent_weights(resume)  # a DeepSpeed engine loads its agent's weights when it is prepared
        for i, agent in enumerate(self.agent_trainers):
            agent.model.train()
            agent.state.max_steps = plan.max_steps
            agent.prepare_for_training(plan.max_steps, os.path.join(resume, f"agent_{i}") if resume else None)
            agent.state.global_step, agent.state.epoch = self.state.global_step, self.state.epoch
        if resume is not None:
            self.load_team_extra_state(resume)
            self._load_team_state(resume)
        self._micro_steps = 0
        self._agent_loss_totals.zero_()
        for norms in self._agent_grad_norms:
            norms.clear()
        self._last_logged_global_step = self.state.global_step
        self._train_loss_sum = 0.0

    def _log_first_update(self) -> None:
        """With `logging_strategy="steps"`, `logging_steps` counts optimiser updates (`global_step`), as in TRL:
        transformers' `DefaultFlowCallback` logs every `logging_steps`-th update. The first update always logs too,
        so that a run shorter than `logging_steps` still reports its rewards."""
        if self.args.logging_strategy == "steps" and self.state.global_step == 1:
            self.control.should_log = True

    def _save_at_epoch_end(self) -> None:
        """`train(checkpoint_dir=...)`: a checkpoint at every `checkpoint_interval`-th epoch and at the end, with the
        metrics flushed first, so that a resumed run logs exactly the same. It is named after the epoch it was taken
        in, counted from 1 (`checkpoint_epoch`)."""
        if self._checkpoint_dir is None:
            return
        self.checkpoint_sequence = self.checkpoint_epoch()
        if self.checkpoint_sequence % self._checkpoint_interval == 0 or self.state.global_step >= self.state.max_steps:
            self.control.should_save = True
            self.control.should_log = True

    def checkpoint_epoch(self) -> int:
        """N of `checkpoint_dir/checkpoint-N`: the epoch the run is in, counted from 1 (at an epoch's end, the epochs
        completed; a run stopped inside its second epoch by `max_steps` saves `checkpoint-2`)."""
        return max(math.ceil(round(self.state.epoch, 6)), 1)

    def _log_save_evaluate(self, trial) -> None:
        if self.control.should_log and self.state.global_step > self._last_logged_global_step:
            self.log(self._team_training_logs())
        if self.control.should_evaluate:
            self.evaluate()
        if self.control.should_save:
            self.save_checkpoint(trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _finish_training(self, plan: TrainingPlan, start_time: float, start_step: int) -> TrainOutput:
        steps = self.state.global_step - start_step
        unlogged = self.accelerator.gather(self._agent_loss_totals[None]).mean(dim=0).sum().item()
        train_loss = (self._train_loss_sum + unlogged) / max(steps, 1)
        share = steps / max(self.state.max_steps, 1)  # the part of the whole schedule this call ran
        metrics = speed_metrics("train", start_time, num_samples=plan.num_train_samples * share, num_steps=steps)
        self.store_flos()
        metrics["total_flos"] = self.state.total_flos
        metrics["train_loss"] = train_loss
        self.log(metrics)
        self.control = self.callback_handler.on_train_end(self.args, self.state, self.control)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    def reset_for_new_stage(self) -> None:
        """Prepare a trainer that already trained for another `train()` (MARLHF's RL stage): fresh optimisers and
        schedulers for every agent, no buffered rollout, the previous stage's counters cleared (env_step keeps
        counting)."""
        for agent in self.agent_trainers:
            agent.reset_training_state()
        self._epoch_items = 0
        self._joint_metrics.clear()
        self._last_logged_env_step = self.env_step
        self._last_logged_global_step = 0

    def restore_env_step(self, env_step: int) -> None:
        """Continue counting environment steps from `env_step` (a resumed run)."""
        self.env_step = self._last_logged_env_step = env_step

    # ----- logging -----

    def _team_training_logs(self) -> dict[str, float]:
        """The training metrics since the last log: the team's loss (the sum of the agents'), every agent's loss,
        gradient norm, learning rate and TRL metrics (`agent_i/...`), and the joint rollout's metrics."""
        steps = max(self.state.global_step - self._last_logged_global_step, 1)
        losses = self.accelerator.gather(self._agent_loss_totals[None] / steps).mean(dim=0).tolist()
        self._agent_loss_totals.zero_()
        out = {"env_step": self.env_step, "loss": sum(losses)}  # the team objective: the sum of the agents' losses
        self._train_loss_sum += sum(losses) * steps
        rates = []
        for i, (agent, loss, norms) in enumerate(zip(self.agent_trainers, losses, self._agent_grad_norms)):
            out[f"agent_{i}/loss"] = loss
            if norms:
                out[f"agent_{i}/grad_norm"] = sum(norms) / len(norms)
                norms.clear()
            rates.append(agent.last_learning_rate)
            out[f"agent_{i}/learning_rate"] = agent.last_learning_rate
            for key, values in agent.metrics("train").items():
                valid = [v for v in values if not math.isnan(v)]
                if valid:
                    out[f"agent_{i}/{key}"] = sum(valid) / len(valid)
            agent.metrics("train").clear()
        if len(set(rates)) == 1:  # TRL's key, when every agent has the same schedule
            out["learning_rate"] = rates[0]
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
        for i, agent in enumerate(self.agent_trainers):
            call_save_model(agent.save_model, os.path.join(output_dir, f"agent_{i}"), _internal_call)
        if self.args.should_save:
            write_team_settings(output_dir, self.args)


# ----- construction helpers -----


def _agent_args(args: TeamConfig, index: int) -> TeamConfig:
    """Agent `index`'s own copy of the configuration, with its `agent_overrides`; only the team reports and pushes."""
    agent = copy.deepcopy(agent_config(args, index))
    agent.report_to = []
    agent.push_to_hub = False
    return agent


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
