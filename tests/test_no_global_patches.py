"""No process-wide state of torch, transformers, Accelerate, TRL, PEFT or DeepSpeed is changed by this package, except
where a library gives no other hook: then it is changed and restored around one call of ours, with a test that
proves it is back (issue 57).

`test_no_assignment_to_a_library_outside_the_allow_list` scans `comlrl_trl/` for assignments whose target is an
attribute of such a module or class (`X.attr = ...`, `del X.attr`, `setattr(X, ...)`, `attribute_replaced(X, ...)`),
of a class found at run time (`type(obj).attr = ...`), or of Accelerate's shared state (`AcceleratorState()`, whose
instances share one dictionary); every one must be listed in `ALLOWED` with its reason and the test that proves it
restored.
"""

import ast
import importlib
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from comlrl_trl.adapters import cpu_logprob
from comlrl_trl.adapters.cpu_logprob import CpuChunkedLogProb, cpu_fused_head


PACKAGE = Path(__file__).resolve().parents[1] / "comlrl_trl"
LIBRARIES = ("torch", "transformers", "accelerate", "trl", "peft", "deepspeed")
_SHARED_STATE = ("AcceleratorState", "PartialState", "GradientState")  # Accelerate's: every instance shares one dict
_RUNTIME_CLASS = "type(...)"

# (file under comlrl_trl/, assigned attribute) -> (why a library hook is missing, the test that proves it restored)
ALLOWED = {
    ("generation/vllm_engines.py", "torch.set_num_threads"): (
        "vLLM's CPU worker replaces it by a no-op for the whole process; `_process_state_kept` puts torch's back",
        "tests/test_vllm_engines.py::test_a_seed_makes_samples_reproducible_and_leaves_the_process_state_alone",
    ),
    ("loading.py", "transformers.integrations.deepspeed._hf_deepspeed_config_weak_ref"): (
        "transformers reads ZeRO-3 from this module global only; `whole_weights` restores it after loading",
        "tests/test_no_global_patches.py::test_whole_weights_restores_transformers_zero3_reference",
    ),
    ("trainers/actor_critic/critic_loading.py", "transformers.integrations.deepspeed._hf_deepspeed_config_weak_ref"): (
        "transformers reads ZeRO-3 from this module global only; `zero3_config_live` restores it after loading",
        "tests/test_no_global_patches.py::test_zero3_config_live_restores_transformers_zero3_reference",
    ),
    ("adapters/reward.py", "AcceleratorState().deepspeed_plugins"): (
        "Accelerate refuses a second DeepSpeed plugin; `active_deepspeed_plugin` swaps the reward model's in and back",
        "tests/test_no_global_patches.py::test_active_deepspeed_plugin_restores_the_agents_plugin",
    ),
}


