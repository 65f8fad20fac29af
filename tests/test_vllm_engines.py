"""TeamVLLM: generation through vLLM engines, engine layout, log-probs and weight sync (`make test-vllm`).

The models are tiny random Qwen2s saved to disk (vLLM's CPU attention needs a head size of at least 32). A
"steerable" variant has three hidden dimensions that no layer writes and the LM head reads only for one token each
(42, 77 and EOS): writing a large value into such a dimension, through the last layer's `o_proj` (full weights or a
LoRA adapter), makes the model emit that token with probability ~1. Its last attention layer has `v_proj` bias 1,
so the attention output that feeds `o_proj` is close to a vector of ones whatever the input.
"""

import math
import os
import random

import pytest
import torch


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine: plenty for these models
vllm = pytest.importorskip("vllm")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from comlrl_trl.generation import TeamVLLM, check_one_architecture, plan_weights  # noqa: E402
from comlrl_trl.testing import build_tokenizer  # noqa: E402


pytestmark = pytest.mark.vllm
_SET_NUM_THREADS = torch.set_num_threads  # before any engine starts

MAX_NEW = 6
PROMPTS = [[5, 6, 7, 8]] * 3 + [[9, 10]] * 3  # two prompts, K=3 rows each
STEER_DIMS = {42: 63, 77: 62}  # token -> the unwritten hidden dimension that selects it (EOS uses 61)


def _save_tiny(path, tied: bool, steerable: bool, kind: str = "qwen2", seed: int = 0) -> str:
    tokenizer = build_tokenizer(kind)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    torch.manual_seed(seed)
    config_class, model_class = (Qwen2Config, Qwen2ForCausalLM) if kind == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = config_class(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        vocab_size=len(tokenizer),
        **ids,
    )
    model = model_class(config)
    model.generation_config = GenerationConfig(**ids)
    if steerable:
        with torch.no_grad():
            model.model.layers[-1].self_attn.v_proj.bias.fill_(1.0)
            for token, dim in [*STEER_DIMS.items(), (tokenizer.eos_token_id, 61)]:
                model.model.embed_tokens.weight[:, dim] = 0
                for layer in model.model.layers:
                    layer.self_attn.o_proj.weight[dim] = 0
                    layer.mlp.down_proj.weight[dim] = 0
                model.lm_head.weight[:, dim] = 0
                model.lm_head.weight[token, dim] = 10.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tied_path(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("tied"), tied=True, steerable=False)


@pytest.fixture(scope="module")
def steer_path(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("steer"), tied=False, steerable=True)


def _load(path):
    return AutoModelForCausalLM.from_pretrained(path)


def _lora(path, **overrides):
    config = dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])
    return get_peft_model(_load(path), LoraConfig(**{**config, **overrides}))


def _o_proj(model):
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return base.model.layers[-1].self_attn.o_proj


def _steer_weights(model, dim: int) -> None:
    """o_proj writes ~100 (the mean of a ~ones input, times 100) into `dim`: full fine-tuning's version."""
    with torch.no_grad():
        weight = _o_proj(model).weight
        weight[dim] = 100.0 / weight.shape[1]


def _steer_adapter(model, dim: int) -> None:
    """The same update as a rank-1 LoRA of o_proj (scaling alpha/r = 1): A averages the input, B writes 100."""
    with torch.no_grad():
        o_proj = _o_proj(model)
        lora_a, lora_b = o_proj.lora_A["default"].weight, o_proj.lora_B["default"].weight
        lora_a.zero_()
        lora_a[0] = 1.0 / lora_a.shape[1]
        lora_b.zero_()
        lora_b[dim, 0] = 100.0


def _hf_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _all(completions: list[list[int]], token: int) -> bool:
    return all(set(row) == {token} for row in completions)


