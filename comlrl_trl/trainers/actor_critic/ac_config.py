"""Configuration of the actor-critic trainers: IAC (a critic per agent) and MAAC (one centralised critic)."""

from dataclasses import dataclass, field
from typing import Literal

from ..team.config import TeamConfig, post_init_with_one_generation


_MIN_SAMPLES_PER_STEP = 8


@dataclass
class ActorCriticConfig(TeamConfig):
    r"""
    Fields shared by [`IACConfig`] and [`MAACConfig`]. Every [`MAGRPOConfig`] field keeps its meaning except
    `advantage_mode`, which is unused: the baseline is the critic's value.

    Parameters:
        num_generations (`int`, *optional*, defaults to `1`):
            Responses per agent per task item (G). The critic is the baseline, so one is enough; with several, each
            is a joint action of its own (joint_mode `"align"` only).
        per_device_train_batch_size (`int` or `None`, *optional*, defaults to `None`):
            Samples per agent per device and micro-step. `None` means the smallest multiple of `num_generations`
            that is at least 8: advantages are normalised over an agent's samples of a turn, which needs a batch.
        critic_type (`str`, *optional*, defaults to `"v"`):
            `"v"` values the prompt (read at its last token); `"q"` values the prompt with the response (read at
            the last response token). Case-insensitive.
        critic_learning_rate (`float` or `None`, *optional*, defaults to `None`):
            Learning rate of the critics' own AdamW optimisers (constant). `None` uses `learning_rate`.
        value_loss_coef (`float`, *optional*, defaults to `0.6`):
            Weight of the squared value error.
        value_clip_range (`float` or `None`, *optional*, defaults to `0.2`):
            PPO-style value clipping around the rollout-time values. It bites when a rollout is used for several
            updates (`num_iterations` or `steps_per_generation` > 1). `None` disables it.
        advantage_normalization (`bool` or `None`, *optional*, defaults to `None`, i.e. on):
            Whether the advantages `target - V` are centred and scaled (population std) over each agent's samples
            of one turn in one rollout.
        discount (`float`, *optional*, defaults to `1.0`):
            Gamma in the TD targets `r_t + gamma * V(s_{t+1})` of multi-turn episodes.

    The value target of a sample is its reward at the last turn of an episode, and `r_t + gamma * V(s_{t+1})`
    before it, where `V(s_{t+1})` is the critic's rollout-time value of the next turn's state (the mean over
    its G samples). Rewards may come as 1, G or N values per task item (see the trainers).
    """

    num_generations: int | None = field(default=1, metadata={"help": "Responses per agent per task item (G)."})
    critic_type: Literal["v", "q"] = field(default="v", metadata={"help": "'v': V(prompt); 'q': Q(prompt, response)."})
    critic_learning_rate: float | None = field(
        default=None, metadata={"help": "Critic AdamW learning rate (constant); None: learning_rate."}
    )
    value_loss_coef: float = field(default=0.6, metadata={"help": "Weight of the squared value error."})
    value_clip_range: float | None = field(
        default=0.2, metadata={"help": "Clip values to +-this around the rollout-time values; None: no clipping."}
    )

    def __post_init__(self):
        if isinstance(self.critic_type, str):
            self.critic_type = self.critic_type.lower()
        validate_critic_fields(self)
        if self.joint_mode != "align":
            raise ValueError("Actor-critic trainers value aligned joint actions only: set joint_mode='align'.")
        super().__post_init__()
        if self.critic_learning_rate is None:
            self.critic_learning_rate = self.learning_rate

    def _check_num_generations(self):
        if (
            isinstance(self.num_generations, bool)
            or not isinstance(self.num_generations, int)
            or self.num_generations < 1
        ):
            raise ValueError(f"num_generations must be an integer >= 1, got {self.num_generations!r}.")

    _default_generation_spans_updates = False  # the critics train on each generation's samples on-policy

    def _default_batch_size(self) -> int:
        g = self.num_generations
        return g * -(-_MIN_SAMPLES_PER_STEP // g)

    def _grpo_post_init(self):
        if self.num_generations != 1:
            return super()._grpo_post_init()
        post_init_with_one_generation(self, super()._grpo_post_init)


@dataclass
class IACConfig(ActorCriticConfig):
    r"""
    Configuration class for [`IACTrainer`]: independent actor-critic, one critic per agent.

    Parameters:
        use_separate_critic (`bool`, *optional*, defaults to `True`):
            `True`: every agent has a critic model of its own (`critic_model` copied per agent, or `critics`), fed
            its actor's token ids and trained by its own optimiser. `False`: every actor carries a value head on
            its own backbone; the value loss joins the policy loss (one forward and backward pass).
        value_head_hidden_dim (`int` or `None`, *optional*, defaults to `None`):
            Hidden layer of the value heads on the actors (`use_separate_critic=False`); `None`: a linear head.
        critic_value_head_hidden_dim (`int` or `None`, *optional*, defaults to `None`):
            Hidden layer of the separate critics' value heads; `None`: a linear head.

    See [`ActorCriticConfig`] for the shared fields.
    """

    use_separate_critic: bool = field(
        default=True, metadata={"help": "A critic model per agent (else a head on the actor)."}
    )
    value_head_hidden_dim: int | None = field(
        default=None, metadata={"help": "Hidden layer of the actors' value heads."}
    )
    critic_value_head_hidden_dim: int | None = field(
        default=None, metadata={"help": "Hidden layer of the separate critics' value heads."}
    )

    def __post_init__(self):
        for name in ("value_head_hidden_dim", "critic_value_head_hidden_dim"):
            _check_hidden_dim(name, getattr(self, name))
        super().__post_init__()


@dataclass
class MAACConfig(ActorCriticConfig):
    r"""
    Configuration class for [`MAACTrainer`]: multi-agent actor-critic with one centralised critic that sees every
    agent's prompt (and, for `critic_type="q"`, every response). Its value-head size is set through the trainer's
    `model_config={"critic_value_head_hidden_dim": ...}`. See [`ActorCriticConfig`] for the fields.
    """


def validate_critic_fields(config) -> None:
    """The critic settings shared by the actor-critic configs and MARLHF's actor-critic back end."""
    if config.critic_type not in ("v", "q"):
        raise ValueError(
            f"critic_type must be 'v' or 'q' (the value of the prompt, or of prompt and response), got "
            f"{config.critic_type!r}."
        )
    if not config.value_loss_coef > 0:
        raise ValueError(f"value_loss_coef must be > 0, got {config.value_loss_coef!r}.")
    if config.value_clip_range is not None and not config.value_clip_range > 0:
        raise ValueError(f"value_clip_range must be > 0 or None (no clipping), got {config.value_clip_range!r}.")
    if config.critic_learning_rate is not None and not config.critic_learning_rate > 0:
        raise ValueError(
            f"critic_learning_rate must be > 0 or None (use learning_rate), got {config.critic_learning_rate!r}."
        )


def _check_hidden_dim(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive integer or None (a linear head), got {value!r}.")
