"""MARLHF: learn a joint reward model from preference pairs labelled by the task reward, then train the team with
online RL against the frozen reward model; MARLHFIter repeats both stages with fresh pairs every iteration."""

import contextlib
import copy
import gc
import os
import random
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import numpy as np
import torch
import torch.nn.functional as F
from accelerate.utils import gather_object
from datasets import Dataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from trl import RewardConfig

from ...adapters.grpo import release_accelerator, release_engine, zero3_enabled
from ...adapters.reward import active_deepspeed_plugin, zero3_scoring_engine
from ...batching import even_shard
from ...formatters import build_formatters, format_prompt
from ...inputs import check_reward_arity, resolve_agent_sources
from ...joint_reward import JointReward
from ...joint_text import joint_text
from ..team.inputs import TeamKwargs, team_init, team_inputs
from ..team.metrics_hooks import check_metrics_hooks
from .marlhf_checkpoints import MARLHFCheckpoints, StageCheckpointCallback
from .marlhf_config import MARLHFConfig, MARLHFIterConfig
from .pairs import PreferencePair, pair_rng, pair_statistics, pairs_from_candidates, save_pairs
from .reward_model import (
    JointRewardTrainer,
    LearnedJointReward,
    RewardModelScorer,
    load_reward_backbone,
    load_reward_tokenizer,
    score_shared,
)
from .rl_stage import (
    build_stage_trainer,
    check_callable,
    default_source,
    sample_candidates,
    stage_config,
    stage_trainer_cls,
)


