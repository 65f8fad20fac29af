"""Our own decoding loop (`comlrl_trl/fast/decoding.py`): `generate`'s tokens and numbers, nothing replaced."""

import contextlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from comlrl_trl.fast import decoding
from comlrl_trl.fast.decoding import LeanDecodingUnavailable, lean_decoding_applies, lean_generate, sampling_config
from comlrl_trl.fast.packed_linear import packed_linear_weights
from comlrl_trl.generation import cpu
from comlrl_trl.loading import base_model
from comlrl_trl.testing import tiny_model_path


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_tokenizer(request):
    path = tiny_model_path(request.param)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer


def _generate(model, tokenizer, lean: bool, precision: str, seed: int = 0, **settings):
    """The sequences, every step's logits and the random state after: `model.generate`'s, or `lean_generate`'s."""
    prompts = ["Write a story about item 3:", "Hi", "Tell me", "Write a story about item 12 and more:"]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)  # left padding of different lengths
    settings = {
        "max_new_tokens": 12,
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "pad_token_id": tokenizer.pad_token_id,
        **settings,
    }
    if not settings["do_sample"]:
        settings.update(temperature=None, top_k=None, top_p=None)
    config = GenerationConfig(**settings)
    bf16 = precision == "bf16"
    with (
        torch.no_grad(),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16),
        packed_linear_weights(model, rows=len(prompts)) if bf16 else contextlib.nullcontext(),
    ):
        torch.manual_seed(seed)
        if lean:
            logits = []
            model = base_model(model)
            sequences = lean_generate(
                model, encoded.input_ids, encoded.attention_mask, sampling_config(model, config), logits=logits
            )
            return sequences, torch.stack(logits), torch.get_rng_state()
        config.update(output_logits=True, return_dict_in_generate=True)
        out = model.generate(**encoded, generation_config=config)
    return out.sequences, torch.stack(out.logits), torch.get_rng_state()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_generations_and_logits_are_the_models_own_bit_for_bit(model_and_tokenizer, precision, monkeypatch):
    model, tokenizer = model_and_tokenizer
    steps, prefills = [], []
    step, prefill = decoding._decoding_step, decoding._lean_prefill
    monkeypatch.setattr(decoding, "_decoding_step", lambda *args: steps.append(1) or step(*args))
    monkeypatch.setattr(decoding, "_lean_prefill", lambda *args: prefills.append(1) or prefill(*args))
    for seed in (0, 1):
        theirs = _generate(model, tokenizer, lean=False, precision=precision, seed=seed, min_new_tokens=12)
        assert steps == [] and prefills == []  # nothing of ours runs inside transformers' generate
        ours = _generate(model, tokenizer, lean=True, precision=precision, seed=seed, min_new_tokens=12)
        assert len(steps) == 11  # every step after the prompt's
        assert len(prefills) == 1  # the prompt's forward too
        steps.clear()
        prefills.clear()
        for mine, reference in zip(ours, theirs):
            assert torch.equal(mine, reference)  # tokens, every step's logits, the random state after
        assert ours[0].shape[1] > 12


def test_rows_that_end_early_are_padded_as_by_the_model(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    # Every token but a few is end-of-sequence for this test, so rows finish at different steps.
    eos = list(range(tokenizer.vocab_size))[5:]
    theirs = _generate(model, tokenizer, lean=False, precision="fp32", eos_token_id=eos)
    ours = _generate(model, tokenizer, lean=True, precision="fp32", eos_token_id=eos)
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)


