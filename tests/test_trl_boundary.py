"""What TRL, transformers and Accelerate do not publish is used in `adapters/` only (and `loading.py` for the
private names of rule 1).

A TRL upgrade then means porting those files (and `tests/test_trl_contract.py` says what they rely on). Four
rules, each an AST scan of the package outside `adapters/`:

1. no private name of those libraries: the class attributes and methods of the classes we extend, and the
   `self._x` attributes their trainers and `PretrainedConfig` set, neither used nor overridden (`loading.py` may);
2. no deep TRL import: TRL's public API is what `trl` exports at the top level (`from trl import GRPOTrainer`);
   `trl.trainer.utils`, `trl.models.utils` and every other `trl.<module>` are its internals;
3. no private keyword argument in a call (`save_model(path, _internal_call=True)`): a `_` keyword is the callee's
   internal protocol, and comlrl_trl's own functions take none;
4. no private attribute read from a config (`model.config._name_or_path`, `getattr(config, "_x")`): a receiver
   named `config`, `*_config` or `*Config`, or returned by a `*_config()` call.

Each rule has a negative test: a synthetic snippet that breaks it is flagged, a close one that does not is not.
"""

import ast
import inspect
import pkgutil
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

import accelerate
import pytest
import transformers
import trl
from accelerate.state import AcceleratorState, PartialState
from transformers import PretrainedConfig, PreTrainedModel, Trainer
from trl import GRPOTrainer, RewardTrainer


PACKAGE = Path(__file__).resolve().parents[1] / "comlrl_trl"
ADAPTERS = "adapters/"
PRIVATE_NAMES_ALSO_IN = {"loading.py"}  # rule 1 only: loading a saved adapter reads PEFT/transformers internals
# Our own private attributes that happen to share a library name (the sandbox's `SandboxProcess._name`).
OWN_NAMES = {"_name"}
_SELF_ATTRIBUTE = re.compile(r"self\.(_[a-z][a-z0-9_]*)\s*=")
_TRL_MODULES = frozenset(module.name for module in pkgutil.iter_modules(trl.__path__))


def _package_files() -> list[tuple[str, ast.Module]]:
    return [
        (path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())) for path in sorted(PACKAGE.rglob("*.py"))
    ]


def _parse(source: str) -> ast.Module:
    return ast.parse(textwrap.dedent(source))


# ----- rule 1: private names -----


def _foreign_private_names() -> set[str]:
    names = set()
    for cls in (
        GRPOTrainer,
        RewardTrainer,
        Trainer,
        accelerate.Accelerator,
        AcceleratorState,
        PartialState,
        PreTrainedModel,
        PretrainedConfig,
    ):
        names.update(name for name in dir(cls) if name.startswith("_") and not name.startswith("__"))
    for module in (
        trl.trainer.grpo_trainer,
        trl.trainer.reward_trainer,
        trl.trainer.base_trainer,
        transformers.trainer,
        transformers.configuration_utils,
        accelerate.accelerator,
    ):
        names.update(_SELF_ATTRIBUTE.findall(inspect.getsource(module)))
    return names - OWN_NAMES