class MARLHFTrainer(MARLHFCheckpoints):
    """
    Multi-agent RL from preferences: a joint reward model learnt from pairs ranked by the task reward, then online RL.

    1. **Pairs.** For every training item each agent samples `preference_num_candidates` completions (one batched
       generation per agent); candidate j of every agent is joint candidate j. `reward_func` (with
       `reward_processor`) ranks them, and pairs with different rewards become chosen/rejected joint responses
       (`pair_selection`, at most `preference_pairs_per_sample` per item).
    2. **Reward model.** The backbone `reward_model_name` (default: the actors' model id) gets a scalar head and is
       trained on the joint texts with TRL's Bradley-Terry loss ([`JointRewardTrainer`]), then frozen.
    3. **Online RL** with `rl_algorithm` for `num_train_epochs` epochs: the reward of a joint action is the reward
       model's score of its joint text. Evaluation always uses the task reward. With an `eval_dataset` and
       `eval_interval > 0` it runs automatically when the RL stage starts (right after the reward-model stage),
       every `eval_interval` training items, and after the RL stage.

    The joint text is `joint_formatter(prompts, completions)` (one entry per agent), by default
    [`comlrl_trl.joint_text.joint_text`]; the same function formats training pairs and RL texts.

    Args:
        agent_model, agents, num_agents, tokenizer, formatters, reward_func, reward_processor, train_dataset,
        eval_dataset, external_transition, wandb_config, eval_logger, eval_aggregator, peft_config, callbacks:
            As in [`MAGRPOTrainer`], in its order (keyword-only after `agent_model`). `reward_func` is the task
            reward: it labels the pairs and scores evaluation. `train_dataset` must be a `datasets.Dataset` (pairs
            are collected over all of it); without one the trainer can only `evaluate()`.
        args ([`MARLHFConfig`], *optional*): configuration of all stages.
        metrics_callback, critic_model, critics, critic_peft_config, model_config:
            As in [`IACTrainer`]/[`MAACTrainer`], for `rl_algorithm` `"iac"` or `"maac"` only (those stages take
            `eval_logger`/`eval_aggregator` too). Without `critic_model`/`critics`, the critic is
            `args.critic_model_name` or the actors' model id.
        reward_peft_config (`PeftConfig`, *optional*):
            LoRA for the reward model (e.g. `LoraConfig(task_type="SEQ_CLS", ...)`, which also trains the head).
        joint_formatter (`Callable`, *optional*): `(prompts, completions) -> str`, the joint text.

    Example:

    ```python
    >>> trainer = MARLHFTrainer(agent_model="path/to/model", num_agents=2, reward_func=reward_func,
    ...                         train_dataset=dataset, args=MARLHFConfig(num_agents=2, num_turns=1))
    >>> trainer.train()
    ```
    """

    config_cls = MARLHFConfig
    algorithm_name = "MARLHF"

    @team_init
    def __init__(
        self,
        agent_model: str | PreTrainedModel | None = None,
        *,
        critic_model: str | PreTrainedModel | None = None,
        critics: Sequence[str | PreTrainedModel] | None = None,
        critic_peft_config: Any = None,
        model_config: dict[str, Any] | None = None,
        reward_peft_config: Any = None,
        joint_formatter: Callable | None = None,
        **team_kwargs: Unpack[TeamKwargs],
    ):
        inputs = team_inputs(team_kwargs)
        args, reward_func, train_dataset = inputs["args"], inputs["reward_func"], inputs["train_dataset"]
        if args is not None and not isinstance(args, self.config_cls):
            raise TypeError(f"args must be a {self.config_cls.__name__}, got {type(args).__name__}.")
        sources = resolve_agent_sources(agent_model, inputs["agents"], inputs["num_agents"], args)
        args = args if args is not None else self.config_cls(num_agents=len(sources))
        _validate_inputs(
            args,
            reward_func,
            train_dataset,
            critic_model,
            critics,
            inputs["metrics_callback"],
            model_config,
            critic_peft_config,
            inputs["eval_logger"],
            inputs["eval_aggregator"],
            reward_peft_config,
            joint_formatter,
        )
        self.args = args
        self.reward_model_name = args.reward_model_name or default_source(sources, "reward model", "reward_model_name")
        if (
            args.uses_actor_critic
            and critic_model is None
            and critics is None
            and (args.rl_algorithm == "maac" or args.use_separate_critic)
        ):
            critic_model = args.critic_model_name or default_source(sources, "critic", "critic_model_name")
        self.formatters = build_formatters(inputs["formatters"], len(sources))
        self.task_reward = JointReward(reward_func, inputs["reward_processor"])
        self.joint_formatter = joint_formatter if joint_formatter is not None else joint_text
        self.learned_reward = LearnedJointReward(self.task_reward, self.formatters, self.joint_formatter)
        self.reward_peft_config = reward_peft_config
        self.reward_tokenizer = load_reward_tokenizer(self.reward_model_name)
        # Every TrainingArguments exists before the first trainer: creating one later resets Accelerate's state.
        # The precision is decided once for the agents and the reward model, which share that state.
        args.fit_precision_to_models([*sources, self.reward_model_name])
        self._reward_args = _reward_config(args)
        self.rl_trainer = build_stage_trainer(
            args,
            stage_config(args, self._rl_num_iterations()),
            self.learned_reward,
            agent_model,
            critic_model=critic_model,
            critics=critics,
            model_config=model_config,
            critic_peft_config=critic_peft_config,
            **{**team_kwargs, "formatters": self.formatters},
        )
        _check_reward_model_device(args.reward_model_device, self.rl_trainer.accelerator.num_processes)
        self.train_dataset, self.eval_dataset = train_dataset, inputs["eval_dataset"]
        self.reward_model: PreTrainedModel | None = None
        self._reward_engine = None  # under ZeRO-3: the engine the trained reward model scores through
        self.preference_pairs: list[PreferencePair] = []
        self.log_history: list[dict[str, Any]] = []
        self.iteration = 0
        self._total_pairs = 0
        self._configure_checkpoints(None, 1, None)
        self.stateful_objects()  # a user object with only one of state_dict/load_state_dict is an error now

    # ----- the team -----

    @property
    def agents(self) -> list[PreTrainedModel]:
        """The agents' models, in actor order."""
        return self.rl_trainer.agents

    @property
    def tokenizers(self) -> list[PreTrainedTokenizerBase]:
        return self.rl_trainer.tokenizers

    @property
    def num_iterations(self) -> int:
        """Preference iterations of the run: one reward model and one RL stage each."""
        return 1

    def _rl_num_iterations(self) -> int | None:
        return None  # the RL stage keeps TRL's num_iterations (GRPO's mu) from args

    # ----- training -----

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_interval: int = 1,
        checkpoint_total_limit: int | None = None,
    ):
        """Run every iteration: pairs, reward model, online RL (see the class).

        Args:
            resume_from_checkpoint (`str` or `bool`, *optional*):
                A `checkpoint-N` directory of this trainer (`True`: the latest in `checkpoint_dir`, else in
                `args.output_dir`, as for every team trainer). The work since that checkpoint is repeated;
                `num_train_epochs` (and `num_iterations`) count the whole run.
            checkpoint_dir (`str`, *optional*):
                Save `checkpoint_dir/checkpoint-N` at every `checkpoint_interval`-th completed stage or RL epoch, and
                at the end. Without it no checkpoint is written.
            checkpoint_total_limit (`int`, *optional*): keep only this many of this run's newest checkpoints.

        Returns the last RL stage's `TrainOutput`.
        """
        if self.train_dataset is None:
            raise ValueError(
                f"This {type(self).__name__} was built without a train_dataset, so it can only evaluate(); "
                "pass train_dataset=... when building it to train."
            )
        self._configure_checkpoints(checkpoint_dir, checkpoint_interval, checkpoint_total_limit)
        lock = self._claim_checkpoint_root()
        try:
            return self._train(resume_from_checkpoint)
        finally:
            lock.release()

    def _train(self, resume_from_checkpoint):
        resume = self._prepare_resume(resume_from_checkpoint)
        rl_resume = rl_step = self._assets = None
        if resume is not None:
            rl_resume, rl_step = self._load_stage(resume)
        else:
            self.log_history, self._total_pairs, self.iteration = [], 0, 0
        self._pairs_dir = _output_dir(self.args.preference_output_dir, resume, self.checkpoint_sequence)
        output = None
        for iteration in range(self.iteration, self.num_iterations):
            self.iteration = iteration
            if resume is None:
                self._preference_stage(iteration)
                self._boundary()
            # The RL stage evaluates before its first item (so right after the reward-model stage), every
            # eval_interval items, and here once more after its last update.
            output = self._rl_stage(rl_resume, rl_step, resume)
            self._maybe_evaluate()
            resume = rl_resume = rl_step = None
        return output

    def _preference_stage(self, iteration: int) -> None:
        pairs, candidate_mean, collapsed = self._collect_pairs(iteration)
        if not pairs:
            count = self.args.preference_num_candidates
            detail = (
                f" In {collapsed} of the {len(self.train_dataset)} items the {count} joint candidates were one and the "
                "same text: the agents sample a single answer (sampling too narrow, or a policy collapsed by the "
                "previous iteration's updates). Raise temperature, top_p or top_k, or lower the learning rate."
                if collapsed
                else " Use more candidates, a higher temperature, or a reward that tells the candidates apart."
            )
            raise ValueError(
                f"No preference pairs in iteration {iteration + 1}: every task item's {count} candidates got equal "
                f"task rewards.{detail}"
            )
        self.preference_pairs = pairs
        self._total_pairs += len(pairs)
        if self._pairs_dir is not None and self.rl_trainer.args.should_save:
            save_pairs(os.path.join(self._pairs_dir, f"pairs_iteration_{iteration + 1:04d}.json"), pairs)
        with _preserved_rng():  # the reward model's seeding must not change the agents' sampling
            output = self._train_reward_model(pairs, iteration)
        self.log(
            {
                "iter/iteration": iteration + 1,
                **pair_statistics(pairs, len(self.train_dataset)),
                "preference/candidate_reward_mean": candidate_mean,
                "iter/total_preference_pairs": self._total_pairs,
                "reward_model/train_loss": output.training_loss,
                **self._reward_model_metrics(pairs),
            }
        )

    def _collect_pairs(self, iteration: int) -> tuple[list[PreferencePair], float, int]:
        """Sample C joint candidates per training item with the current agents; rank them with the task reward.

        Returns the pairs of every process, the mean task reward of the candidates, and the number of items whose C
        joint candidates were all the same text (they can form no pair, whatever the reward).
        """
        rl, args = self.rl_trainer, self.args
        count = args.preference_num_candidates
        process, processes = rl.accelerator.process_index, rl.accelerator.num_processes
        pairs, means, collapsed = [], [], 0
        training = [agent.model.training for agent in rl.agent_trainers]
        try:
            for agent in rl.agent_trainers:
                agent.model.eval()
            indices, kept = even_shard(len(self.train_dataset), process, processes)
            for position, index in enumerate(indices):
                item = self.train_dataset[index]
                prompts = [
                    format_prompt(formatter, item, a, label=f"task item {index}")
                    for a, formatter in enumerate(self.formatters)
                ]
                candidates = sample_candidates(rl, prompts, count)
                if position >= kept:
                    continue  # a repeated item, sampled only to keep the processes in step
                rewards = self.task_reward(candidates, item, f"task item {index} (preference candidates)")
                rng = pair_rng(args.seed, iteration, index) if args.pair_selection == "random" else None
                pairs.extend(
                    pairs_from_candidates(
                        index, prompts, candidates, rewards, args.pair_selection, args.preference_pairs_per_sample, rng
                    )
                )
                means.append(sum(rewards) / len(rewards))
                collapsed += len(set(zip(*candidates))) == 1
        finally:
            for agent, was_training in zip(rl.agent_trainers, training):
                agent.model.train(was_training)
                agent.metrics("eval").clear()
        all_pairs = sorted(gather_object(pairs), key=lambda pair: pair.item_index)
        all_means = gather_object(means)
        rl.env_step += count * len(all_means)  # joint candidates scored with the task reward
        return all_pairs, sum(all_means) / len(all_means), sum(gather_object([collapsed]))

    def _new_reward_model(self, iteration: int) -> PreTrainedModel:
        """A fresh reward model from its source (the head seeded by `seed + iteration`), LoRA-wrapped if configured."""
        model = load_reward_backbone(self.reward_model_name, self.reward_tokenizer, self.args.seed + iteration)
        if self.reward_peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, copy.deepcopy(self.reward_peft_config))
        return model

    def _train_reward_model(self, pairs: list[PreferencePair], iteration: int):
        rows = [pair.reward_model_row(self.joint_formatter, self.args.reward_use_margin) for pair in pairs]
        reward_args = copy.deepcopy(self._reward_args)
        reward_args.seed = self.args.seed + iteration
        self._release_reward_model()  # at most one reward model at a time: the previous one goes before the new loads
        with active_deepspeed_plugin(reward_args.deepspeed_plugin):
            model = self._new_reward_model(iteration)
            trainer = JointRewardTrainer(
                model=model,
                args=reward_args,
                train_dataset=Dataset.from_list(rows),
                processing_class=self.reward_tokenizer,
                freeze_backbone=self.args.reward_freeze_backbone,
            )
            trainer.remove_callback(PrinterCallback)  # this trainer logs the stage's metrics itself (self.log)
            trainer.remove_callback(ProgressCallback)
            output = trainer.train()
            if zero3_enabled(trainer):  # the weights stay partitioned: scoring needs an engine's hooks
                self._reward_engine = zero3_scoring_engine(trainer)
            else:
                release_accelerator(trainer.accelerator)  # the model is scored as it is; its optimiser state goes
        self._set_reward_model(trainer.model)
        return output

    def _release_reward_model(self) -> None:
        """Free the previous reward model: its scoring engine (under ZeRO-3), its scorer and the model itself, so that
        it is gone before the next one is built."""
        engine, self._reward_engine = self._reward_engine, None
        if engine is not None:
            release_engine(engine)
        self.reward_model, self.learned_reward.scorer = None, None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _set_reward_model(self, model: PreTrainedModel) -> None:
        device = self.args.reward_model_device or self.rl_trainer.accelerator.device
        self.reward_model = model
        self.learned_reward.scorer = RewardModelScorer(
            model, self.reward_tokenizer, self.args.reward_max_length, self.args.per_device_eval_batch_size, device
        )

    def _reward_model_metrics(self, pairs: list[PreferencePair]) -> dict[str, float]:
        """The trained reward model on its own pairs: accuracy, mean score margin and Bradley-Terry loss.

        `pairs` are every process's (gathered); each process scores its share of their texts (`score_shared`)."""
        texts = [self.joint_formatter(p.prompts, p.chosen) for p in pairs]
        texts += [self.joint_formatter(p.prompts, p.rejected) for p in pairs]
        scores = torch.tensor(score_shared(self.learned_reward.scorer, texts, self.rl_trainer.accelerator))
        chosen, rejected = scores[: len(pairs)], scores[len(pairs) :]
        margin = (
            torch.tensor([p.chosen_reward - p.rejected_reward for p in pairs]) if self.args.reward_use_margin else 0.0
        )
        return {
            "reward_model/accuracy": (chosen > rejected).float().mean().item(),
            "reward_model/margin": (chosen - rejected).mean().item(),
            "reward_model/loss": F.softplus(-(chosen - rejected - margin)).mean().item(),
        }

    def _rl_stage(self, rl_resume: str | None, rl_step: int | None, checkpoint: str | None):
        rl = self.rl_trainer
        if rl_resume is None:
            rl.reset_for_new_stage()
        callback = None
        if self._checkpoint_dir is not None:
            callback = StageCheckpointCallback(self)
            rl.add_callback(callback)
        try:
            output = rl.train(resume_from_checkpoint=rl_resume, checkpoint_dir=self._rl_root)
        finally:
            if callback is not None:
                rl.remove_callback(callback)
        self._wrap_leftover(rl_step, checkpoint)
        self.log_history.extend(rl.state.log_history)
        return output

    # ----- evaluation and logging -----

    def _maybe_evaluate(self) -> None:
        if self.eval_dataset is not None and self.args.eval_interval > 0:
            self.evaluate()

    def evaluate(self, num_eval_samples: int | None = None) -> dict[str, float]:
        """Score the agents on the first `num_eval_samples` evaluation items (default `args.eval_num_samples`) with
        the task reward, never the learned one. Returns `eval/turn_1/reward_mean`, ... (see [`MAGRPOTrainer`])."""
        rl = self.rl_trainer
        start = len(rl.state.log_history)
        metrics = rl.evaluate(num_eval_samples)  # the stage trainer evaluates with the task reward
        self.log_history.extend(rl.state.log_history[start:])
        return metrics

    def log(self, logs: dict[str, float]) -> None:
        """Record `logs` in `log_history` (with `env_step`) and send them to the RL stage's callbacks (W&B, ...)."""
        rl = self.rl_trainer
        entry = {**logs, "env_step": rl.env_step}
        self.log_history.append(entry)
        rl.control = rl.callback_handler.on_log(rl.args, rl.state, rl.control, logs=dict(entry))

    # ----- saving -----

    def save_model(self, output_dir: str | None = None) -> None:
        """Export every agent to `output_dir/agent_i/` and the sampling settings to `output_dir/team_settings.json`
        (as [`MAGRPOTrainer.save_model`]); the reward model is not exported (`trainer.reward_model.save_pretrained(...)`
        does that)."""
        self.rl_trainer.save_model(output_dir)