@pytest.fixture(scope="module")
def tied_team(tied_path, tmp_path_factory):
    """Two tied-embedding Qwen2s with different random weights: one engine, each agent's weights loaded in turn."""
    other_path = _save_tiny(tmp_path_factory.mktemp("tied-other"), tied=True, steerable=False, seed=1)
    tokenizers = [AutoTokenizer.from_pretrained(tied_path), AutoTokenizer.from_pretrained(other_path)]
    models = [_load(tied_path), _load(other_path)]
    team = TeamVLLM(models, tokenizers, max_completion_length=MAX_NEW, seed=0)
    yield team, models, tokenizers
    team.close()


@pytest.mark.parametrize("agent", [0, 1])
def test_generate_returns_unpadded_completions_within_max_length(tied_team, agent):
    team, _, tokenizers = tied_team
    tokenizer = tokenizers[agent]
    assert team.num_engines == 1 and team.weight_groups == [[0], [1]]  # one engine, each agent's weights in turn
    completions, logprobs = team.generate(agent, PROMPTS)
    assert len(completions) == len(logprobs) == len(PROMPTS)
    for row, lps in zip(completions, logprobs):
        assert 1 <= len(row) == len(lps) <= MAX_NEW
        assert all(0 <= token < len(tokenizer) for token in row)
        assert tokenizer.eos_token_id not in row[:-1]  # EOS only ends a completion
        assert len(row) == MAX_NEW or row[-1] == tokenizer.eos_token_id
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in lps)
    assert len({tuple(row) for row in completions}) > 1  # rows of one prompt are independent samples


@pytest.mark.parametrize("agent", [0, 1])
def test_seeded_rows_of_one_prompt_are_different_samples(tied_team, agent):
    """The K rows of one prompt get K different seeds: with one seed for all of them, every row would be the same
    sample (a group of identical completions has no advantage signal)."""
    team, _, _ = tied_team
    assert team.seed == 0
    k = 8
    completions, _ = team.generate(agent, [[5, 6, 7, 8]] * k)
    distinct = {tuple(row) for row in completions}
    assert len(distinct) > k // 2, completions  # a near-uniform random model: collisions are rare, not the rule


def test_logprobs_match_each_agents_own_model_after_every_weight_swap(tied_team):
    team, models, _ = tied_team
    loads = list(team.weight_loads)
    for agent in (0, 1, 0, 1):  # the engine holds the other agent's weights before each call
        completions, logprobs = team.generate(agent, PROMPTS)
        for prompt, row, lps in zip(PROMPTS, completions, logprobs):
            own = _hf_logprobs(models[agent], prompt, row)
            torch.testing.assert_close(torch.tensor(lps), own, atol=1e-4, rtol=0)
            # the other agent's model gives other log-probs: a swap that did not happen would fail above
            assert (own - _hf_logprobs(models[1 - agent], prompt, row)).abs().max() > 1e-2
    assert team.weight_loads == [loads[0] + 2, loads[1] + 2]  # one load per call: the other agent had generated
    team.generate(1, PROMPTS)
    assert team.weight_loads == [loads[0] + 2, loads[1] + 2]  # agent 1's weights are still there: no load


def test_a_seed_makes_samples_reproducible_and_leaves_the_process_state_alone(tied_path, tied_team):
    tokenizer = AutoTokenizer.from_pretrained(tied_path)
    torch.manual_seed(123)
    random.seed(123)
    expected = torch.rand(2), random.random()
    threads = torch.get_num_threads()
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        random.seed(123)
        team = TeamVLLM([_load(tied_path)], [tokenizer], max_completion_length=MAX_NEW, seed=7)
        # vLLM seeds the global generators and replaces torch.set_num_threads by a no-op: TeamVLLM puts them back.
        assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
        assert torch.set_num_threads is _SET_NUM_THREADS and torch.get_num_threads() == threads
        runs.append([team.generate(0, PROMPTS)[0], team.generate(0, PROMPTS)[0]])
        team.close()
    assert runs[0] == runs[1]  # same seed, same calls: same completions
    assert runs[0][0] != runs[0][1]  # a new call draws new samples
    assert len(tied_team[0].generate(1, PROMPTS)[0]) == len(PROMPTS)  # closing a team leaves the others running


