"""IAC: independent actor-critic, one critic per agent."""

import copy

from .ac_config import IACConfig
from .ac_trainer import ActorCriticTrainer, _check_same_models, _critic_list
from .critics import ActorValueHeads, SeparateCritics


class IACTrainer(ActorCriticTrainer):
    """
    Trainer for cooperative LLM agents with independent critics (IAC).

    Every agent has its own value function: a separate critic model fed the agent's token ids
    (`args.use_separate_critic=True`), or a value head on the actor's own backbone (`False`). A sample's advantage
    is its value target minus the critic's value (normalised per agent and turn); the actor is updated with TRL's
    clipped policy loss and the critic with the squared value error.

    Every argument after `agent_model` is keyword-only: the shared ones in [`MAGRPOTrainer`]'s order (there is no
    `num_agents`: it is `args.num_agents`), then `critic_model`, `critics`, `critic_peft_config` and `model_config`.

    Args:
        agent_model (`str`, *optional*):
            Model id or local path shared by all `args.num_agents` agents; the tokenizer is loaded from it.
        agents (`list`, *optional*): one model id, path or model per agent.
        tokenizer (`PreTrainedTokenizerBase` or `list`, *optional*):
            One tokenizer or one per agent; required when `agents` is given.
        reward_func (`Callable`):
            `reward_func(agent_0_completions, ..., [batch_items=[item]])`, called once per task item and turn with
            G = `num_generations` completions per agent. Returns G values (one per joint action), N values (one per
            agent) or one value (shared); with G == N the values are read as one per joint action.
        formatters, reward_processor, train_dataset, eval_dataset, external_transition, wandb_config:
            As in [`MAGRPOTrainer`].
        args ([`IACConfig`], *optional*): configuration.
        metrics_callback (`Callable`, *optional*):
            `metrics_callback(list[RolloutSample]) -> dict`: called with every agent's samples of one task item;
            logged at rollout time in training, averaged over items with the `eval/` prefix in evaluation.
            Non-numeric values are dropped.
        eval_logger, eval_aggregator (`Callable`, *optional*):
            Instead of `metrics_callback`: custom evaluation metrics as in [`MAGRPOTrainer`] (evaluation only).
        peft_config, critic_peft_config (`PeftConfig`, *optional*): LoRA for the actors (one or a list) and for the
            separate critics.
        callbacks (`list[TrainerCallback]`, *optional*): TRL/transformers callbacks.
        critic_model (`str` or `PreTrainedModel`, *optional*):
            With separate critics: the critic backbone, copied once per agent.
        critics (`list`, *optional*): with separate critics, one critic model id, path or model per agent.
        model_config (`dict`, *optional*):
            `dtype`/`torch_dtype` and `attn_implementation` (actors and critics), `model_kwargs` (actors only),
            `critic_model_kwargs` (critics only).

    `save_model(dir)` writes `dir/agent_i/` (each actor, with `value_head.pt` when the head is on the actor) and,
    with separate critics, `dir/agent_i/critic/` (a loadable model directory plus `value_head.pt`). Training
    checkpoints restore the heads, the critics and their optimisers; a constructor given saved directories builds
    fresh heads, to be restored with `trainer.agents[i].value_head.load_state_dict(...)` or
    `trainer.critics[i].value_head.load_state_dict(...)`.
    """

    default_config_cls = IACConfig
    algorithm_name = "IAC"
    model_tags = ("trl", "comlrl_trl", "iac")

    def _critic_sources(self, critic_model, critics, n: int, args) -> list:
        if not args.use_separate_critic:
            if critic_model is not None or critics is not None:
                raise ValueError(
                    "use_separate_critic=False puts the value head on each actor's own backbone: leave critic_model "
                    "and critics unset (None), or set use_separate_critic=True."
                )
            return []
        if critics is None:
            if critic_model is None:
                raise ValueError(
                    "use_separate_critic=True needs critic_model (copied for every agent) or critics "
                    f"(one per agent, {n} here)."
                )
            return [critic_model] * n
        sources = _critic_list(critics, "critics")
        if len(sources) != n:
            raise ValueError(f"critics has {len(sources)} entries for {n} agents: pass one critic per agent.")
        if critic_model is not None:
            _check_same_models(critic_model, "critic_model", sources, "critics")
        return sources

    def _build_critics(self, sources, critic_kwargs, critic_peft_config):
        if not self.args.use_separate_critic:
            return ActorValueHeads(self, self.args.value_head_hidden_dim)
        critics = []
        for i, (source, agent) in enumerate(zip(sources, self.agent_trainers)):
            if i > 0 and source is sources[0] and not isinstance(source, str):
                source = copy.deepcopy(source)  # one model object given as critic_model: every agent gets a copy
            critic, _ = self._load_critic(
                source,
                critic_kwargs,
                copy.deepcopy(critic_peft_config),
                self.args.critic_value_head_hidden_dim,
                agent.processing_class,  # critic i reads agent i's token ids
                f"The critic of agent {i}",
            )
            critics.append(critic)
        return SeparateCritics(self, critics)