class _Assignments(ast.NodeVisitor):
    """The library attributes a module assigns or deletes (see the module docstring), as `(target, line)`."""

    def __init__(self):
        self.names: dict[str, str] = {}
        self.hits: list[tuple[str, int]] = []

    def resolve(self, node: ast.AST) -> str | None:
        """What `node` names, as a dotted path from a module (`torch.multinomial`), `type(...)` or
        `AcceleratorState()`; None for what is not known statically (locals, arguments, instances)."""
        if isinstance(node, ast.Name):
            return self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return None if base is None else f"{base}.{node.attr}"
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "type" and len(node.args) == 1:
                return _RUNTIME_CLASS
            if (  # importlib.import_module("trl.trainer.utils")
                isinstance(node.func, ast.Attribute)
                and node.func.attr == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                return node.args[0].value
            called = self.resolve(node.func)
            if called is not None and called.rsplit(".", 1)[-1] in _SHARED_STATE:
                return f"{called.rsplit('.', 1)[-1]}()"
        return None

    @staticmethod
    def is_library(path: str | None) -> bool:
        return path is not None and (
            path.split(".")[0] in LIBRARIES
            or path.startswith(_RUNTIME_CLASS)
            or any(path.startswith(f"{name}()") for name in _SHARED_STATE)
        )

    def _hit(self, owner: ast.AST, attribute: str, line: int) -> None:
        path = self.resolve(owner)
        if self.is_library(path):
            self.hits.append((f"{path}.{attribute}", line))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.names[alias.asname or alias.name.split(".")[0]] = (
                alias.name if alias.asname else alias.name.split(".")[0]
            )

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            for alias in node.names:
                self.names[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def _targets(self, targets: list[ast.AST], line: int) -> None:
        for target in targets:
            if isinstance(target, ast.Attribute):
                self._hit(target.value, target.attr, line)
            elif isinstance(target, (ast.Tuple, ast.List)):
                self._targets(list(target.elts), line)

    def visit_Assign(self, node: ast.Assign) -> None:
        value = self.resolve(node.value)
        for target in node.targets:
            if isinstance(target, ast.Name) and value is not None:
                self.names[target.id] = value
        self._targets(node.targets, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._targets([node.target], node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._targets([node.target], node.lineno)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self._targets(node.targets, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in ("setattr", "delattr", "attribute_replaced") and len(node.args) >= 2:
            attribute = node.args[1].value if isinstance(node.args[1], ast.Constant) else "*"
            self._hit(node.args[0], str(attribute), node.lineno)
        self.generic_visit(node)


def library_assignments(source: str) -> list[tuple[str, int]]:
    """`(target, line)` of every library attribute `source` assigns (see `_Assignments`)."""
    visitor = _Assignments()
    visitor.visit(ast.parse(source))
    return visitor.hits


def test_the_scan_finds_each_kind_of_assignment():
    source = """
import torch
import accelerate.utils.other
import importlib
from transformers import GenerationMixin as GM
from accelerate.state import AcceleratorState
from comlrl_trl.adapters.helpers import attribute_replaced
_UTILS = importlib.import_module("trl.trainer.utils")
torch.multinomial = 1
accelerate.utils.other.is_deepspeed_available = 2
setattr(GM, "_sample", 3)
del _UTILS._use_triton
owner = type(model)
owner._sample = 4
state = AcceleratorState()
state.deepspeed_plugins = 5
with attribute_replaced(_UTILS, "_ChunkedLogProbFunction", 6):
    pass
model.forward = 7
self.args = 8
torch.manual_seed(0)
"""
    assert library_assignments(source) == [
        ("torch.multinomial", 9),
        ("accelerate.utils.other.is_deepspeed_available", 10),
        ("transformers.GenerationMixin._sample", 11),
        ("trl.trainer.utils._use_triton", 12),
        ("type(...)._sample", 14),
        ("AcceleratorState().deepspeed_plugins", 16),
        ("trl.trainer.utils._ChunkedLogProbFunction", 17),
    ]  # instances (`model`, `self`) and calls (`manual_seed`) are not assignments to a library's attribute


def test_no_assignment_to_a_library_outside_the_allow_list():
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        file = path.relative_to(PACKAGE).as_posix()
        for target, line in library_assignments(path.read_text()):
            found.add((file, target))
            assert (file, target) in ALLOWED, (
                f"comlrl_trl/{file}:{line} assigns {target}, a library's process-wide state: give the call its own "
                "hook instead, or list it in ALLOWED with the reason and the test that proves it restored."
            )
    stale = set(ALLOWED) - found
    assert not stale, f"ALLOWED lists assignments that are gone: delete {sorted(stale)}"


def test_the_trl_head_globals_are_not_replaced_anywhere():
    """The CPU log-probability head used to replace two of TRL's module globals around every forward."""
    for path in PACKAGE.rglob("*.py"):
        for target, line in library_assignments(path.read_text()):
            assert not target.startswith("trl."), f"{path}:{line} assigns {target}"


@pytest.mark.parametrize("entry", sorted(ALLOWED))
def test_each_allowed_assignment_names_an_existing_restore_test(entry):
    reason, proof = ALLOWED[entry]
    file, name = proof.split("::")
    assert reason and f"def {name}(" in (PACKAGE.parent / file).read_text(), proof


# ----- the CPU log-probability head: the agent's own call, not the process -----


def test_another_thread_sees_trls_head_while_an_agent_scores(make_team):
    """While an agent computes log-probabilities on one thread (held inside its forward), another thread reads TRL's
    two head globals: they are TRL's own, and the agent's own call ran through the CPU head all the same."""
    trl_utils = importlib.import_module("trl.trainer.utils")
    use_triton, function = trl_utils._use_triton, trl_utils._ChunkedLogProbFunction
    agent = make_team().agent_trainers[0]
    model = agent.model
    inside, read = threading.Event(), threading.Event()
    seen = {}

    def hold(module, args, output):  # on the agent's thread, inside its scoring forward
        fused = vars(model)["forward"].__func__.__globals__
        seen["agent's head"] = fused["_ChunkedLogProbFunction"], fused["_use_triton"](torch.device("cpu"))
        inside.set()
        assert read.wait(timeout=60)

    handle = model.get_decoder().norm.register_forward_hook(hold)
    ids = torch.randint(3, model.config.vocab_size, (2, 9))
    result = {}
    scorer = threading.Thread(
        target=lambda: result.update(logps=agent.per_token_logps(model, ids, torch.ones_like(ids), 4, batch_size=2))
    )
    try:
        scorer.start()
        assert inside.wait(timeout=60)
        seen["other thread"] = trl_utils._ChunkedLogProbFunction, trl_utils._use_triton
        seen["other thread's choice"] = trl_utils._use_triton(torch.device("cpu"))
        read.set()
        scorer.join(timeout=60)
    finally:
        read.set()
        handle.remove()
    assert seen["other thread"] == (function, use_triton)
    assert seen["other thread's choice"] is False  # TRL scores every position on a CPU
    assert seen["agent's head"] == (CpuChunkedLogProb, True)  # the agent's call: completions only, our backward
    assert result["logps"].shape == (2, 4)
    assert "forward" in vars(model)  # TRL's fused forward on the instance, as before the call
    assert vars(model)["forward"].__func__.__globals__ is vars(trl_utils)


def test_the_cpu_head_leaves_the_model_as_it_was_after_an_error(make_team):
    model = make_team().agent_trainers[0].model
    before = vars(model)["forward"]
    with pytest.raises(RuntimeError, match="boom"), cpu_fused_head(model):
        assert vars(model)["forward"] is not before
        raise RuntimeError("boom")
    assert vars(model)["forward"] is before


def test_the_cpu_head_changes_nothing_without_trls_fused_forward():
    model = torch.nn.Linear(2, 2)
    with cpu_fused_head(model), cpu_fused_head(None):
        assert "forward" not in vars(model)
    assert cpu_logprob._trl_fused_function(model) is None


# ----- the lean CPU generator: its own loop, the libraries' own functions -----


def test_the_libraries_are_their_own_while_the_lean_cpu_generator_decodes(make_team, monkeypatch):
    """At every decoding step of the lean CPU generator (one agent's loop and the team's), torch's sampling,
    transformers' generation functions and Accelerate's DeepSpeed check are the libraries' own, as any other thread
    would read them."""
    import accelerate.utils.other
    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.utils import GenerationMixin

    from comlrl_trl.fast import decoding

    libraries = (
        torch.multinomial,
        LogitsProcessorList.__call__,
        GenerationMixin._get_logits_processor,
        GenerationMixin._sample,
        accelerate.utils.other.is_deepspeed_available,
    )
    trainer = make_team()
    models = [type(agent.model) for agent in trainer.agent_trainers]
    seen = []
    step = decoding._decoding_step

    def look(*args):
        current = (
            torch.multinomial,
            LogitsProcessorList.__call__,
            GenerationMixin._get_logits_processor,
            GenerationMixin._sample,
            accelerate.utils.other.is_deepspeed_available,
        )
        seen.append(current == libraries and not any("_sample" in vars(model) for model in models))
        return step(*args)

    monkeypatch.setattr(decoding, "_decoding_step", look)
    team = trainer.orchestrator.team_generation
    prompts = [["Write a story about item 1:"] * 4] * 2
    assert team.unavailable() is None
    team(prompts)  # the team's loop
    team._own_call(trainer.agent_trainers[0], prompts[0])  # one agent's loop
    assert len(seen) > 2 and all(seen)


# ----- the restored library state of ALLOWED -----


def test_whole_weights_restores_transformers_zero3_reference(monkeypatch):
    from transformers.integrations import deepspeed as hf_deepspeed

    from comlrl_trl.loading import whole_weights

    reference = object()
    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", reference)
    with pytest.raises(RuntimeError, match="boom"), whole_weights():
        assert hf_deepspeed._hf_deepspeed_config_weak_ref is None
        raise RuntimeError("boom")
    assert hf_deepspeed._hf_deepspeed_config_weak_ref is reference


def test_zero3_config_live_restores_transformers_zero3_reference(monkeypatch):
    from transformers.integrations import deepspeed as hf_deepspeed

    from comlrl_trl.trainers.actor_critic.critic_loading import zero3_config_live

    monkeypatch.setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", None)
    live = object()
    plugin = SimpleNamespace(
        set_deepspeed_weakref=lambda: setattr(hf_deepspeed, "_hf_deepspeed_config_weak_ref", live)
    )
    with pytest.raises(RuntimeError, match="boom"), zero3_config_live(plugin):
        assert hf_deepspeed._hf_deepspeed_config_weak_ref is live
        raise RuntimeError("boom")
    assert hf_deepspeed._hf_deepspeed_config_weak_ref is None


def test_active_deepspeed_plugin_restores_the_agents_plugin(monkeypatch):
    from comlrl_trl.adapters import reward

    selected = []
    agents = SimpleNamespace(select=lambda **kwargs: selected.append("agents"))
    theirs = SimpleNamespace(select=lambda **kwargs: selected.append("reward model"))
    state = SimpleNamespace(deepspeed_plugins=agents)
    monkeypatch.setattr(reward, "deepspeed_state_exists", lambda: True)
    monkeypatch.setattr(reward, "AcceleratorState", lambda: state)
    monkeypatch.setattr(reward, "get_active_deepspeed_plugin", lambda s: s.deepspeed_plugins)
    with pytest.raises(RuntimeError, match="boom"), reward.active_deepspeed_plugin(theirs):
        assert state.deepspeed_plugins is theirs
        raise RuntimeError("boom")
    assert state.deepspeed_plugins is agents
    assert selected == ["reward model", "agents"]
