"""Packed weights for CPU generation (fast/packed_linear.py): bf16 packed products equal autocast's bit for bit,
fp16-rounded weights summed in fp32, packing only where it applies and undone after it; the same tokens sampled."""

import contextlib

import pytest
import torch


bf16_kernels = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bf16 kernels on this CPU"
)


@bf16_kernels
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features,in_features", [(576, 576), (1536, 576), (576, 1536), (4096, 64), (17, 33)])
def test_packed_linear_equals_autocast_linear_bit_for_bit(out_features, in_features, bias):
    from comlrl_trl.fast.packed_linear import PackedLinear

    torch.manual_seed(out_features + in_features)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    packed = PackedLinear(layer, rows=8)
    for shape in [(1, in_features), (8, 1, in_features), (4, 13, in_features), (3, 300, in_features)]:
        hidden = torch.randn(*shape)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = layer(hidden)
        got = packed(hidden)
        assert got.dtype == expected.dtype == torch.bfloat16
        assert torch.equal(got, expected), shape


@bf16_kernels
def test_packed_generation_samples_the_same_tokens_with_the_same_scores(qwen_path):
    from transformers import AutoModelForCausalLM

    from comlrl_trl.fast.packed_linear import PackedLinear, packed_linear_weights

    model = AutoModelForCausalLM.from_pretrained(qwen_path)
    prompt = torch.tensor([[5, 9, 14, 3, 7]] * 4)
    settings = dict(do_sample=True, max_new_tokens=12, min_new_tokens=12, top_k=0, output_logits=True)

    def generate(packed: bool):
        torch.manual_seed(7)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            with packed_linear_weights(model, rows=4) if packed else contextlib.nullcontext():
                assert isinstance(model.lm_head.forward, PackedLinear) == packed
                return model.generate(prompt, return_dict_in_generate=True, **settings)

    plain, packed = generate(False), generate(True)
    assert torch.equal(packed.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(packed.logits, plain.logits))
    assert all("forward" not in vars(m) for m in model.modules())  # the layers' own forward again


def test_packing_waits_for_no_grad_and_bf16_autocast_and_undoes_itself_after_an_error():
    from comlrl_trl.fast.packed_linear import packed_linear_weights

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    hooked = model[2].forward = lambda x: x  # something else replaced this one: it is left alone
    with torch.no_grad(), packed_linear_weights(model, rows=2):  # no autocast
        assert "forward" not in vars(model[0])
    with torch.autocast("cpu", dtype=torch.bfloat16), packed_linear_weights(model, rows=2):  # gradients on
        assert "forward" not in vars(model[0])
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        with pytest.raises(RuntimeError), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            with packed_linear_weights(model, rows=2):
                assert "forward" in vars(model[0]) and model[2].forward is hooked
                raise RuntimeError("generation failed")
    assert "forward" not in vars(model[0]) and model[2].forward is hooked


@bf16_kernels
def test_agents_generate_with_packed_weights_in_bf16(make_team, monkeypatch):
    from comlrl_trl.fast.packed_linear import PackedLinear
    from comlrl_trl.generation.cpu import LeanCpuGeneration  # the generator that packs the weights

    trainer = make_team(bf16=True, use_cpu=True)
    calls = []
    call = PackedLinear.__call__
    monkeypatch.setattr(PackedLinear, "__call__", lambda self, hidden: calls.append(1) or call(self, hidden))
    for agent in trainer.agent_trainers:
        calls.clear()
        rollout = LeanCpuGeneration([agent])([["Write a story about item 1:"] * 4])[0]
        assert len(rollout.completion_ids) == 4
        linears = sum(type(m) is torch.nn.Linear for m in agent.model.modules())
        assert len(calls) >= 2 * linears  # every layer, at the prompt and at least one decoding step
        assert not any("forward" in vars(m) for m in agent.model.modules() if type(m) is torch.nn.Linear)


