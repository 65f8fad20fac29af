"""MAGRPO (multi-agent group relative policy optimisation) and its REINFORCE variants on the team loop.

Each is a [`TeamTrainer`] (comlrl_trl/trainers/team) with its configuration class and baseline: the group-relative
advantages themselves are in `comlrl_trl/core/advantages.py`.
"""

from ..team.trainer import TeamTrainer
from .magrpo_config import MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig


class MAGRPOTrainer(TeamTrainer):
    """
    Trainer for cooperative LLM agents with one joint reward ([MAGRPO](https://huggingface.co/papers/2508.04652)).

    Every training step samples K completions per agent per task item (one batched `generate` per agent), scores
    the joint actions with `reward_func`, gives every completion a group-relative advantage per agent and updates
    every agent with TRL's GRPO loss.

    Every argument after `agent_model` is keyword-only, in the order every team trainer shares (IAC/MAAC, MADPO and
    MARLHF add theirs after `callbacks`).

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
        metrics_callback (`Callable`, *optional*):
            The actor-critic trainers' hook (`metrics_callback(rollouts)`); this trainer refuses it with a
            TypeError that names `eval_logger`/`eval_aggregator`.
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
    algorithm_name = "MAGRPO"
    model_tags = ("trl", "grpo", "comlrl_trl", "magrpo")


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
