"""Configuration of MARLHF: learn a joint reward model from preferences, then train the team against it."""

import copy
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

import torch

from ...algorithms import ACTOR_CRITIC_ALGORITHMS, RL_STAGE_ALGORITHMS, get_algorithm
from ..actor_critic.ac_config import validate_critic_fields
from ..team.config import post_init_with_one_generation
from .preference_config import PreferenceConfig


@dataclass
class MARLHFConfig(PreferenceConfig):
    r"""
    Configuration class for [`MARLHFTrainer`].

    Every [`PreferenceConfig`] and [`MAGRPOConfig`] field keeps its meaning and configures the online RL stage
    (`num_train_epochs`, `num_generations`, `learning_rate`, ...). Only the fields below are new or changed.

    Parameters:
        > Online RL

        num_generations (`int`, *optional*, defaults to `4`):
            Completions per agent per task item in the RL stage: at least 2 for the REINFORCE family (a group
            baseline), at least 1 for `"iac"`/`"maac"` (the critic is the baseline).
        rl_algorithm (`str`, *optional*, defaults to `"magrpo"`):
            The RL stage's algorithm: `"magrpo"`, `"mareinforce"`, `"marloo"`, `"maremax"` (the REINFORCE family,
            which sets `advantage_mode`), `"iac"` or `"maac"` (actor-critic; they use the critic fields below).
        advantage_mode (`str` or `None`, *optional*, defaults to `None`):
            Follows `rl_algorithm`; setting it to a different baseline is an error.

        > Reward model

        reward_model_name (`str` or `None`, *optional*, defaults to `None`):
            Model id or local directory of the reward model's backbone (a causal LM works: a scalar `score` head is
            added). Defaults to the actors' model id; required when the actors are model objects.
        reward_model_device (`str` or `None`, *optional*, defaults to `None`):
            Device the trained reward model scores on during RL (e.g. `"cuda:1"`). `None` keeps it on the trainer's
            device. Training runs on the trainer's device (TRL's `RewardTrainer`). With several processes a device
            with an index is refused (every process's reward model would sit on it).
        reward_learning_rate (`float`, *optional*, defaults to `1e-5`):
            AdamW learning rate of the reward model.
        reward_num_train_epochs (`float`, *optional*, defaults to `1`):
            Epochs over the preference pairs.
        reward_train_batch_size (`int`, *optional*, defaults to `1`):
            Pairs per reward-model step (per device).
        reward_max_length (`int` or `None`, *optional*, defaults to `None`):
            Truncate joint texts to this many tokens, EOS included (every text ends with EOS, as in TRL's
            RewardTrainer), both when training and when scoring. `None`: no truncation.
        reward_freeze_backbone (`bool`, *optional*, defaults to `False`):
            Train only the scalar head.
        reward_center_rewards_coefficient (`float` or `None`, *optional*, defaults to `None`):
            TRL's `center_rewards_coefficient`: adds `coef * mean((r_chosen + r_rejected)^2)` to the loss (0.01 is
            the value TRL recommends).
        reward_use_margin (`bool`, *optional*, defaults to `False`):
            Use the task-reward gap of every pair as TRL's Bradley-Terry margin: −log σ(r_w − r_l − gap).
        preference_output_dir (`str` or `None`, *optional*, defaults to `None`):
            Write every iteration's preference pairs as JSON into this directory. On resume, if it already holds
            files, the resumed run writes into a `resume-<checkpoint>` subdirectory. `None`: not written.

        > Actor-critic back end (`rl_algorithm` `"iac"` or `"maac"`)

        critic_model_name (`str` or `None`, *optional*, defaults to `None`):
            Critic source when the trainer gets no `critic_model`/`critics`; else the actors' model id.
        critic_learning_rate (`float` or `None`, *optional*, defaults to `None`):
            Critic learning rate (`None`: the actors').
        use_separate_critic (`bool`, *optional*, defaults to `True`):
            IAC: one critic model per agent (`True`) or a value head on every actor (`False`).
        critic_type (`str`, *optional*, defaults to `"v"`):
            `"v"` (value of the prompt) or `"q"` (value of prompt and response).
        value_loss_coef (`float`, *optional*, defaults to `0.6`):
            Weight of the value loss.
        value_clip_range (`float` or `None`, *optional*, defaults to `0.2`):
            IAC value clipping with a shared head; `None` disables it.
        critic_value_head_hidden_dim, value_head_hidden_dim (`int` or `None`, *optional*, defaults to `None`):
            Hidden sizes of the separate critics' and of the shared value heads (IAC).
    """

    rl_algorithm: Literal["magrpo", "mareinforce", "marloo", "maremax", "iac", "maac"] = field(
        default="magrpo", metadata={"help": "Online RL algorithm against the learned reward."}
    )
    advantage_mode: Literal["mean", "raw", "max", "rloo"] | None = field(
        default=None, metadata={"help": "Follows rl_algorithm (REINFORCE family)."}
    )
    reward_model_name: str | None = field(
        default=None, metadata={"help": "Reward-model backbone (id or local path); default: the actors' model id."}
    )
    reward_model_device: str | None = field(
        default=None, metadata={"help": "Device of the reward model during RL; None: the trainer's device."}
    )
    reward_learning_rate: float = field(default=1e-5, metadata={"help": "Reward-model learning rate."})
    reward_num_train_epochs: float = field(default=1, metadata={"help": "Reward-model epochs over the pairs."})
    reward_train_batch_size: int = field(default=1, metadata={"help": "Pairs per reward-model step and device."})
    reward_max_length: int | None = field(
        default=None, metadata={"help": "Truncate joint texts to this many tokens (None: no truncation)."}
    )
    reward_freeze_backbone: bool = field(default=False, metadata={"help": "Train only the reward head."})
    reward_center_rewards_coefficient: float | None = field(
        default=None, metadata={"help": "TRL's center_rewards_coefficient for the reward model."}
    )
    reward_use_margin: bool = field(
        default=False, metadata={"help": "Use each pair's task-reward gap as the Bradley-Terry margin."}
    )
    preference_output_dir: str | None = field(
        default=None,
        metadata={"help": "Write the preference pairs of every iteration here (JSON); None: not written."},
    )
    critic_model_name: str | None = field(default=None, metadata={"help": "Critic source for iac/maac."})
    critic_learning_rate: float | None = field(default=None, metadata={"help": "Critic learning rate (iac/maac)."})
    use_separate_critic: bool = field(default=True, metadata={"help": "IAC: separate critic models."})
    critic_type: Literal["v", "q"] = field(default="v", metadata={"help": "Critic target: 'v' or 'q'."})
    value_loss_coef: float = field(default=0.6, metadata={"help": "Value-loss weight (iac/maac)."})
    value_clip_range: float | None = field(default=0.2, metadata={"help": "IAC value clipping; None disables it."})
    critic_value_head_hidden_dim: int | None = field(default=None, metadata={"help": "IAC separate critic head."})
    value_head_hidden_dim: int | None = field(default=None, metadata={"help": "IAC shared value head."})

    def __post_init__(self):
        # The fields set by hand, as given: an actor-critic RL stage builds its own configuration from them.
        self._explicit_fields = _explicit_fields(self)
        self._validate_rl_fields()
        self._validate_reward_fields()
        super().__post_init__()

    @property
    def uses_actor_critic(self) -> bool:
        return self.rl_algorithm in ACTOR_CRITIC_ALGORITHMS

    def explicit_fields(self) -> dict[str, Any]:
        """The fields set when this configuration was created (values as given, before any defaulting)."""
        return dict(self._explicit_fields)

    def _check_num_generations(self):
        if not self.uses_actor_critic:
            return super()._check_num_generations()
        if (
            isinstance(self.num_generations, bool)
            or not isinstance(self.num_generations, int)
            or self.num_generations < 1
        ):
            raise ValueError(
                f"num_generations must be an integer >= 1 with rl_algorithm={self.rl_algorithm!r}, "
                f"got {self.num_generations!r}."
            )

    def _grpo_post_init(self):
        if self.num_generations != 1:
            return super()._grpo_post_init()
        post_init_with_one_generation(self, super()._grpo_post_init)

    def _validate_rl_fields(self):
        if self.rl_algorithm not in RL_STAGE_ALGORITHMS:
            raise ValueError(
                f"rl_algorithm must be one of {', '.join(map(repr, RL_STAGE_ALGORITHMS))}; got {self.rl_algorithm!r}."
            )
        expected = get_algorithm(self.rl_algorithm).advantage_mode or "mean"  # the REINFORCE family's baseline
        if self.advantage_mode is not None and self.advantage_mode != expected:
            raise ValueError(
                f"advantage_mode={self.advantage_mode!r} conflicts with rl_algorithm="
                f"{self.rl_algorithm!r} (which uses {expected!r}); set only rl_algorithm."
            )
        self.advantage_mode = expected
        validate_critic_fields(self)

    def _validate_reward_fields(self):
        for name in ("reward_learning_rate", "reward_num_train_epochs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be > 0 (a finite number), got {value!r}.")
        for name in ("reward_train_batch_size", "reward_max_length"):
            value = getattr(self, name)
            if value is None and name == "reward_max_length":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.reward_max_length is not None and self.reward_max_length < 2:
            raise ValueError(f"reward_max_length must be >= 2 (text and the EOS token), got {self.reward_max_length}.")
        if self.reward_model_device is not None:
            try:
                torch.device(self.reward_model_device)
            except (RuntimeError, TypeError) as error:
                raise ValueError(
                    f"reward_model_device={self.reward_model_device!r} is not a torch device "
                    "(e.g. 'cpu', 'cuda:1'); None uses the trainer's device."
                ) from error


