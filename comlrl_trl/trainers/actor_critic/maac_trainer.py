"""MAAC: multi-agent actor-critic with one centralised critic."""

from .ac_config import MAACConfig
from .ac_trainer import ActorCriticTrainer, _check_same_models, _critic_list
from .critics import JointCritic


class MAACTrainer(ActorCriticTrainer):
    """
    Trainer for cooperative LLM agents with one centralised critic (MAAC).

    The critic is a causal LM with a value head that reads the joint text of the team (every agent's prompt, and
    with `critic_type="q"` every response, each decoded by its own agent's tokenizer; the layout is
    `comlrl_trl.joint_text.joint_text`), encoded with the critic's own tokenizer (loaded from the critic's model id
    or directory, or from a model object's `name_or_path`), so agents with different tokenizers share one critic.
    Each joint sample trains the critic once; every agent's advantage is its value target minus the joint value.

    Arguments are those of [`IACTrainer`], except that `critic_model` or a one-element `critics` list gives the
    single critic (always required), and `model_config` also takes `critic_value_head_hidden_dim`.

    `save_model(dir)` writes `dir/agent_i/` for the actors and `dir/critic/` (a loadable model directory, the critic's
    tokenizer and `value_head.pt`). Restore a saved head after construction with
    `trainer.critics[0].value_head.load_state_dict(torch.load(dir / "critic" / "value_head.pt"))`.
    """

    default_config_cls = MAACConfig
    algorithm_name = "MAAC"
    model_tags = ("trl", "comlrl_trl", "maac")
    _extra_model_config_keys = ("critic_value_head_hidden_dim",)

    def _critic_sources(self, critic_model, critics, n: int, args) -> list:
        if critics is None:
            if critic_model is None:
                raise ValueError(
                    "MAACTrainer needs one centralised critic: pass critic_model=... or critics=[...] with one entry."
                )
            return [critic_model]
        sources = _critic_list(critics, "critics")
        if len(sources) != 1:
            raise ValueError(
                f"MAACTrainer has one centralised critic, but critics has {len(sources)} entries; pass "
                "a one-element list or critic_model."
            )
        if critic_model is not None:
            _check_same_models(critic_model, "critic_model", sources, "critics")
        return sources

    def _build_critics(self, sources, critic_kwargs, critic_peft_config):
        hidden_dim = self._model_config.get("critic_value_head_hidden_dim")
        if hidden_dim is not None and (
            isinstance(hidden_dim, bool) or not isinstance(hidden_dim, int) or hidden_dim < 1
        ):
            raise ValueError(
                f"model_config['critic_value_head_hidden_dim'] must be a positive integer, got {hidden_dim!r}."
            )
        critic, tokenizer = self._load_critic(
            sources[0], critic_kwargs, critic_peft_config, hidden_dim, None, "The centralised critic"
        )  # None: the critic's own tokenizer, not any agent's (the joint text is a string, re-tokenised for it)
        return JointCritic(self, critic, tokenizer)
