"""The lean CPU generator: the speed-ups of `comlrl_trl.fast` around each agent's sampling on a CPU.

Where the lean decoding loop applies to every agent (`LeanCpuGeneration.unavailable`), with `joint_generation` the
agents' rows are decoded in one loop, each row through its own agent's weights (`fast/joint_decoding.py`). TRL's side
stays each agent's own: its tokenisation (with our truncation) and, from the sampled tokens on, its `_generate`
(`adapters/generation.py`). Elsewhere each agent generates in its own TRL call, with the speed-ups that apply to it.
"""

import logging
from contextlib import ExitStack, contextmanager
from functools import partial

from ..adapters.generation import (
    left_padded,
    model_for_generation,
    pad_token_id,
    prompt_token_ids,
    rollout_from_tokens,
)
from ..adapters.grpo import Rollout
from ..fast.call_overheads import fewer_fixed_costs
from ..fast.decoding import JointDecodingUnavailable, lean_decoding, lean_decoding_applies
from ..fast.joint_decoding import SharedWeights, team_view, until_eos, weight_dtypes
from ..fast.multinomial import sparse_sampling
from ..fast.packed_linear import packed_linear_weights
from ..fast.top_k_top_p import fused_top_k_top_p
from ..loading import architecture, base_model


logger = logging.getLogger(__name__)


@contextmanager
def speedups(agent, rows: int, team=None):
    """The CPU speed-ups around one `generate` call of `agent`'s model for `rows` rows (entered inside the agent's
    `generation_contexts`); `team`: the team's view, for one loop over every agent's rows."""
    with (
        fewer_fixed_costs(),
        packed_linear_weights(
            agent.model,
            rows=rows,
            fp16_weights=agent.args.cpu_fp16_generation_weights,
            new_tokens=agent.max_completion_length,
        ),
        fused_top_k_top_p(),
        sparse_sampling(),
        lean_decoding(agent.model, team),
    ):
        yield


class LeanCpuGeneration:
    """Every agent's completions on a CPU: one joint decoding loop where it applies, else one call per agent."""

    def __init__(self, agents: list):
        self.agents = agents
        self.shared = SharedWeights()
        self._told = False

    def __call__(self, prompts: list[list]) -> list[Rollout]:
        """`prompts[a]`: agent `a`'s prompts; its `Rollout`, in agent order."""
        reason = self.unavailable()
        if reason is None:
            try:
                return self._joint(prompts)
            except JointDecodingUnavailable as error:
                reason = str(error)
        if not self._told:
            self._told = True
            logger.info("The agents generate one after the other: %s.", reason)
        return [self._own_call(agent, p) for agent, p in zip(self.agents, prompts, strict=True)]

    @staticmethod
    def _own_call(agent, prompts: list) -> Rollout:
        if agent.use_vllm or agent.accelerator.device.type != "cpu":
            return agent.generate(prompts)
        return agent.generate(prompts, speedups=partial(speedups, agent))

    def unavailable(self) -> str | None:
        """Why the team cannot decode in one loop, or None where it can."""
        agents = self.agents
        first = agents[0]
        if len(agents) < 2:
            return "one agent"
        if not first.args.joint_generation:
            return "joint_generation=False"
        if any(agent.use_vllm or agent.accelerator.device.type != "cpu" for agent in agents):
            return "not every agent generates with transformers on a CPU"
        if any(agent.is_deepspeed_enabled or agent.is_fsdp_enabled for agent in agents):
            return "DeepSpeed and FSDP gather each agent's parameters for its own call"
        if any(agent.rollout_func is not None or agent.tools for agent in agents):
            return "an agent has its own rollout function or tools"
        models = [base_model(agent.model) for agent in agents]
        if not all(lean_decoding_applies(model) for model in models):
            return "not every agent's model is one the lean decoding loop runs (Llama or Qwen2, SDPA, no hooks)"
        first_architecture, first_dtypes = architecture(models[0]), weight_dtypes(models[0])
        if any(architecture(model) != first_architecture for model in models[1:]):
            return "the agents' models have different architectures"
        if any(weight_dtypes(model) != first_dtypes for model in models[1:]):
            return "the agents' weights have different dtypes"
        settings = [(a.generation_config.to_dict(), a.generation_kwargs, a.eos_token_ids) for a in agents]
        if any(setting != settings[0] for setting in settings):
            return "the agents sample with different settings"
        return None

    def _joint(self, prompts: list[list]) -> list[Rollout]:
        agents, first = self.agents, self.agents[0]
        prompt_ids = []
        for agent, agent_prompts in zip(agents, prompts, strict=True):
            ids = prompt_token_ids(agent, agent_prompts)
            if ids is None:
                raise JointDecodingUnavailable("the prompts hold images")
            prompt_ids.append(ids)
        sizes = [len(ids) for ids in prompt_ids]
        view = team_view([base_model(agent.model) for agent in agents], sizes, self.shared)
        rows = [ids for agent_ids in prompt_ids for ids in agent_ids]
        input_ids, mask = left_padded(rows, pad_token_id(first), first.accelerator.device)
        with ExitStack() as stack:
            for a, agent in enumerate(agents):
                stack.enter_context(agent.generation_contexts())
                stack.enter_context(speedups(agent, sizes[a], team=view if a == 0 else None))
            model = stack.enter_context(model_for_generation(first))
            sequences = model.generate(
                input_ids=input_ids, attention_mask=mask, generation_config=first.generation_config
            )
        new_tokens = sequences[:, input_ids.shape[1] :].cpu().split(sizes)
        return [
            rollout_from_tokens(agent, agent_prompts, ids, until_eos(tokens, agent.eos_token_ids))
            for agent, agent_prompts, ids, tokens in zip(agents, prompts, prompt_ids, new_tokens, strict=True)
        ]