@dataclass
class MARLHFIterConfig(MARLHFConfig):
    r"""
    Configuration class for [`MARLHFIterTrainer`]: [`MARLHFConfig`] repeated for `num_iterations` iterations.

    Every iteration reloads the reward model from `reward_model_name`, collects fresh pairs with the current
    agents, trains the reward model on them and runs `num_train_epochs` epochs of online RL.

    Parameters:
        num_iterations (`int`, *optional*, defaults to `6`):
            Preference iterations of the whole run (a resumed run counts the completed ones; it may be increased
            on resume). Unlike in TRL's `GRPOConfig`, this is not GRPO's μ: that is `rl_num_iterations`.
        rl_num_iterations (`int`, *optional*, defaults to `1`):
            TRL's GRPO μ in the RL stage: optimisation passes over every generation batch.

    Defaults that differ from [`MARLHFConfig`]: `num_train_epochs=2`, `preference_num_candidates=20`,
    `preference_pairs_per_sample=4`, `reward_num_train_epochs=2`.
    """

    num_iterations: int = field(default=6, metadata={"help": "Preference iterations of the whole run (>= 1)."})
    rl_num_iterations: int = field(default=1, metadata={"help": "GRPO's mu in the RL stage."})
    num_train_epochs: float = field(default=2, metadata={"help": "RL epochs per iteration."})
    preference_num_candidates: int = field(default=20, metadata={"help": "Joint candidates per task item (>= 2)."})
    preference_pairs_per_sample: int | None = field(default=4, metadata={"help": "Maximum pairs per task item."})
    reward_num_train_epochs: float = field(default=2, metadata={"help": "Reward-model epochs per iteration."})

    def __post_init__(self):
        for name in ("num_iterations", "rl_num_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        super().__post_init__()


def _explicit_fields(config) -> dict[str, Any]:
    explicit = {}
    for f in fields(config):
        if not f.init:
            continue
        default = (
            f.default
            if f.default is not MISSING
            else (f.default_factory() if f.default_factory is not MISSING else MISSING)
        )
        value = getattr(config, f.name)
        if default is MISSING or value != default:
            explicit[f.name] = copy.deepcopy(value)
    return explicit
