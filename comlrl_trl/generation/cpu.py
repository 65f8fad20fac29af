"""The lean CPU generator: every agent's completions sampled by our own decoding loop (`fast/decoding.py`).

Where the lean loop applies to an agent (`LeanCpuGeneration.agent_unavailable`), its completions are sampled by
`lean_generate` over its model's modules, with the speed-ups of `comlrl_trl.fast` called as functions: the fused
top-k/top-p filter, the sparse multinomial draw, and its linear layers packed for the call (`packed_linear`). Where it
applies to every agent (`LeanCpuGeneration.unavailable`), with `joint_generation` the agents' rows are decoded in one
loop, each row through its own agent's weights (`fast/joint_decoding.py`). TRL's side stays each agent's own: its
tokenisation (with our truncation) and left padding, and, from the sampled tokens on, its `_generate`
(`adapters/generation.py`). Elsewhere (vLLM, another device, DeepSpeed or FSDP, other models or settings) each agent
generates through its own TRL call, transformers' `generate`, with nothing replaced. Nothing of torch,
transformers, Accelerate or TRL is replaced in either case.
"""

import logging
from contextlib import ExitStack

from ..adapters.generation import left_padded, pad_token_id, prompt_token_ids, rollout_from_tokens
from ..adapters.grpo import Rollout
from ..fast.decoding import LeanDecodingUnavailable, lean_decoding_applies, lean_generate, sampling_config
from ..fast.joint_decoding import SharedWeights, team_view, until_eos, weight_dtypes
from ..fast.packed_linear import packed_linear_weights
from ..loading import architecture, base_model


logger = logging.getLogger(__name__)


def _model_unavailable(agent) -> str | None:
    """Why the lean loop cannot run `agent`'s model where TRL would generate with it, or None where it can."""
    if agent.use_vllm or agent.accelerator.device.type != "cpu":
        return "it does not generate with transformers on a CPU"
    if agent.is_deepspeed_enabled or agent.is_fsdp_enabled:
        return "DeepSpeed and FSDP gather its parameters for TRL's own call"
    if agent.rollout_func is not None or agent.tools:
        return "it has its own rollout function or tools"
    if not lean_decoding_applies(base_model(agent.model)):
        return "its model is not one the lean decoding loop runs (Llama or Qwen2, SDPA, no hooks)"
    return None


def _lean_config(agent):
    """`sampling_config` of `agent`'s settings for its model; `LeanDecodingUnavailable` where the lean loop does not
    sample its completions."""
    reason = _model_unavailable(agent)
    if reason is not None:
        raise LeanDecodingUnavailable(reason)
    return sampling_config(base_model(agent.model), agent.generation_config)


def packed_weights(agent, rows: int):
    """The block in which `agent`'s linear layers run packed for one call of `rows` rows (entered inside the agent's
    `generation_contexts`, `fast/packed_linear.py`)."""
    return packed_linear_weights(
        agent.model,
        rows=rows,
        fp16_weights=agent.args.cpu_fp16_generation_weights,
        new_tokens=agent.max_completion_length,
    )


