"""Private names of TRL, transformers and Accelerate are used in three files only: the two adapters and loading.

A TRL upgrade then means porting those files (and `tests/test_trl_contract.py` says what they rely on). The scan
collects the private names those libraries define (class attributes and methods of the classes we extend, and the
`self._x` attributes their trainers set) and looks for any use of them, or override, elsewhere in the package.
"""

import ast
import inspect
import re
from pathlib import Path

import accelerate
import transformers
import trl
from accelerate.state import AcceleratorState, PartialState
from transformers import PretrainedConfig, PreTrainedModel, Trainer
from trl import GRPOTrainer, RewardTrainer


PACKAGE = Path(__file__).resolve().parents[1] / "comlrl_trl"
ALLOWED = {"adapters/grpo.py", "adapters/reward.py", "loading.py"}
# Our own private attributes that happen to share a library name (the sandbox's `SandboxProcess._name`).
OWN_NAMES = {"_name"}
_SELF_ATTRIBUTE = re.compile(r"self\.(_[a-z][a-z0-9_]*)\s*=")


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
        accelerate.accelerator,
    ):
        names.update(_SELF_ATTRIBUTE.findall(inspect.getsource(module)))
    return names - OWN_NAMES


def _uses(path: Path, names: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
    } <= names  # the scan works
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in ALLOWED:
            continue
        used = _uses(path, names)
        if used:
            offenders[relative] = sorted(used)
    assert offenders == {}, f"private TRL/transformers/Accelerate names outside {sorted(ALLOWED)}: {offenders}"


def test_the_adapters_do_use_them():
    """The allowed files are where the scan finds them: a scan that found nothing anywhere would pass vacuously."""
    names = _foreign_private_names()
    assert {"_generate", "_calculate_rewards", "_compute_loss", "_prepare_inputs"} <= _uses(
        PACKAGE / "adapters" / "grpo.py", names
    )
    assert {"_prepare_dataset", "_build_accelerator_args"} <= _uses(PACKAGE / "adapters" / "reward.py", names)