def test_packing_falls_back_to_the_layers_own_forward_where_onednn_cannot_pack(monkeypatch, caplog):
    from comlrl_trl.fast import packed_linear

    def refuse(weight, rows):
        raise RuntimeError("bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(packed_linear, "packing_applies", lambda model: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with caplog.at_level("WARNING"), torch.no_grad(), packed_linear.packed_linear_weights(model, rows=2):
        assert "forward" not in vars(model[0])
        assert model(torch.ones(1, 8)).shape == (1, 8)
    assert "without packed bf16 weights" in caplog.text


def test_fp16_weight_linear_sums_in_fp32_over_weights_rounded_to_fp16():
    from comlrl_trl.fast.packed_linear import Fp16WeightLinear

    layer = torch.nn.Linear(256, 3)
    with torch.no_grad():
        # Row 0: 1 + 2**-12 lies between fp16's neighbours 1 and 1 + 2**-10 and rounds to 1: 256 inputs of 1 sum to
        # 256 (fp32 weights: 256.0625). Row 1: eighths are exact in fp16, so it is the fp32 sum, -32 + 0.5 = -31.5.
        # Row 2: 2**-20 is below fp16's normal range (subnormal step 2**-24): 256 * 2**-20 = 2**-12 exactly.
        layer.weight[0] = 1 + 2**-12
        layer.weight[1] = -0.125
        layer.weight[2] = 2**-20
        layer.bias[:] = torch.tensor([0.0, 0.5, 0.0])
    hidden = torch.ones(2, 1, 256)
    got = Fp16WeightLinear(layer)(hidden)
    assert got.dtype == torch.float32 and got.shape == (2, 1, 3)
    assert got[0, 0].tolist() == [256.0, -31.5, 2**-12]
    assert layer(hidden)[0, 0, 0].item() == 256.0625  # the layer's own forward keeps its fp32 weights


@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (576, 1536)])
def test_fp16_weight_linear_matches_an_fp32_product_over_rounded_weights(shape):
    from comlrl_trl.fast.packed_linear import Fp16WeightLinear

    torch.manual_seed(shape[0])
    layer = torch.nn.Linear(shape[1], shape[0])
    hidden = torch.randn(8, 1, shape[1])
    got = Fp16WeightLinear(layer)(hidden)
    rounded = torch.nn.functional.linear(hidden.double(), layer.weight.half().double(), layer.bias.double())
    exact = torch.nn.functional.linear(hidden.double(), layer.weight.double(), layer.bias.double())
    assert (got.double() - rounded).abs().max() < 1e-5  # fp32 sums over the fp16 weights
    assert (got.double() - exact).abs().max() > 1e-5  # and not the fp32 weights


def _packable_model():
    return torch.nn.Sequential(
        torch.nn.Linear(256, 300), torch.nn.ReLU(), torch.nn.Linear(300, 8), torch.nn.Linear(8, 8)
    )


