"""Generation backends for the agents of a team.

`TeamVLLM` (in `comlrl_trl.generation.vllm_engines`) samples completions with one vLLM engine per process and loads
each agent's trained weights (or adapter) into it before the agent generates. `TeamVLLMServer` (`comlrl_trl.generation.vllm_server`) does the
same for LoRA agents through a running vLLM server. `TeamVLLM` needs the `vllm` extra (`make install-vllm`);
`TeamVLLMServer` only talks HTTP to the server. Importing this package does not import vLLM.
"""

from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from .vllm_engines import TeamVLLM, check_one_architecture, colocate_memory, engine_lengths, plan_weights
    from .vllm_server import TeamVLLMServer

__all__ = ["TeamVLLM", "TeamVLLMServer", "check_one_architecture", "colocate_memory", "engine_lengths", "plan_weights"]


def __getattr__(name: str) -> Any:
    if name == "TeamVLLMServer":
        from . import vllm_server

        return vllm_server.TeamVLLMServer
    if name in __all__:
        from . import vllm_engines

        return getattr(vllm_engines, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