class MARLHFIterTrainer(MARLHFTrainer):
    """
    Iterative MARLHF: `args.num_iterations` times, reload the reward model from its source, collect fresh pairs with
    the current agents, train the reward model on them and run `num_train_epochs` epochs of online RL.

    Arguments are those of [`MARLHFTrainer`], with a [`MARLHFIterConfig`]. Every RL stage starts fresh agent
    optimisers and learning-rate schedules on the current weights.
    """

    config_cls = MARLHFIterConfig
    algorithm_name = "MARLHF-iter"

    @property
    def num_iterations(self) -> int:
        return self.args.num_iterations

    def _rl_num_iterations(self) -> int | None:
        return self.args.rl_num_iterations


def _reward_config(args: MARLHFConfig) -> RewardConfig:
    """TRL's RewardConfig of the reward-model stage. Its output_dir is the run's, which the team trainer creates
    anyway; nothing is saved there (save_strategy "no"), so nothing lands in the working directory."""
    return RewardConfig(
        output_dir=args.output_dir,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        learning_rate=args.reward_learning_rate,
        num_train_epochs=args.reward_num_train_epochs,
        per_device_train_batch_size=args.reward_train_batch_size,
        max_length=args.reward_max_length,
        center_rewards_coefficient=args.reward_center_rewards_coefficient,
        seed=args.seed,
        use_cpu=args.use_cpu,
        bf16=args.bf16,
        fp16=args.fp16,
        gradient_checkpointing=False,
    )