def test_fp16_packing_covers_wide_fp32_layers_only_without_gradients_or_autocast_and_only_when_asked():
    from comlrl_trl.fast.packed_linear import Fp16WeightLinear, packed_linear_weights

    model = _packable_model()

    def fp16_layers():
        return [i for i, m in enumerate(model) if isinstance(vars(m).get("forward"), Fp16WeightLinear)]

    with torch.no_grad(), packed_linear_weights(model, rows=2, fp16_weights=True):
        assert fp16_layers() == [0, 2]  # the 8-input layer stays fp32
        assert model(torch.ones(1, 256)).shape == (1, 8)
    assert all("forward" not in vars(m) for m in model)
    with torch.no_grad(), packed_linear_weights(model, rows=2):  # not asked
        assert fp16_layers() == []
    with torch.no_grad(), packed_linear_weights(model, rows=2, fp16_weights=True, new_tokens=32):
        assert fp16_layers() == [0, 2]
    with torch.no_grad(), packed_linear_weights(model, rows=2, fp16_weights=True, new_tokens=31):
        assert fp16_layers() == []  # too short a call to pay for packing trainable weights
    model[2].requires_grad_(False)
    with torch.no_grad(), packed_linear_weights(model, rows=2, fp16_weights=True, new_tokens=31):
        assert fp16_layers() == [2]  # a frozen layer is packed once for all calls
    model[2].requires_grad_(True)
    for beyond in (70000.0, -70000.0):  # beyond fp16's largest magnitude, 65504: this layer stays fp32
        with torch.no_grad():
            model[2].weight[3, 7] = beyond
        with torch.no_grad(), packed_linear_weights(model, rows=2, fp16_weights=True):
            assert fp16_layers() == [0]
    with torch.no_grad():
        model[2].weight[3, 7] = 0.0
    with packed_linear_weights(model, rows=2, fp16_weights=True):  # gradients on
        assert fp16_layers() == []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with packed_linear_weights(model, rows=2, fp16_weights=True):  # bf16 runs keep their own packing
            assert fp16_layers() == []
    with pytest.raises(RuntimeError), torch.no_grad(), packed_linear_weights(model, rows=2, fp16_weights=True):
        assert fp16_layers() == [0, 2]
        raise RuntimeError("generation failed")
    assert all("forward" not in vars(m) for m in model)


def test_fp16_packing_falls_back_to_fp32_where_fbgemm_cannot_pack(monkeypatch, caplog):
    from comlrl_trl.fast import packed_linear

    def refuse(weight, bias):
        raise RuntimeError("quantized::linear_prepack_fp16 is not supported by the qnnpack engine")

    monkeypatch.setattr(torch.ops.quantized, "linear_prepack_fp16", refuse)
    model = _packable_model()
    with caplog.at_level("WARNING"), torch.no_grad():
        with packed_linear.packed_linear_weights(model, rows=2, fp16_weights=True):
            assert all("forward" not in vars(m) for m in model)
            assert model(torch.ones(1, 256)).shape == (1, 8)
    assert "with fp32 weights: fbgemm cannot pack" in caplog.text


def test_fp16_generation_samples_as_a_model_with_fp16_rounded_weights(qwen_path):
    from transformers import AutoConfig, GenerationConfig, Qwen2ForCausalLM

    from comlrl_trl.fast.decoding import lean_generate, sampling_config
    from comlrl_trl.fast.packed_linear import packed_linear_weights

    config = AutoConfig.from_pretrained(qwen_path)
    config.update(dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2))
    config.tie_word_embeddings = False  # the head is a Linear of its own; the input embeddings stay fp32
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()  # q, k and v projections with biases
    rounded = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for mine, theirs in zip(model.modules(), rounded.modules()):
            if type(mine) is torch.nn.Linear:
                theirs.weight.copy_(mine.weight.half().float())
                if mine.bias is not None:
                    theirs.bias.copy_(mine.bias)
            elif hasattr(mine, "weight") and not list(mine.children()):
                theirs.weight.copy_(mine.weight)
    prompt = torch.tensor([[5, 9, 14, 3, 7]] * 4)
    settings = GenerationConfig(do_sample=True, max_new_tokens=12, min_new_tokens=12, top_k=0)

    def generate(m, fp16: bool):
        torch.manual_seed(7)
        logits = []
        with torch.no_grad(), packed_linear_weights(m, rows=4, fp16_weights=fp16):
            config = sampling_config(m, settings)
            sequences = lean_generate(m, prompt, torch.ones_like(prompt), config, logits=logits)
        return sequences, logits

    (ours, our_logits), (reference, their_logits) = generate(model, True), generate(rounded, False)
    fp32_logits = generate(model, False)[1]
    assert torch.equal(ours, reference)
    difference = max((a - b).abs().max().item() for a, b in zip(our_logits, their_logits))
    assert difference < 1e-5
    rounding = max((a - b).abs().max().item() for a, b in zip(our_logits, fp32_logits))
    assert rounding > 10 * difference  # the fp32 weights' logits are a rounding away