@pytest.fixture(scope="module")
def steer_team(steer_path):
    tokenizer = AutoTokenizer.from_pretrained(steer_path)
    models = [_load(steer_path), _load(steer_path)]
    team = TeamVLLM(models, [tokenizer, tokenizer], max_completion_length=MAX_NEW, seed=0, dtype="bfloat16")
    yield team, models, tokenizer
    team.close()


def test_full_fine_tuning_sync_changes_what_the_engine_samples(steer_team):
    team, models, tokenizer = steer_team
    original = _o_proj(models[0]).weight.detach().clone()
    before = team.generate(0, PROMPTS)[0]
    assert not _all(before, 42)

    _steer_weights(models[0], STEER_DIMS[42])
    assert not _all(team.generate(0, PROMPTS)[0], 42)  # the engine still has the old weights
    team.sync(0, models[0])  # fp32 weights into a bf16 engine
    completions, logprobs = team.generate(0, PROMPTS)
    assert completions == [[42] * MAX_NEW] * len(PROMPTS)
    assert all(lp > -1e-3 for row in logprobs for lp in row)
    assert not _all(team.generate(1, PROMPTS)[0], 42)  # agent 1's own weights, swapped in

    _steer_weights(models[1], STEER_DIMS[77])
    team.sync(1, models[1])
    for agent, token in [(1, 77), (0, 42), (1, 77)]:  # one engine: each agent's weights loaded before it generates
        assert team.generate(agent, PROMPTS)[0] == [[token] * MAX_NEW] * len(PROMPTS)

    with torch.no_grad():
        _o_proj(models[0]).weight.copy_(original)
    _steer_weights(models[0], 61)  # now towards EOS instead: every completion is just EOS
    team.sync(0, models[0])
    assert team.generate(0, PROMPTS)[0] == [[tokenizer.eos_token_id]] * len(PROMPTS)

    with torch.no_grad():
        _o_proj(models[0]).weight.copy_(original)
    team.sync(0, models[0])
    assert not _all(team.generate(0, PROMPTS)[0], 42)


def test_lora_and_fully_fine_tuned_agents_share_the_engine(steer_path):
    """A LoRA agent needs its base back in the engine after a fully fine-tuned agent generated, and its adapter."""
    tokenizer = AutoTokenizer.from_pretrained(steer_path)
    lora, full = _lora(steer_path), _load(steer_path)
    _steer_adapter(lora, STEER_DIMS[42])
    _steer_weights(full, STEER_DIMS[77])
    team = TeamVLLM([lora, full], [tokenizer, tokenizer], max_completion_length=MAX_NEW, seed=0)
    try:
        assert team.num_engines == 1 and team.weight_groups == [[0], [1]]
        for agent, token in [(0, 42), (1, 77), (0, 42)]:
            assert team.generate(agent, PROMPTS)[0] == [[token] * MAX_NEW] * len(PROMPTS)
        assert team.weight_loads == [2, 1]  # the base twice, the full agent's weights once
    finally:
        team.close()


