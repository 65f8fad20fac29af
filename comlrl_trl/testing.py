"""Tiny, random, offline causal language models for tests and demos.

Why this module exists
----------------------
The test-suite and the demo scripts must never touch a model hub: CI runs
without network access and downloads make tests slow and flaky. Instead we
build *tiny* models locally:

* a byte-level BPE tokenizer trained in-process (with the ``tokenizers``
  library) on a small, deterministically generated English-ish corpus, and
* a randomly initialised ``Qwen2ForCausalLM`` or ``LlamaForCausalLM`` with a
  few thousand parameters whose vocabulary matches that tokenizer.

Two *different* kinds exist (``"qwen2"`` and ``"llama"``) with different
vocabulary sizes, special tokens and chat templates, so that tests of
heterogeneous multi-agent setups see genuinely different vocabularies.

Everything is deterministic for a given ``kind``/``seed``. :func:`tiny_model_path`
saves model + tokenizer with ``save_pretrained`` into a cache directory (written
atomically, so parallel pytest workers do not collide) and returns the path,
which can be passed to ``AutoModelForCausalLM.from_pretrained`` /
``AutoTokenizer.from_pretrained`` or to TRL trainers as a model id.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from .loading import whole_weights


__all__ = [
    "ModelKind",
    "CACHE_VERSION",
    "CACHE_ENV_VAR",
    "build_corpus",
    "build_tokenizer",
    "build_tiny_model",
    "tiny_model_path",
]

ModelKind = Literal["qwen2", "llama"]

#: Bump when the tokenizer/model recipe changes, to invalidate old caches.
CACHE_VERSION = "v1"
#: Environment variable overriding the cache root directory.
CACHE_ENV_VAR = "COMLRL_TRL_CACHE"
_DEFAULT_CACHE_ROOT = Path("~/.cache/comlrl_trl/tiny-models")
_COMPLETE_MARKER = ".complete"

_DEFAULT_VOCAB_SIZE: dict[str, int] = {"qwen2": 512, "llama": 384}

# Qwen2's pre-tokenizer regex (digits split one by one). ``AutoTokenizer`` always reloads a
# ``model_type == "qwen2"`` checkpoint as ``Qwen2Tokenizer``, which re-installs this exact
# NFC + Split + ByteLevel pipeline, so we must train with it for the reload to be faithful.
_QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Minimal Llama-3-flavoured template that only uses tokens the llama tokenizer has.
_LLAMA_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '### ' + message['role'] + ':\\n' + message['content'] + eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '### assistant:\\n' }}{%- endif %}"
)

_SUBJECTS = [
    "the agent",
    "a model",
    "the writer",
    "our team",
    "each player",
    "the coder",
    "a student",
    "the robot",
    "my friend",
    "the teacher",
    "every user",
    "the critic",
]
_VERBS = [
    "writes",
    "reads",
    "solves",
    "checks",
    "builds",
    "tests",
    "explains",
    "counts",
    "returns",
    "sorts",
    "prints",
    "reviews",
    "answers",
    "computes",
    "adds",
]
_OBJECTS = [
    "a short story",
    "the function",
    "two numbers",
    "a list",
    "the answer",
    "a poem",
    "the reward",
    "a summary",
    "the code",
    "some text",
    "a question",
    "the total",
]
_ADVERBS = ["quickly", "carefully", "again", "together", "today", "slowly", "well", "first"]
_CODE = [
    "def f(x): return x + 1",
    "print(sum([1, 2, 3]))",
    "if a > b: a, b = b, a",
    "x = {'k': [0, 1]}",
    "for i in range(10): pass",
    "return a * b - c / 2",
    "assert len(xs) == 3",
    'y = f"{x:.2f}" # comment',
    "class A: pass",
    "while n != 0: n -= 1",
    "import math; math.sqrt(16)",
    "s = 'hi' + \"there\"!",
]


def build_corpus(n_sentences: int = 400, seed: int = 1234) -> list[str]:
    """Return a deterministic English-ish corpus with digits and code-ish characters."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_sentences):
        r = rng.random()
        if r < 0.2:
            lines.append(rng.choice(_CODE))
        elif r < 0.4:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
        else:
            sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
            if rng.random() < 0.5:
                sentence += f" {rng.choice(_ADVERBS)}"
            punct = rng.choice([".", "!", "?", ";", ":"])
            lines.append(sentence[0].upper() + sentence[1:] + punct + f" ({i})")
    return lines


