"""The generation seam: what the rollout orchestrator calls to sample every agent's completions.

A `TeamGenerator` takes one list of prompts per agent and returns one `Rollout` per agent, in agent order. The
orchestrator is handed one (`team_generator` picks it from the configuration) and knows nothing of how it samples:

- `PerAgentGeneration`: each agent's own TRL generation, one call per agent: transformers' `generate`, or TRL's
  `rollout_func` where the agent generates through the team's vLLM engines (colocated or a server,
  `AgentGRPOTrainer.use_generation_engines`). Only the training precision and `no_grad` around it.
- `LeanCpuGeneration` (`comlrl_trl.generation.cpu`): our own decoding loop with the CPU speed-ups of
  `comlrl_trl.fast`, every agent's rows in one loop where it applies (`joint_generation`), each agent's own loop
  or, where the loop does not apply, its own TRL call with nothing replaced.
"""

from typing import TYPE_CHECKING, Protocol

from ..adapters.grpo import Rollout


if TYPE_CHECKING:
    from ..trainers.team.config import TeamConfig


GENERATION_BACKENDS = ("auto", "transformers", "cpu")


class TeamGenerator(Protocol):
    """Samples one completion per prompt for every agent: `prompts[a]` are agent `a`'s prompts."""

    def __call__(self, prompts: list[list]) -> list[Rollout]: ...


class PerAgentGeneration:
    """Every agent's own TRL generation (transformers' `generate`, or its vLLM `rollout_func`), one after the other."""

    def __init__(self, agents: list):
        self.agents = agents

    def __call__(self, prompts: list[list]) -> list[Rollout]:
        return [agent.generate(agent_prompts) for agent, agent_prompts in zip(self.agents, prompts, strict=True)]


def team_generator(agents: list, args: "TeamConfig") -> TeamGenerator:
    """The generator `args.generation_backend` asks for.

    - "transformers": `PerAgentGeneration`.
    - "cpu": `LeanCpuGeneration`; a `ValueError` where the agents do not generate with transformers on a CPU.
    - "auto": `LeanCpuGeneration` where every agent generates with transformers on a CPU (it falls back to each
      agent's own call where its lean loop does not apply, and when the agents take the team's vLLM engines
      later), else `PerAgentGeneration`.
    """
    backend = args.generation_backend
    if backend not in GENERATION_BACKENDS:
        raise ValueError(
            f"generation_backend must be one of {', '.join(map(repr, GENERATION_BACKENDS))}; got {backend!r}."
        )
    if backend == "transformers":
        return PerAgentGeneration(agents)
    on_cpu = all(not agent.use_vllm and agent.accelerator.device.type == "cpu" for agent in agents)
    if backend == "cpu" and not on_cpu:
        raise ValueError(
            "generation_backend='cpu' needs every agent to generate with transformers on a CPU; set "
            "generation_backend='auto' (or 'transformers') for GPUs and vLLM."
        )
    if not on_cpu:
        return PerAgentGeneration(agents)
    from .cpu import LeanCpuGeneration  # the CPU speed-ups are imported only where they may run

    return LeanCpuGeneration(agents, joint=args.joint_generation)
