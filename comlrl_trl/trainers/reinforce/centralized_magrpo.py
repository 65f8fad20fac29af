"""Centralised MAGRPO: one joint policy writes every role's output (CoMLRL's `CentralizedMAGRPOTrainer`).

It is the MAGRPO team loop with a team of one: the policy gets one prompt built by a `centralized_adapter` from
every role's formatted prompt, samples K joint completions per task item, the adapter splits each into the roles'
outputs, and the joint reward scores them as it scores N agents' completions. Advantages, TRL's loss, logging,
evaluation and checkpoints are MAGRPO's.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Unpack

from ...centralized import CentralizedCollaboration, TaggedCentralizedComparatorAdapter
from ...checkpoint import stateful_objects
from ..team.inputs import TeamKwargs, team_init, team_inputs
from .magrpo_config import MAGRPOConfig
from .magrpo_trainer import MAGRPOTrainer


@dataclass
class CentralizedMAGRPOConfig(MAGRPOConfig):
    r"""
    Configuration class for [`CentralizedMAGRPOTrainer`]. Every [`MAGRPOConfig`] field keeps its meaning, except:

    Parameters:
        num_agents (`int`, *optional*, defaults to `2`):
            The number of roles the joint policy writes for (one policy is trained).
        num_turns (`int`, *optional*, defaults to `1`):
            Must be 1: centralised episodes are single-turn.

    `agent_overrides` is refused (there is one policy: set its values on the configuration).
    """

    def __post_init__(self):
        if self.num_turns != 1:
            raise ValueError(f"CentralizedMAGRPOConfig supports num_turns=1 only, got {self.num_turns}.")
        if self.agent_overrides is not None:
            raise ValueError(
                "CentralizedMAGRPOConfig trains one policy: set its learning rate and sampling values on "
                "the configuration, not in agent_overrides."
            )
        super().__post_init__()


class CentralizedMAGRPOTrainer(MAGRPOTrainer):
    """
    Trains one joint policy that writes the outputs of `num_agents` roles in one completion.

    Args:
        agent_model, agents, tokenizer:
            The one policy: a model id/path or `agents=[one model]`, and one tokenizer (or a one-element list).
        num_agents (`int`, *optional*):
            Number of roles; must equal `args.num_agents`.
        formatters:
            The roles' formatters (one for all or one per role), whose prompts the adapter joins.
        reward_func:
            The roles' joint reward, called as for a team of `num_agents` agents: once per task item with one list
            per role (position j: the outputs parsed from joint completion j), returning one reward per completion.
        eval_logger, eval_aggregator:
            As in [`MAGRPOTrainer`]; the logger gets the role outputs (`[role][item][turn]`).
        centralized_adapter (*optional*):
            `build_prompt(item, role_prompts) -> str` and `parse_completion(completion, item, num_roles) -> list[str]`;
            defaults to [`TaggedCentralizedComparatorAdapter`] (`<agent_i>...</agent_i>` sections). A completion it
            cannot parse (`CentralizedComparatorParseError`) gives every role `""`.

    Every argument is keyword-only; the others are [`MAGRPOTrainer`]'s. `trainer.args` is the one policy's
    configuration (`num_agents=1`); `trainer.num_roles` is the role count.
    """

    default_config_cls = CentralizedMAGRPOConfig
    model_tags = (*MAGRPOTrainer.model_tags, "centralized")

    @team_init(shown_kwargs=True)  # CoMLRL's signature: keyword-only, ending in **kwargs
    def __init__(self, *, agent_model=None, centralized_adapter=None, **team_kwargs: Unpack[TeamKwargs]):
        inputs = team_inputs(team_kwargs)
        num_agents, args = inputs["num_agents"], inputs["args"]
        agents, tokenizer, reward_func = inputs["agents"], inputs["tokenizer"], inputs["reward_func"]
        roles = num_agents if num_agents is not None else (args.num_agents if args is not None else 2)
        if args is None:
            args = self.default_config_cls(num_agents=roles)
        if not isinstance(args, CentralizedMAGRPOConfig):
            raise TypeError(f"args must be a CentralizedMAGRPOConfig, got {type(args).__name__}.")
        if roles != args.num_agents:
            raise ValueError(f"num_agents={roles} must equal args.num_agents={args.num_agents} (the role count).")
        if agents is not None and len(agents) != 1:
            raise ValueError(
                f"Centralised MAGRPO trains one joint policy: agents must hold one model, got {len(agents)}."
            )
        if isinstance(tokenizer, (list, tuple)) and len(tokenizer) != 1:
            raise ValueError(f"Centralised MAGRPO has one policy: pass one tokenizer, got {len(tokenizer)}.")
        if reward_func is None:
            raise ValueError("reward_func is required: a callable returning one reward per joint completion.")
        adapter = centralized_adapter if centralized_adapter is not None else TaggedCentralizedComparatorAdapter()
        self.collaboration = CentralizedCollaboration(adapter, inputs["formatters"], reward_func, roles)
        self.num_roles = roles
        policy_args = copy.deepcopy(args)  # a copy, not a new instance: that would reset Accelerate's state
        policy_args.num_agents = 1
        super().__init__(
            agent_model,
            **{
                **team_kwargs,
                "num_agents": 1,
                "formatters": self.collaboration.build_prompt,
                "reward_func": self.collaboration,
                "args": policy_args,
                "eval_logger": self._role_eval_logger(inputs["eval_logger"]),
            },
        )

    def _role_eval_logger(self, eval_logger: Callable | None) -> Callable | None:
        if eval_logger is None:
            return None

        def role_eval_logger(*, agent_completions_turns, batch_items, prompts):
            roles = self.collaboration.split_turns(agent_completions_turns, batch_items)
            return eval_logger(agent_completions_turns=roles, batch_items=batch_items, prompts=prompts)

        return role_eval_logger

    def _run_config(self) -> dict[str, Any]:
        return {**super()._run_config(), "collaboration_mode": "centralized", "num_roles": self.num_roles}

    def stateful_objects(self) -> dict[str, Any]:
        objects = super().stateful_objects()
        candidates = {
            "role_reward_func": self.collaboration.reward_func,
            "centralized_adapter": self.collaboration.adapter,
            **{f"role_formatter_{i}": f for i, f in enumerate(self.collaboration.formatters)},
        }
        objects.update(stateful_objects(candidates))
        return objects