def test_lora_team_shares_one_engine_and_serves_each_adapter(steer_path):
    tokenizer = AutoTokenizer.from_pretrained(steer_path)
    models = [_lora(steer_path), _lora(steer_path)]  # two loads of one checkpoint: same name and weights
    team = TeamVLLM(models, [tokenizer, tokenizer], max_completion_length=MAX_NEW, seed=0)
    try:
        assert team.num_engines == 1
        assert team.engine_index(0) == team.engine_index(1) == 0
        assert not any(_all(team.generate(a, PROMPTS)[0], token) for a in (0, 1) for token in (42, 77))

        _steer_adapter(models[0], STEER_DIMS[42])
        _steer_adapter(models[1], STEER_DIMS[77])
        assert not _all(team.generate(0, PROMPTS)[0], 42)  # not synced yet
        team.sync(0, models[0])
        team.sync(1, models[1])
        assert team.generate(0, PROMPTS)[0] == [[42] * MAX_NEW] * len(PROMPTS)
        assert team.generate(1, PROMPTS)[0] == [[77] * MAX_NEW] * len(PROMPTS)

        # A random adapter: the engine's log-probs are those of the peft model.
        with torch.no_grad():
            for name, param in models[1].named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.3)
        team.sync(1, models[1])
        completions, logprobs = team.generate(1, PROMPTS)
        assert not _all(completions, 77)
        for prompt, row, lps in zip(PROMPTS, completions, logprobs):
            torch.testing.assert_close(torch.tensor(lps), _hf_logprobs(models[1], prompt, row), atol=1e-4, rtol=0)
        # Every sync loads the adapter under a new id and drops the old one: one adapter per agent stays loaded.
        assert len(team._llm.llm_engine.list_loras()) == 2

        with pytest.raises(ValueError, match="must be a LoRA adapter"):
            team.sync(0, _load(steer_path))
    finally:
        team.close()


def test_merged_lora_mode_loads_each_lora_agents_merged_weights_into_the_engine(steer_path):
    tokenizer = AutoTokenizer.from_pretrained(steer_path)
    models = [_lora(steer_path), _lora(steer_path)]
    team = TeamVLLM(models, [tokenizer, tokenizer], max_completion_length=MAX_NEW, seed=0, lora_mode="merged")
    try:
        assert team.num_engines == 1 and team.weight_groups == [[0], [1]]
        _steer_adapter(models[0], STEER_DIMS[42])
        _steer_adapter(models[1], STEER_DIMS[77])
        base = _o_proj(models[0]).base_layer.weight.detach().clone()
        team.sync(0, models[0])
        team.sync(1, models[1])
        assert team.generate(0, PROMPTS)[0] == [[42] * MAX_NEW] * len(PROMPTS)
        torch.testing.assert_close(_o_proj(models[0]).base_layer.weight, base)  # merged for the load, then unmerged
        assert team.generate(1, PROMPTS)[0] == [[77] * MAX_NEW] * len(PROMPTS)
        assert team.generate(0, PROMPTS)[0] == [[42] * MAX_NEW] * len(PROMPTS)
    finally:
        team.close()


def test_a_peft_model_vllm_cannot_serve_as_lora_generates_with_its_merged_weights(tied_path):
    tokenizer = AutoTokenizer.from_pretrained(tied_path)
    model = _lora(tied_path, use_dora=True)  # vLLM serves no DoRA adapters
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    reference = _hf_logprobs(model, PROMPTS[0], [11, 12, 13])
    models = [model, _lora(tied_path)]
    team = TeamVLLM(models, [tokenizer, tokenizer], max_completion_length=MAX_NEW, seed=0)
    try:
        assert team.weight_groups == [[0], [1]]
        for agent in (0, 1, 0):  # the DoRA agent's merged weights, the LoRA agent's base, the merged weights again
            completions, logprobs = team.generate(agent, PROMPTS)
            for prompt, row, lps in zip(PROMPTS, completions, logprobs):
                expected = _hf_logprobs(models[agent], prompt, row)
                torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(_hf_logprobs(model, PROMPTS[0], [11, 12, 13]), reference)  # unmerged again
    finally:
        team.close()