def _uses(tree: ast.Module, names: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            found.add(node.name)  # an override of a private hook
    return found


def test_private_library_names_stay_in_the_adapters_and_loading():
    names = _foreign_private_names()
    assert {
        "_generate",
        "_prepare_inputs",
        "_metrics",
        "_buffered_inputs",
        "_save_rng_state",
        "_name_or_path",
    } <= names  # the scan works
    offenders = {}
    for relative, tree in _package_files():
        if relative.startswith(ADAPTERS) or relative in PRIVATE_NAMES_ALSO_IN:
            continue
        used = _uses(tree, names)
        if used:
            offenders[relative] = sorted(used)
    assert offenders == {}, f"private TRL/transformers/Accelerate names outside adapters/ and loading.py: {offenders}"


def test_the_adapters_do_use_them():
    """The allowed files are where the scan finds them: a scan that found nothing anywhere would pass vacuously."""
    names = _foreign_private_names()
    assert {"_generate", "_calculate_rewards", "_compute_loss", "_prepare_inputs"} <= _uses(
        ast.parse((PACKAGE / "adapters" / "grpo.py").read_text()), names
    )
    assert {"_prepare_dataset", "_build_accelerator_args"} <= _uses(
        ast.parse((PACKAGE / "adapters" / "reward.py").read_text()), names
    )


# ----- rules 2-4: deep TRL imports, private keywords, private config attributes -----


def deep_trl_imports(tree: ast.Module) -> list[str]:
    """`line: module` of every import of a module inside `trl` (and every `trl.<module>` attribute)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: {alias.name}" for alias in node.names if alias.name.startswith("trl.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module.startswith("trl."):
                found.append(f"{node.lineno}: {node.module}")
            elif node.module == "trl":
                found += [f"{node.lineno}: trl.{a.name}" for a in node.names if a.name in _TRL_MODULES]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "trl"
            and node.attr in _TRL_MODULES
        ):
            found.append(f"{node.lineno}: trl.{node.attr}")
    return found


def _private(name: object) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def private_keywords(tree: ast.Module) -> list[str]:
    """`line: keyword` of every `_`-keyword passed to a call, also through `**{"_x": ...}`."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for keyword in node.keywords:
            if _private(keyword.arg):
                found.append(f"{node.lineno}: {keyword.arg}")
            elif keyword.arg is None and isinstance(keyword.value, ast.Dict):
                found += [
                    f"{node.lineno}: {key.value}"
                    for key in keyword.value.keys
                    if isinstance(key, ast.Constant) and _private(key.value)
                ]
    return found


def _is_config(node: ast.expr) -> bool:
    if isinstance(node, ast.Call):  # model.config.get_text_config()._x
        return _is_config(node.func)
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "config" or name.endswith("_config") or name.endswith("Config")


def private_config_reads(tree: ast.Module) -> list[str]:
    """`line: attribute` of every private attribute read from a config, as `config._x` or `getattr(config, "_x")`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and _is_config(node.value):
            found.append(f"{node.lineno}: {node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and _is_config(node.args[0])
            and isinstance(node.args[1], ast.Constant)
            and _private(node.args[1].value)
        ):
            found.append(f"{node.lineno}: {node.args[1].value}")
    return found


RULES = {
    "deep TRL imports (import TRL's public API from `trl`, or wrap the helper in adapters/)": deep_trl_imports,
    "private keyword arguments (call through an adapters/ helper)": private_keywords,
    "private config attributes (use the public property, or an adapters/ helper)": private_config_reads,
}


@pytest.mark.parametrize("rule", list(RULES))
def test_the_package_outside_the_adapters_keeps_the_rule(rule):
    check: Callable[[ast.Module], list[str]] = RULES[rule]
    offenders = {
        relative: found
        for relative, tree in _package_files()
        if not relative.startswith(ADAPTERS) and (found := check(tree))
    }
    assert offenders == {}, f"{rule} outside adapters/: {offenders}"


def test_the_adapters_hold_what_the_rules_keep_out():
    """The adapters do import TRL's internals and pass a private keyword: the scans find them where they are."""
    adapters = {relative: tree for relative, tree in _package_files() if relative.startswith(ADAPTERS)}
    imported = {entry.split(": ")[1] for tree in adapters.values() for entry in deep_trl_imports(tree)}
    assert {"trl.trainer.utils", "trl.models.utils", "trl.trainer.reward_trainer"} <= imported
    keywords = {entry.split(": ")[1] for tree in adapters.values() for entry in private_keywords(tree)}
    assert "_internal_call" in keywords


@pytest.mark.parametrize(
    ("check", "source", "expected"),
    [
        (deep_trl_imports, "from trl.trainer.utils import pad", ["1: trl.trainer.utils"]),
        (deep_trl_imports, "import trl.models.utils as u", ["1: trl.models.utils"]),
        (deep_trl_imports, "from trl import GRPOTrainer, trainer", ["1: trl.trainer"]),
        (deep_trl_imports, "import trl\nx = trl.models.utils.disable_gradient_checkpointing", ["2: trl.models"]),
        (
            deep_trl_imports,
            "def f():\n    from trl.trainer.reward_trainer import x",
            ["2: trl.trainer.reward_trainer"],
        ),
        (private_keywords, "trainer.save_model(path, _internal_call=True)", ["1: _internal_call"]),
        (private_keywords, "super().save_model(path, **{'_internal_call': flag})", ["1: _internal_call"]),
        (private_config_reads, "name = model.config._name_or_path", ["1: _name_or_path"]),
        (private_config_reads, "x = agent.model.get_text_config()._attn_implementation", ["1: _attn_implementation"]),
        (private_config_reads, "getattr(self.peft_config, '_commit_hash', None)", ["1: _commit_hash"]),
        (private_config_reads, "PretrainedConfig._auto_class", ["1: _auto_class"]),
    ],
)
def test_a_rule_breaking_snippet_is_flagged(check, source, expected):
    assert check(_parse(source)) == expected


@pytest.mark.parametrize(
    ("check", "source"),
    [
        (deep_trl_imports, "import trl\nfrom trl import GRPOTrainer, GRPOConfig, RewardTrainer, apply_chat_template"),
        (deep_trl_imports, "from trlx.trainer import utils\nfrom .trl.models import x\nimport trl_extra.models"),
        (private_keywords, "trainer.save_model(path, internal=True)\nf(**{'a': 1}, **kwargs)"),
        (private_config_reads, "model.config.name_or_path\nconfig.hidden_size\nself._config.x\ngetattr(config, 'x')"),
        (private_config_reads, "args._n_gpu\nmodel._name_or_path_like\nconfig.__class__"),
    ],
)
def test_a_close_snippet_that_keeps_the_rule_is_not_flagged(check, source):
    assert check(_parse(source)) == []