def test_nothing_of_the_model_or_its_class_is_replaced_while_it_decodes(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    seen = []
    step = decoding._decoding_step

    def look(*args):
        seen.append(("forward" in vars(model), "_sample" in vars(type(model)), model.forward.__func__))
        return step(*args)

    monkeypatch.setattr(decoding, "_decoding_step", look)
    _generate(model, tokenizer, lean=True, precision="fp32")
    assert seen and all(s == (False, False, type(model).forward) for s in seen)


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize(
    "settings",
    [{}, {"repetition_penalty": 1.3, "min_p": 0.05}, {"top_k": 0, "top_p": 1.0}],
    ids=["top-k-top-p", "penalty-min-p", "no-filter"],
)
def test_other_settings_sample_as_transformers_does(model_and_tokenizer, greedy, settings):
    model, tokenizer = model_and_tokenizer
    settings = {**settings, "do_sample": not greedy}
    for seed in (0, 1):
        theirs = _generate(model, tokenizer, lean=False, precision="fp32", seed=seed, **settings)
        ours = _generate(model, tokenizer, lean=True, precision="fp32", seed=seed, **settings)
        for mine, reference in zip(ours, theirs):
            assert torch.equal(mine, reference)


@pytest.mark.parametrize(
    "settings,reason",
    [
        ({"num_beams": 2}, "beam_sample generation"),
        ({"num_return_sequences": 2}, "several sequences per prompt"),
        ({"prefill_chunk_size": 3}, "a chunked prompt"),
        ({"stop_strings": ["x"]}, "stop strings or a time limit"),
        ({"max_time": 1.0}, "stop strings or a time limit"),
        ({"cache_implementation": "static"}, "a static cache"),
        ({"return_dict_in_generate": True, "output_scores": True}, "returned scores"),
        ({"output_hidden_states": True}, "the generation settings"),
        ({"max_new_tokens": None, "max_length": 30}, "no max_new_tokens"),
    ],
)
def test_settings_the_loop_does_not_run_are_refused_before_any_token(model_and_tokenizer, settings, reason):
    model, _ = model_and_tokenizer
    config = GenerationConfig(**{"max_new_tokens": 4, "do_sample": True, **settings})
    with pytest.raises(LeanDecodingUnavailable, match=reason):
        sampling_config(model, config)
    eager = AutoModelForCausalLM.from_pretrained(model.name_or_path, attn_implementation="eager")
    with pytest.raises(LeanDecodingUnavailable, match="not one the lean decoding loop runs"):
        sampling_config(eager, GenerationConfig(max_new_tokens=4))


def test_applies_only_where_its_forward_is_the_models(model_and_tokenizer):
    model, _ = model_and_tokenizer
    assert lean_decoding_applies(model)
    handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *args: None)
    try:
        assert not lean_decoding_applies(model)  # a hook it would skip
    finally:
        handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert not lean_decoding_applies(model)  # a hook for every module call
    finally:
        handle.remove()
    assert lean_decoding_applies(model)
    eager = AutoModelForCausalLM.from_pretrained(model.name_or_path, attn_implementation="eager")
    assert not lean_decoding_applies(eager)


def test_agents_decode_through_it_and_train_as_without_it(make_team, qwen_path, monkeypatch):
    def train(lean: bool):
        trainer = make_team(
            generation_backend="cpu" if lean else "transformers",
            reward_func=lambda a, b: [float(len(x) - len(y)) for x, y in zip(a, b)],
            max_steps=2,
            joint_generation=False,  # each agent's own call: transformers' tokens (the team's loop draws differently)
        )
        trainer.train()
        rows = [
            {k: v for k, v in row.items() if "time" not in k and "per_second" not in k}
            for row in trainer.state.log_history
        ]
        return rows, [[p.detach().clone() for p in agent.model.parameters()] for agent in trainer.agent_trainers]

    steps, loops = [], []
    step, loop = decoding._decoding_step, cpu.lean_generate
    monkeypatch.setattr(decoding, "_decoding_step", lambda *args: steps.append(args[0]) or step(*args))
    monkeypatch.setattr(cpu, "lean_generate", lambda *args, **kwargs: loops.append(args[0]) or loop(*args, **kwargs))
    ours = train(lean=True)
    assert len({id(model) for model in steps}) == 2  # both agents decoded through it
    assert {id(model) for model in loops} == {id(model) for model in steps}  # in our sampling loop
    theirs = train(lean=False)
    assert ours[0] == theirs[0]  # the same rewards, losses and metrics at every step
    for mine, reference in zip(ours[1], theirs[1]):
        assert all(torch.equal(a, b) for a, b in zip(mine, reference))
    initial = list(AutoModelForCausalLM.from_pretrained(qwen_path).parameters())
    assert all(any(not torch.equal(a, b) for a, b in zip(agent, initial)) for agent in ours[1])  # both trained


def test_lora_models_decode_through_their_transformers_model_bit_for_bit(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    lora = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.float32),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    torch.manual_seed(0)
    for name, parameter in lora.named_parameters():
        if "lora_B" in name:  # zero at initialisation: the adapters would add nothing
            parameter.data.normal_(0, 0.5)
    steps = []
    step = decoding._decoding_step
    monkeypatch.setattr(decoding, "_decoding_step", lambda *args: steps.append(args[0]) or step(*args))
    for precision in ("fp32", "bf16"):
        theirs = _generate(lora, tokenizer, lean=False, precision=precision, min_new_tokens=12)
        ours = _generate(lora, tokenizer, lean=True, precision=precision, min_new_tokens=12)
        for mine, reference in zip(ours, theirs):
            assert torch.equal(mine, reference)
    assert len(steps) == 22 and all(m is lora.get_base_model() for m in steps)
    assert "forward" not in vars(lora.get_base_model())
