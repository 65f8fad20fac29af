"""Configuration of MADPO: joint direct preference optimisation of a team of agents."""

import math
from dataclasses import dataclass, field

from .preference_config import PreferenceConfig


@dataclass
class MADPOConfig(PreferenceConfig):
    r"""
    Configuration class for [`MADPOTrainer`].

    Every [`PreferenceConfig`] and [`MAGRPOConfig`] field keeps its meaning; only the fields below are new or
    changed. Every generation step samples `preference_num_candidates` joint candidates per task item with the
    current agents, ranks them with the task reward and trains every agent on the resulting pairs.

    Parameters:
        dpo_beta (`float`, *optional*, defaults to `0.1`):
            β of the DPO loss −log σ(β Σ_i Δ_i), where Δ_i is agent i's log-ratio of the chosen over the rejected
            response (minus the reference's, with `use_reference_model`). Must be > 0.
        use_reference_model (`bool`, *optional*, defaults to `False`):
            Subtract a frozen reference model's log-ratio (the agent's initial weights; with LoRA, the agent with
            its adapter disabled, as in TRL). `False` is reference-free DPO.
        num_generations (`int` or `None`, *optional*, defaults to `None`):
            TRL's group size; here it is always `preference_num_candidates` (leave it unset or equal).
        beta (`float`, *optional*):
            Set by the configuration, never by hand: `dpo_beta` with a reference model (so that TRL loads one per
            agent) and `0.0` without. The GRPO KL penalty is not used by MADPO.

    Policy log-probabilities are sums over completion tokens at temperature 1 (the sampling temperature only shapes
    exploration). The other agents' log-ratios in agent i's loss are computed with the weights of the generation step
    and held fixed.
    """

    dpo_beta: float = field(default=0.1, metadata={"help": "Beta of the joint DPO loss (> 0)."})
    use_reference_model: bool = field(
        default=False, metadata={"help": "Subtract a frozen reference model's log-ratio (reference-free if False)."}
    )
    num_generations: int | None = field(
        default=None, metadata={"help": "Always preference_num_candidates (candidates per task item)."}
    )
    logprob_temperature: float | None = field(
        default=1.0, metadata={"help": "Always 1.0: the DPO loss uses log-probabilities at temperature 1."}
    )

    def __post_init__(self):
        if (
            isinstance(self.dpo_beta, bool)
            or not isinstance(self.dpo_beta, (int, float))
            or not 0 < self.dpo_beta < math.inf
        ):
            raise ValueError(f"dpo_beta must be a number > 0 (finite), got {self.dpo_beta!r}.")
        if self.num_generations is not None and self.num_generations != self.preference_num_candidates:
            raise ValueError(
                f"num_generations={self.num_generations} differs from preference_num_candidates="
                f"{self.preference_num_candidates}; in MADPO they are the same number (candidates per task item): "
                "set preference_num_candidates only."
            )
        self.num_generations = self.preference_num_candidates
        reference_beta = float(self.dpo_beta) if self.use_reference_model else 0.0
        if self.beta not in (0.0, reference_beta):
            raise ValueError(
                f"beta={self.beta} is TRL's GRPO KL coefficient, which MADPO does not use; leave it unset. Set dpo_beta "
                "for the DPO temperature and use_reference_model=True for a reference model."
            )
        self.beta = reference_beta  # TRL's GRPOTrainer loads a reference model per agent iff beta != 0
        if self.logprob_temperature != 1.0:
            raise ValueError(
                f"logprob_temperature={self.logprob_temperature!r}: MADPO's loss always uses log-probabilities at "
                "temperature 1 (the sampling temperature only shapes exploration); leave logprob_temperature at 1.0."
            )
        super().__post_init__()