def test_agents_generate_with_fp16_weights_in_fp32_for_long_calls_unless_turned_off(make_team, monkeypatch):
    from comlrl_trl.fast import packed_linear
    from comlrl_trl.generation.cpu import LeanCpuGeneration  # the generator that packs the weights

    monkeypatch.setattr(packed_linear, "FP16_MIN_IN_FEATURES", 1)  # the tiny model's layers count as wide
    monkeypatch.setattr(packed_linear, "FP16_MIN_NEW_TOKENS", 8)  # and a call of 8 tokens as long
    calls = []
    call = packed_linear.Fp16WeightLinear.__call__
    monkeypatch.setattr(
        packed_linear.Fp16WeightLinear, "__call__", lambda self, hidden: calls.append(1) or call(self, hidden)
    )
    on = {"cpu_fp16_generation_weights": True}
    settings = [(on, True), ({**on, "max_new_tokens": 7}, False), ({}, False)]  # off by default
    for setting, expected in settings:
        trainer = make_team(bf16=False, use_cpu=True, **setting)
        for agent in trainer.agent_trainers:
            calls.clear()
            rollout = LeanCpuGeneration([agent])([["Write a story about item 1:"] * 4])[0]
            assert len(rollout.completion_ids) == 4
            linears = sum(type(m) is torch.nn.Linear for m in agent.model.modules())
            assert (len(calls) >= 2 * linears) if expected else calls == []
            assert not any("forward" in vars(m) for m in agent.model.modules() if type(m) is torch.nn.Linear)


def test_frozen_layers_keep_their_fp16_copy_until_their_weights_change(monkeypatch):
    from comlrl_trl.fast.packed_linear import packed_linear_weights

    packs = []
    prepack = torch.ops.quantized.linear_prepack_fp16
    monkeypatch.setattr(
        torch.ops.quantized, "linear_prepack_fp16", lambda weight, bias: packs.append(1) or prepack(weight, bias)
    )
    model = _packable_model()
    model[0].requires_grad_(False)  # a frozen base layer; model[2] stays trainable
    hidden = torch.ones(1, 256)
    for call in range(2):
        with torch.no_grad(), packed_linear_weights(model, rows=1, fp16_weights=True):
            model(hidden)
        assert len(packs) == 2 + call  # the frozen layer once, the trainable one at every call
    with torch.no_grad():
        model[0].weight.fill_(0.25)  # exact in fp16; a new version of the same storage
        model[0].bias.zero_()
    with torch.no_grad(), packed_linear_weights(model, rows=1, fp16_weights=True):
        assert model[0](hidden)[0, 0].item() == 64.0  # 256 inputs of 1 times 0.25, from the changed weights
    assert len(packs) == 5
    model[0].weight = torch.nn.Parameter(torch.full((300, 256), 0.5), requires_grad=False)  # another tensor
    with torch.no_grad(), packed_linear_weights(model, rows=1, fp16_weights=True):
        assert model[0](hidden)[0, 0].item() == 128.0
    assert len(packs) == 7


def test_a_frozen_layer_beyond_fp16_range_stays_fp32_and_is_checked_once_while_unchanged(monkeypatch):
    from comlrl_trl.fast.packed_linear import Fp16WeightLinear, packed_linear_weights

    checks = []
    aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda tensor: checks.append(1) or aminmax(tensor))
    model = _packable_model()
    model.requires_grad_(False)
    with torch.no_grad():
        model[0].weight[0, 0] = -70000.0  # beyond fp16's largest magnitude, 65504
    for _ in range(2):
        with torch.no_grad(), packed_linear_weights(model, rows=1, fp16_weights=True):
            assert "forward" not in vars(model[0])
            assert isinstance(vars(model[2]).get("forward"), Fp16WeightLinear)
    assert len(checks) == 2  # layers 0 and 2, at the first call only: the frozen weights did not change