def test_plan_weights_shares_weights_only_between_lora_adapters_on_the_same_base(steer_path, tied_path):
    lora_a, lora_b, full = _lora(steer_path), _lora(steer_path), _load(steer_path)
    assert plan_weights([lora_a, full, lora_b]) == [[0, 2], [1]]
    assert plan_weights([full, _load(steer_path)]) == [[0], [1]]  # fully fine-tuned agents diverge
    assert plan_weights([lora_a, _lora(tied_path)]) == [[0], [1]]  # other base checkpoint
    changed = _lora(steer_path)
    with torch.no_grad():
        changed.get_base_model().model.norm.weight.add_(1.0)
    assert plan_weights([lora_a, changed]) == [[0], [1]]  # same name, other frozen weights
    assert plan_weights([lora_a, _lora(steer_path, use_dora=True)]) == [[0], [1]]  # DoRA: merged weights
    assert plan_weights([lora_a, lora_b], lora_mode="merged") == [[0], [1]]


def test_invalid_arguments_name_the_argument(tied_path, tied_team, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tied_path)
    with pytest.raises(ValueError, match="`tokenizers` has 1 entries for 2 models"):
        TeamVLLM([_load(tied_path), _load(tied_path)], [tokenizer])
    team = tied_team[0]
    with pytest.raises(ValueError, match="`agent_index` must be in"):
        team.generate(2, PROMPTS)
    with pytest.raises(ValueError, match="`max_model_length`=256"):
        team.generate(0, [[5] * 252])
    with pytest.raises(ValueError, match="`prompt_ids` must be"):
        team.generate(0, [[]])
    with pytest.raises(ValueError, match="`lora_mode` must be 'adapter' or 'merged', got 'shared'"):
        TeamVLLM([_load(tied_path)], [tokenizer], lora_mode="shared")
    # One engine per process holds every agent's weights in turn: one architecture only, refused before vLLM starts.
    llama_path = _save_tiny(tmp_path / "llama", tied=False, steerable=False, kind="llama")
    llama_tokenizer = AutoTokenizer.from_pretrained(llama_path)
    with pytest.raises(ValueError, match=r"same architecture; agent 1 differs from agent 0 \(model class"):
        TeamVLLM([_load(tied_path), _load(llama_path)], [tokenizer, llama_tokenizer])
    # Names, token ids, dtype and a missing `architectures` (a model built in memory) are not architecture.
    renamed = _load(tied_path).to(torch.bfloat16)
    renamed.config._name_or_path, renamed.config.architectures, renamed.config.pad_token_id = "other", None, 3
    check_one_architecture([_load(tied_path), renamed])
    with pytest.raises(ValueError, match="agent 1 differs from agent 0 \\(tie_word_embeddings: True vs False\\)"):
        TeamVLLM(
            [_load(tied_path), _load(_save_tiny(tmp_path / "untied", tied=False, steerable=False))], [tokenizer] * 2
        )
    with pytest.raises(ValueError, match="several \\(bfloat16, float32\\): pass `dtype`"):
        TeamVLLM([_load(tied_path), _load(tied_path).to(torch.bfloat16)], [tokenizer] * 2)
    with pytest.raises(ValueError, match="`sleep_mode`=True, but vLLM's cpu platform has no sleep mode"):
        TeamVLLM([_load(tied_path)], [tokenizer], sleep_mode=True)


def test_the_engine_length_comes_from_the_runs_prompt_limit_and_the_batched_tokens_from_trls_cap(tied_path):
    tokenizer = AutoTokenizer.from_pretrained(tied_path)
    team = TeamVLLM([_load(tied_path)], [tokenizer], max_completion_length=MAX_NEW, max_prompt_length=10, seed=0)
    try:
        engine = team._llm.llm_engine
        assert engine.model_config.max_model_len == 10 + MAX_NEW  # not the model's 256
        assert engine.vllm_config.scheduler_config.max_num_batched_tokens == 4096  # TRL's cap
        completions, _ = team.generate(0, [[5] * 10])
        assert 1 <= len(completions[0]) <= MAX_NEW
        with pytest.raises(ValueError, match=f"`max_model_length`={10 + MAX_NEW}"):
            team.generate(0, [[5] * 11])
    finally:
        team.close()