class LeanCpuGeneration:
    """Every agent's completions on a CPU: one joint decoding loop where it applies, else one loop per agent, else
    the agent's own TRL call."""

    def __init__(self, agents: list, joint: bool = True):
        self.agents = agents
        self.joint = joint  # the team's `joint_generation`: every agent's rows in one loop where it applies
        self.shared = SharedWeights()
        self._told: set[str] = set()

    def __call__(self, prompts: list[list]) -> list[Rollout]:
        """`prompts[a]`: agent `a`'s prompts; its `Rollout`, in agent order."""
        try:
            return self._joint(prompts, self._team_config())
        except LeanDecodingUnavailable as error:
            self._tell(f"The agents generate one after the other: {error}.")
        return [self._own_call(agent, p) for agent, p in zip(self.agents, prompts, strict=True)]

    def _tell(self, message: str) -> None:
        if message not in self._told:
            self._told.add(message)
            logger.info(message)

    @staticmethod
    def agent_unavailable(agent) -> str | None:
        """Why `agent`'s completions cannot come from the lean decoding loop, or None where they can."""
        try:
            _lean_config(agent)
        except LeanDecodingUnavailable as error:
            return str(error)
        return None

    def _own_call(self, agent, prompts: list) -> Rollout:
        """One agent's completions: the lean loop where it applies, else TRL's own call (transformers' `generate`)."""
        try:
            config = _lean_config(agent)
            ids = prompt_token_ids(agent, prompts)
            if ids is None:
                raise LeanDecodingUnavailable("the prompts hold images")
        except LeanDecodingUnavailable as error:
            self._tell(f"Agent {agent.agent_index} generates with TRL's own call: {error}.")
            return agent.generate(prompts)
        input_ids, mask = left_padded(ids, pad_token_id(agent), agent.accelerator.device, agent.pad_to_multiple_of)
        with agent.generation_contexts(), packed_weights(agent, len(ids)):
            sequences = lean_generate(base_model(agent.model), input_ids, mask, config)
        tokens = sequences[:, input_ids.shape[1] :].cpu()
        return rollout_from_tokens(agent, prompts, ids, until_eos(tokens, agent.eos_token_ids))

    def unavailable(self) -> str | None:
        """Why the team cannot decode in one loop, or None where it can."""
        try:
            self._team_config()
        except LeanDecodingUnavailable as error:
            return str(error)
        return None

    def _team_config(self):
        """The first agent's `sampling_config`, for one loop over every agent's rows; `LeanDecodingUnavailable` where
        the team cannot decode in one loop."""
        agents = self.agents
        first = agents[0]
        if len(agents) < 2:
            raise LeanDecodingUnavailable("one agent")
        if not self.joint:
            raise LeanDecodingUnavailable("joint_generation=False")
        for agent in agents:
            reason = _model_unavailable(agent)
            if reason is not None:
                raise LeanDecodingUnavailable(f"agent {agent.agent_index}: {reason}")
        models = [base_model(agent.model) for agent in agents]
        first_architecture, first_dtypes = architecture(models[0]), weight_dtypes(models[0])
        if any(architecture(model) != first_architecture for model in models[1:]):
            raise LeanDecodingUnavailable("the agents' models have different architectures")
        if any(weight_dtypes(model) != first_dtypes for model in models[1:]):
            raise LeanDecodingUnavailable("the agents' weights have different dtypes")
        settings = [(a.generation_config.to_dict(), a.generation_kwargs, a.eos_token_ids) for a in agents]
        if any(setting != settings[0] for setting in settings):
            raise LeanDecodingUnavailable("the agents sample with different settings")
        return sampling_config(models[0], first.generation_config)  # the same settings: the first agent's

    def _joint(self, prompts: list[list], config) -> list[Rollout]:
        agents, first = self.agents, self.agents[0]
        prompt_ids = []
        for agent, agent_prompts in zip(agents, prompts, strict=True):
            ids = prompt_token_ids(agent, agent_prompts)
            if ids is None:
                raise LeanDecodingUnavailable("the prompts hold images")
            prompt_ids.append(ids)
        sizes = [len(ids) for ids in prompt_ids]
        models = [base_model(agent.model) for agent in agents]
        view = team_view(models, sizes, self.shared)  # before the contexts (see `team_view`)
        rows = [ids for agent_ids in prompt_ids for ids in agent_ids]
        input_ids, mask = left_padded(rows, pad_token_id(first), first.accelerator.device, first.pad_to_multiple_of)
        with ExitStack() as stack:
            for a, agent in enumerate(agents):
                stack.enter_context(agent.generation_contexts())
                stack.enter_context(packed_weights(agent, sizes[a]))
            sequences = lean_generate(models[0], input_ids, mask, config, decoder=view)
        new_tokens = sequences[:, input_ids.shape[1] :].cpu().split(sizes)
        return [
            rollout_from_tokens(agent, agent_prompts, ids, until_eos(tokens, agent.eos_token_ids))
            for agent, agent_prompts, ids, tokens in zip(agents, prompts, prompt_ids, new_tokens, strict=True)
        ]
