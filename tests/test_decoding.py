"""Lean decoding steps (`comlrl_trl/fast/decoding.py`): the model's own numbers, through fewer Python calls."""

import contextlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, StoppingCriteria, StoppingCriteriaList

from comlrl_trl.fast import decoding
from comlrl_trl.fast.decoding import lean_decoding, lean_decoding_applies
from comlrl_trl.fast.packed_linear import packed_linear_weights
from comlrl_trl.testing import tiny_model_path


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_and_tokenizer(request):
    path = tiny_model_path(request.param)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tokenizer


def _generate(model, tokenizer, lean: bool, precision: str, seed: int = 0, stopping_criteria=None, **settings):
    prompts = ["Write a story about item 3:", "Hi", "Tell me", "Write a story about item 12 and more:"]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)  # left padding of different lengths
    settings = {
        "max_new_tokens": 12,
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "pad_token_id": tokenizer.pad_token_id,
        "output_logits": True,
        "return_dict_in_generate": True,
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
        lean_decoding(model) if lean else contextlib.nullcontext(),
    ):
        torch.manual_seed(seed)
        out = model.generate(**encoded, generation_config=config, stopping_criteria=stopping_criteria)
    return out.sequences, torch.stack(out.logits), torch.get_rng_state()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_generations_and_logits_are_the_models_own_bit_for_bit(model_and_tokenizer, precision, monkeypatch):
    model, tokenizer = model_and_tokenizer
    steps, loops, prefills = [], [], []
    step, loop, prefill = decoding._decoding_step, decoding._sampling_loop, decoding._lean_prefill
    monkeypatch.setattr(decoding, "_decoding_step", lambda *args: steps.append(1) or step(*args))
    monkeypatch.setattr(decoding, "_sampling_loop", lambda *args: loops.append(1) or loop(*args))
    monkeypatch.setattr(decoding, "_lean_prefill", lambda *args: prefills.append(1) or prefill(*args))
    for seed in (0, 1):
        theirs = _generate(model, tokenizer, lean=False, precision=precision, seed=seed, min_new_tokens=12)
        assert steps == [] and loops == [] and prefills == []
        ours = _generate(model, tokenizer, lean=True, precision=precision, seed=seed, min_new_tokens=12)
        assert len(steps) == 11  # every step after the prompt's
        assert len(loops) == 1 and len(prefills) == 1  # through our sampling loop, the prompt's forward too
        steps.clear()
        loops.clear()
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


def test_the_models_forward_is_back_after_the_block_and_after_an_error(model_and_tokenizer):
    model, _ = model_and_tokenizer
    assert "forward" not in vars(model)
    assert "_sample" not in vars(type(model))  # transformers' loop, inherited from GenerationMixin
    with lean_decoding(model):
        assert "forward" in vars(model)
        assert "_sample" in vars(type(model))
    assert "forward" not in vars(model)
    assert "_sample" not in vars(type(model))
    own = model.forward.__func__.__get__(model)  # a forward set on the instance (as TRL's fused head does)
    model.forward = own
    try:
        with pytest.raises(RuntimeError, match="boom"), lean_decoding(model):
            assert model.forward is not own
            raise RuntimeError("boom")
        assert model.forward is own
        assert "_sample" not in vars(type(model))
    finally:
        del model.forward


class _RecordsScores(StoppingCriteria):
    """A user's stopping criterion: stops a row at token 7, and records the scores argument it is handed."""

    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(None if scores is None else len(scores))
        return input_ids[:, -1] == 7


@pytest.mark.parametrize("keep_scores", [False, True])
def test_greedy_search_scores_and_a_users_criterion_are_as_in_transformers_loop(
    model_and_tokenizer, keep_scores, monkeypatch
):
    model, tokenizer = model_and_tokenizer
    loops = []
    loop = decoding._sampling_loop
    monkeypatch.setattr(decoding, "_sampling_loop", lambda *args: loops.append(1) or loop(*args))
    results = []
    for lean in (False, True):
        criterion = _RecordsScores()
        sequences, logits, state = _generate(
            model,
            tokenizer,
            lean=lean,
            precision="fp32",
            do_sample=False,
            output_scores=keep_scores,
            stopping_criteria=StoppingCriteriaList([criterion]),
        )
        results.append((sequences, logits, state, criterion.seen))
    (ours, theirs) = results[1], results[0]
    assert loops == [1]
    for mine, reference in zip(ours[:3], theirs[:3]):
        assert torch.equal(mine, reference)
    assert ours[3] == theirs[3]  # the criterion saw the same argument at every step
    assert theirs[3] == (list(range(1, len(theirs[3]) + 1)) if keep_scores else [None] * len(theirs[3]))


def test_generations_with_hidden_states_keep_transformers_loop(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    loops = []
    loop = decoding._sampling_loop
    monkeypatch.setattr(decoding, "_sampling_loop", lambda *args: loops.append(1) or loop(*args))
    theirs = _generate(model, tokenizer, lean=False, precision="fp32", output_hidden_states=True)
    ours = _generate(model, tokenizer, lean=True, precision="fp32", output_hidden_states=True)
    assert loops == []
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)


class _Stepped(Exception):
    pass


def test_other_calls_run_the_models_forward(model_and_tokenizer, monkeypatch):
    model, _ = model_and_tokenizer

    def step(*args):
        raise _Stepped

    monkeypatch.setattr(decoding, "_decoding_step", step)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad(), lean_decoding(model):
        prompt = model(input_ids=ids, use_cache=True)  # the prompt: several positions, no cache yet
        assert prompt.logits.shape[1] == 3
        with pytest.raises(_Stepped):  # a decoding step goes through it
            model(input_ids=ids[:, :1], cache=prompt.cache, use_cache=True)
        model(input_ids=ids[:, :1], cache=prompt.cache, use_cache=True, output_hidden_states=True)


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
    with lean_decoding(eager):
        assert "forward" not in vars(eager)


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
    step, loop = decoding._decoding_step, decoding._sampling_loop
    monkeypatch.setattr(decoding, "_decoding_step", lambda *args: steps.append(args[0]) or step(*args))
    monkeypatch.setattr(decoding, "_sampling_loop", lambda *args: loops.append(args[0]) or loop(*args))
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


def test_a_chunked_prompt_runs_transformers_prefill_and_then_our_loop(model_and_tokenizer, monkeypatch):
    model, tokenizer = model_and_tokenizer
    loops, prefills = [], []
    loop, prefill = decoding._sampling_loop, decoding._lean_prefill
    monkeypatch.setattr(decoding, "_sampling_loop", lambda *args: loops.append(1) or loop(*args))
    monkeypatch.setattr(decoding, "_lean_prefill", lambda *args: prefills.append(1) or prefill(*args))
    theirs = _generate(model, tokenizer, lean=False, precision="fp32", prefill_chunk_size=3)
    ours = _generate(model, tokenizer, lean=True, precision="fp32", prefill_chunk_size=3)
    assert loops == [1] and prefills == []
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)