def build_tokenizer(kind: ModelKind = "qwen2", vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer for ``kind`` on the in-module corpus.

    The returned tokenizer pads on the left and has ``pad_token != eos_token``.
    ``vocab_size`` defaults to 512 for ``"qwen2"`` and 384 for ``"llama"``.
    """
    if kind == "qwen2":
        specials = {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
        special_list = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        chat_template = (resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    elif kind == "llama":
        specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
        special_list = ["<s>", "</s>", "<pad>"]
        chat_template = _LLAMA_CHAT_TEMPLATE
    else:
        raise ValueError(f"unknown kind {kind!r}; expected 'qwen2' or 'llama'")

    vocab_size = vocab_size or _DEFAULT_VOCAB_SIZE[kind]
    tok = Tokenizer(models.BPE())
    if kind == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_list,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        padding_side="left",
        chat_template=chat_template,
        model_max_length=512,
        **specials,
    )
    hf_tok.add_special_tokens({"additional_special_tokens": [t for t in special_list if t not in specials.values()]})
    return hf_tok


def build_tiny_model(kind: ModelKind, tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> PreTrainedModel:
    """Build a tiny randomly initialised causal LM matching ``tokenizer`` (deterministic in ``seed``)."""
    ids = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    torch.manual_seed(seed)
    model: PreTrainedModel
    if kind == "qwen2":
        config = Qwen2Config(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            **ids,
        )
        model = Qwen2ForCausalLM(config)
    elif kind == "llama":
        config = LlamaConfig(
            hidden_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            max_position_embeddings=512,
            tie_word_embeddings=False,
            **ids,
        )
        model = LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown kind {kind!r}; expected 'qwen2' or 'llama'")
    model.generation_config = GenerationConfig(**{k: v for k, v in ids.items() if k != "vocab_size"})
    return model.eval()


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    root = cache_dir or os.environ.get(CACHE_ENV_VAR) or _DEFAULT_CACHE_ROOT
    return Path(root).expanduser()


def _wait_for_build(target: Path, timeout: float = 600.0) -> Path:
    """Wait for another process (rank 0) to rename its complete build into `target`."""
    import time

    deadline = time.monotonic() + timeout
    while not (target / _COMPLETE_MARKER).is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{target} was not built within {timeout:.0f} s: in a process group transformers saves only on "
                "rank 0, so rank 0 must call tiny_model_path too (or build the model before launching)."
            )
        time.sleep(0.2)
    return target


def tiny_model_path(kind: ModelKind = "qwen2", seed: int = 0, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Return a directory holding ``save_pretrained`` output of a tiny model + tokenizer.

    Layout: ``<root>/<kind>-seed<seed>-<CACHE_VERSION>/`` where ``<root>`` is ``cache_dir``,
    else ``$COMLRL_TRL_CACHE``, else ``~/.cache/comlrl_trl/tiny-models``. The directory is
    built in a temporary sibling and renamed into place, so concurrent callers never see
    a half-written model; if another process wins the race, its copy is kept.
    """
    if kind not in _DEFAULT_VOCAB_SIZE:
        raise ValueError(f"unknown kind {kind!r}; expected 'qwen2' or 'llama'")
    root = _cache_root(cache_dir)
    target = root / f"{kind}-seed{seed}-{CACHE_VERSION}"
    if (target / _COMPLETE_MARKER).is_file():
        return str(target)

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        tokenizer = build_tokenizer(kind)
        # Whole weights even after a ZeRO-3 config exists in this process (a trainer config built first): under its
        # hooks the model would be partitioned, and save_pretrained would write no weights and no config.
        with whole_weights():
            model = build_tiny_model(kind, tokenizer, seed=seed)
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not (tmp / "config.json").is_file():
            # In an initialised process group transformers writes only on rank 0: take the copy rank 0 builds.
            return str(_wait_for_build(target))
        (tmp / _COMPLETE_MARKER).write_text(f"{kind} seed={seed} {CACHE_VERSION}\n")
        if target.exists() and not (target / _COMPLETE_MARKER).is_file():
            shutil.rmtree(target, ignore_errors=True)  # stale partial dir from an old crash
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _COMPLETE_MARKER).is_file():
                raise  # not a lost race: a real error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op when the rename succeeded
    return str(target)