def _output_dir(directory: str | None, resume: str | None, sequence: int) -> str | None:
    """Where preference outputs go: `directory`, or a fresh `resume-N` subdirectory when resuming into files."""
    if directory is None or resume is None or not (os.path.isdir(directory) and os.listdir(directory)):
        return directory
    candidate, n = os.path.join(directory, f"resume-{sequence}"), 1
    while os.path.exists(candidate):
        candidate, n = os.path.join(directory, f"resume-{sequence}-{n}"), n + 1
    return candidate


@contextlib.contextmanager
def _preserved_rng():
    states = (
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
        torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    )
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


def _check_reward_model_device(device: str | None, processes: int) -> None:
    """With several processes an indexed device (`"cuda:1"`) would hold every process's reward model; refuse it."""
    if device is None or processes == 1 or torch.device(device).index is None:
        return
    raise ValueError(
        f"reward_model_device={device!r} with {processes} processes would put every process's reward model on that "
        "one device. Leave reward_model_device=None (each process scores on its own device, the one Accelerate gives "
        f"it), or use {torch.device(device).type!r} without an index (the process's current device) or 'cpu'."
    )


def _validate_inputs(
    args,
    reward_func,
    train_dataset,
    critic_model,
    critics,
    metrics_callback,
    model_config,
    critic_peft_config,
    eval_logger,
    eval_aggregator,
    reward_peft_config,
    joint_formatter,
) -> None:
    if reward_func is None:
        raise ValueError("reward_func is required: the task reward labels the preference pairs and scores evaluation.")
    check_reward_arity(reward_func, args.num_agents)
    if train_dataset is not None and not isinstance(train_dataset, Dataset):
        raise TypeError(
            f"train_dataset must be a datasets.Dataset (pairs are collected over all of it), got "
            f"{type(train_dataset).__name__}."
        )
    check_callable(joint_formatter, "joint_formatter (prompts, completions) -> str")
    if args.save_strategy != "no":
        raise ValueError("MARLHF saves checkpoints through train(checkpoint_dir=...); leave save_strategy='no'.")
    if args.reward_freeze_backbone and reward_peft_config is not None:
        raise ValueError(
            "reward_freeze_backbone=True trains only the reward head, so reward_peft_config has nothing "
            "to adapt; use one or the other."
        )
    ac_only = {
        "critic_model": critic_model,
        "critics": critics,
        "model_config": model_config,
        "critic_peft_config": critic_peft_config,
    }
    given = [name for name, value in ac_only.items() if value is not None]
    if given and not args.uses_actor_critic:
        raise ValueError(f"{', '.join(given)} only apply to rl_algorithm 'iac' or 'maac' (got {args.rl_algorithm!r}).")
    stage = stage_trainer_cls(args)
    owner = f"MARLHF with rl_algorithm={args.rl_algorithm!r}"
    check_metrics_hooks(owner, stage.metrics_hooks, eval_logger, eval_aggregator, metrics_callback)
