"""Multi-agent training checkpoints: layout, metadata, compatibility and crash-safe commits.

A checkpoint directory `checkpoint-N/` holds:

- `agent_i/`: agent i's model (or LoRA adapter) and tokenizer, plus its optimizer and scheduler state;
- `trainer_state.json` and `rng_state*.pth`: the team loop's progress, log history and RNG, written by
  transformers' own machinery;
- `comlrl_trl_state.pt`: the team's runtime state (env_step, per-agent trainer state, stateful user objects);
- `comlrl_trl_checkpoint.json`: the metadata (trainer class, sequence, run id, W&B identity and the
  compatibility fingerprint), written last: a directory without it is not a checkpoint.

Checkpoints are written into a hidden staging directory and renamed into place, so a process killed while
saving leaves the previous checkpoints intact and no partial `checkpoint-N`.
"""

import hashlib
import json
import os
import re
import shutil
from typing import Any


METADATA_NAME = "comlrl_trl_checkpoint.json"
STATE_NAME = "comlrl_trl_state.pt"
CHECKPOINT_VERSION = 1
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def read_checkpoint_metadata(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The metadata of a checkpoint directory: `version`, `trainer_class`, `sequence`, `run_id`, `wandb`, ...

    `wandb` is the W&B run identity (`id`, and `project`/`entity` when known) or None, so that a resumed run
    can continue the same W&B run::

        identity = read_checkpoint_metadata(path)["wandb"]
        if identity and "id" not in wandb_config and "resume" not in wandb_config:
            wandb_config = {**wandb_config, **identity, "resume": "allow"}
    """
    path = os.path.join(os.fspath(checkpoint), METADATA_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{os.fspath(checkpoint)!r} is not a complete comlrl_trl checkpoint (no {METADATA_NAME}); it may have "
            "been interrupted while saving. Resume from an earlier checkpoint-N directory."
        )
    with open(path) as f:
        metadata = json.load(f)
    if metadata.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"Unsupported checkpoint version {metadata.get('version')!r} in {path}.")
    return metadata


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, str]]:
    """Complete checkpoints under `root`, as `(sequence, path)` sorted by sequence."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _CHECKPOINT_RE.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, METADATA_NAME)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The complete checkpoint with the highest sequence under `root`, or None."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1][1] if checkpoints else None


def staging_dir(root: str, name: str) -> str:
    """The hidden directory a checkpoint is written into before it is renamed to `root/name`."""
    return os.path.join(root, f".{name}.partial")


def commit(staging: str, final: str) -> None:
    """Atomically move a fully written staging directory into place (replacing an older copy of the same name)."""
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)


def prune(root: str, keep: int | None, run_id: str) -> None:
    """Delete the oldest checkpoints of `run_id` beyond `keep`; the newest is always kept."""
    if keep is None:
        return
    own = [(seq, path) for seq, path in list_checkpoints(root) if read_checkpoint_metadata(path)["run_id"] == run_id]
    for _, path in own[: max(len(own) - max(keep, 1), 0)]:
        shutil.rmtree(path, ignore_errors=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of what makes two tokenizers interchangeable: vocabulary, special tokens, chat template."""
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    digest.update(str(tokenizer.chat_template).encode())
    return digest.hexdigest()[:16]


def model_fingerprint(model) -> str:
    """A short hash of a model's class and parameter names, shapes and dtypes."""
    digest = hashlib.sha256(type(model).__name__.encode())
    for name, parameter in model.state_dict().items():
        digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype};".encode())
    return digest.hexdigest()[:16]


def check_checkpoint_options(interval, total_limit) -> None:
    """Validate `train(checkpoint_interval=..., checkpoint_total_limit=...)`."""
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"checkpoint_interval must be a positive integer, got {interval!r}.")
    if total_limit is not None and (isinstance(total_limit, bool) or not isinstance(total_limit, int)
                                    or total_limit < 1):
        raise ValueError(f"checkpoint_total_limit must be a positive integer or None, got {total_limit!r}.")


def refuse_foreign_checkpoints(root: str | None, run_id: str) -> None:
    """A checkpoint directory belongs to one run: refuse to write next to another run's checkpoints."""
    if root is None:
        return
    foreign = [path for _, path in list_checkpoints(root) if read_checkpoint_metadata(path)["run_id"] != run_id]
    if foreign:
        raise FileExistsError(
            f"{root!r} already holds checkpoints of another run ({os.path.basename(foreign[0])}, ...). Use a new "
            "checkpoint directory, or resume from one of them."
        )


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: str) -> None:
    """Refuse to resume into a different run: name every field of the fingerprint that differs."""
    differences = [f"{key}: checkpoint has {saved.get(key)!r}, this trainer has {current[key]!r}"
                   for key in current if saved.get(key) != current[key]]
    if differences:
        raise ValueError(f"Cannot resume from {path}: the checkpoint does not match this trainer.\n  "
                         + "\n  ".join(differences))
