"""The learning benchmark's arithmetic (benchmarks/learning.py) and its evaluation reward, with hand-worked values."""

import math
import sys
from pathlib import Path

import pytest


sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import learning  # noqa: E402
from gradient_precision import agreement  # noqa: E402
from learning_task import completion_shape, evaluate_team, length_ratio_reward  # noqa: E402


def _run(seed, points):
    return {"seed": seed, "updates": 30, "points": points}


def _point(epoch, reward, cpu):
    return {"epoch": epoch, "reward": reward, "train_cpu_s": cpu}


def test_summary_averages_seeds_per_epoch_and_keeps_the_spread():
    runs = [
        _run(0, [_point(1, 0.4, 100.0), _point(2, 0.6, 200.0)]),
        _run(1, [_point(1, 0.5, 110.0), _point(2, 0.8, 220.0)]),
    ]
    summary = learning.summarise("ours", runs)
    assert [p["reward_mean"] for p in summary["per_epoch"]] == pytest.approx([0.45, 0.7])
    assert (summary["per_epoch"][1]["reward_min"], summary["per_epoch"][1]["reward_max"]) == (0.6, 0.8)
    assert summary["cpu_s"] == pytest.approx(210.0)
    assert summary["final_reward"] == pytest.approx(0.7)


def test_cpu_to_reach_interpolates_between_evaluations():
    summary = {
        "per_epoch": [
            {"reward_mean": 0.4, "cpu_s_mean": 100.0},
            {"reward_mean": 0.6, "cpu_s_mean": 200.0},
        ]
    }
    # 0.5 lies halfway from 0.4 to 0.6: halfway from 100 to 200 CPU seconds.
    assert learning.cpu_to_reach(summary, 0.5) == pytest.approx(150.0)
    assert learning.cpu_to_reach(summary, 0.3) == 100.0  # reached at the first evaluation
    assert learning.cpu_to_reach(summary, 0.61) is None  # never reached


def test_extra_rows_parse_labels_and_json_values():
    assert learning.parse_row("on-policy=steps_per_generation=1,temperature=1.0") == (
        "on-policy",
        {"steps_per_generation": 1, "temperature": 1.0},
    )
    assert learning.parse_row("sched=lr_scheduler_type=constant") == ("sched", {"lr_scheduler_type": "constant"})
    with pytest.raises(Exception, match="key=value"):
        learning.parse_row("broken=steps_per_generation")


def test_evaluation_reward_is_the_tutorial_reward():
    # 10 and 25 characters: ratio 2.5, inside [2, 3] -> 1. 10 and 40: ratio 4, 1 above 3 -> exp(-1).
    # 10 and 15: ratio 1.5, 0.5 below 2 -> exp(-0.5). An empty first answer scores 0.
    rewards = length_ratio_reward(["a" * 10, "a" * 10, "a" * 10, ""], ["b" * 25, "b" * 40, "b" * 15, "b"])
    assert rewards == pytest.approx([1.0, math.exp(-1.0), math.exp(-0.5), 0.0])


def test_the_effective_config_has_the_library_defaults_and_the_row_overrides():
    defaults = learning.effective_config({})
    assert (defaults["lr_scheduler_type"], defaults["temperature"], defaults["top_k"]) == ("constant", 0.6, 50)
    linear = learning.effective_config({"lr_scheduler_type": "linear", "steps_per_generation": 1})
    assert (linear["lr_scheduler_type"], linear["steps_per_generation"]) == ("linear", 1)
    assert {k: v for k, v in linear.items() if k not in ("lr_scheduler_type", "steps_per_generation")} == {
        k: v for k, v in defaults.items() if k not in ("lr_scheduler_type", "steps_per_generation")
    }


def test_a_cached_run_is_reused_only_under_the_same_config(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(learning, "run_worker", lambda system, settings: calls.append(system) or {"points": [1]})
    config = {"lr_scheduler_type": "constant", "top_p": 0.6}
    first = learning.cached_run(tmp_path, "ours-defaults-seed0", "ours", {}, config)
    again = learning.cached_run(tmp_path, "ours-defaults-seed0", "ours", {}, dict(config))
    assert calls == ["ours"] and first == again == {"points": [1], "config": config}  # measured once, then reused
    # A default changed since the run was measured: refused, naming the setting, instead of reused as current.
    with pytest.raises(ValueError, match=r"ours-defaults-seed0.json was measured with other settings \(\['top_p'\]"):
        learning.cached_run(
            tmp_path, "ours-defaults-seed0", "ours", {}, {"lr_scheduler_type": "constant", "top_p": 1.0}
        )
    # The peer's runs carry no config of ours and are reused as they are.
    learning.cached_run(tmp_path, "peer-seed0", "peer", {})
    assert learning.cached_run(tmp_path, "peer-seed0", "peer", {}) == {"points": [1]} and calls == ["ours", "peer"]


class _Tokenizer:
    eos_token_id = 2
    all_special_ids = [0, 1, 2]


def test_completion_shape_counts_tokens_up_to_eos_and_the_special_tokens_inside():
    # Row 1 stops at its EOS (index 3) after one pad token the model emitted inside the text; the pads after the
    # EOS are padding, not counted. Row 2 has no EOS: all 2 tokens count, none special.
    rows = [[5, 0, 6, 2, 0, 0], [7, 8]]
    shape = completion_shape(rows, ["abcd", "ef"], _Tokenizer())
    assert shape == {"chars": 3.0, "tokens": 2.5, "special_tokens": 0.5}


class _Batch(dict):
    def to(self, device):
        return self


class _XTokenizer:
    """Every token decodes to one "x"; token 0 is the EOS and pad token."""

    eos_token_id = pad_token_id = 0
    pad_token = "<eos>"
    all_special_ids = [0]

    def __call__(self, prompts, **kwargs):
        import torch

        return _Batch(input_ids=torch.ones(len(prompts), 3, dtype=torch.long))

    def batch_decode(self, rows, skip_special_tokens):
        return ["x" * sum(1 for token in row if token != 0) for row in rows.tolist()]


class _Model:
    """Generates `lengths[setting]` tokens per row, the setting read from generate's sampling arguments."""

    training, device = False, "cpu"

    def __init__(self, lengths):
        self.lengths, self.calls = lengths, []

    def eval(self):
        pass

    def generate(self, input_ids, **kwargs):
        import torch

        self.calls.append(kwargs)
        setting = "greedy" if not kwargs["do_sample"] else ("T0.6" if kwargs["temperature"] == 0.6 else "T1")
        rows = input_ids.size(0) * kwargs.get("num_return_sequences", 1)
        new = torch.full((rows, 8), 0, dtype=torch.long)
        new[:, : self.lengths[setting]] = 5
        return torch.cat([torch.ones(rows, 3, dtype=torch.long), new], dim=1)


def test_the_evaluation_scores_untempered_samples_and_greedy_and_reports_the_training_sampling_beside():
    # Agent 0 writes 2 characters; agent 1 writes 5 untempered (ratio 2.5: reward 1), 2 greedy (ratio 1, 1 below
    # 2: exp(-1)) and 8 at the training settings (ratio 4, 1 above 3: exp(-1)).
    brief, detailed = _Model({"T1": 2, "greedy": 2, "T0.6": 2}), _Model({"T1": 5, "greedy": 2, "T0.6": 8})
    result = evaluate_team([brief, detailed], [_XTokenizer(), _XTokenizer()], ["a", "b"], max_new_tokens=8, samples=3)
    assert result["sampled"] == pytest.approx(1.0)
    assert result["greedy"] == pytest.approx(math.exp(-1.0))
    assert result["reward"] == pytest.approx((1.0 + math.exp(-1.0)) / 2)  # the training sampling is not in it
    assert result["sampled_as_trained"] == pytest.approx(math.exp(-1.0))
    sampling = [{k: call.get(k) for k in ("do_sample", "temperature", "top_p", "top_k")} for call in detailed.calls]
    assert sampling == [
        {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0},
        {"do_sample": False, "temperature": None, "top_p": None, "top_k": None},
        {"do_sample": True, "temperature": 0.6, "top_p": 0.6, "top_k": 50},
    ]


class _TemplateTokenizer:
    """A chat template that brackets each message; records how it was called."""

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        self.calls.append((tokenize, add_generation_prompt))
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


def test_chat_prompts_are_one_user_message_each_ready_for_the_answer_and_plain_prompts_are_kept():
    import learning_worker

    tokenizer = _TemplateTokenizer()
    texts = ["Tell a joke:", "Describe a city:"]
    assert learning_worker.prompts({"chat": True}, tokenizer, texts) == [
        "<user>Tell a joke:</user><assistant>",
        "<user>Describe a city:</user><assistant>",
    ]
    assert tokenizer.calls == [(False, True), (False, True)]
    assert learning_worker.prompts({"chat": False}, tokenizer, texts) == texts
    assert learning_worker.prompts({}, tokenizer, texts) == texts
    assert len(tokenizer.calls) == 2


def test_gradient_sign_agreement_skips_zeros_and_splits_at_the_reference_median():
    import torch

    reference = torch.tensor([0.1, 0.2, 3.0, 4.0, 0.0], dtype=torch.float64)
    gradient = torch.tensor([-0.1, -0.2, 3.0, 4.0, 0.0], dtype=torch.float64)
    result = agreement(gradient, reference)
    # The element that is zero in both is left out (counted, it would make the agreement 3/5).
    assert result["sign agreement"] == 0.5
    # The median of |reference| over the other four is 0.2 (torch's lower middle): 0.1 and 0.2 disagree, 3 and 4 agree.
    assert result["sign agreement, smaller half"] == 0.0
    assert result["sign agreement, larger half"] == 1.0
    # dot = -0.01 - 0.04 + 9 + 16 = 24.95; both norms are sqrt(25.05).
    assert result["cosine"] == pytest.approx(24.95 / 25.05)


def test_rounded_forward_weights_are_bf16_and_their_gradient_is_the_fp32_one():
    import torch
    from torch import nn
    from weight_rounding import WeightRounding

    layer = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1 + 2**-9)  # bf16 keeps 7 bits after the point: rounds to 1.0
    rounding = WeightRounding([nn.Sequential(layer)])
    x = torch.tensor([[1 + 2**-10]])
    out = layer(x)
    assert out.item() == 1 + 2**-10  # weight 1.0: the rounded one
    out.sum().backward()
    # Straight through, not rounded to bf16 on the way back: d(w x)/dw = x = 1 + 2**-10 (bf16 would give 1.0).
    assert layer.parametrizations.weight.original.grad.item() == 1 + 2**-10
    with rounding.paused():
        assert layer(torch.ones(1, 1)).item() == 1 + 2**-9  # the master weight, for the evaluation
    with torch.no_grad():
        assert layer(torch.ones(1, 1)).item() == 1.0
        layer.parametrizations.weight.original.add_(2**-6)  # an optimiser step in place
        assert layer(torch.ones(1, 1)).item() == 1 + 2**-6  # the kept rounded copy follows the step
    assert rounding.initial[0].item() == 1 + 2**-9


def test_weight_rounding_refuses_weights_that_are_not_fp32():
    import torch
    from torch import nn
    from weight_rounding import WeightRounding

    with pytest.raises(TypeError, match="fp32 weights"):
        WeightRounding([nn.Linear(2, 2).to(torch.bfloat16)])
    with pytest.raises(ValueError, match="mode must be 'nearest', 'stochastic' or 'relative'"):
        WeightRounding([nn.Linear(2, 2)], mode="truncate")


def test_seen_change_compares_the_bf16_change_with_the_master_change():
    import torch
    from weight_rounding import seen_change

    initial = [torch.tensor([1.0, 1.0])]
    # +2**-9 is below half of bf16's step at 1 (2**-8): invisible. +2**-6 is two steps: seen exactly.
    current = [torch.tensor([1 + 2**-9, 1 + 2**-6])]
    result = seen_change(initial, current)
    # d = (2**-9, 2**-6), e = (0, 2**-6): |d|^2 = 2**-12 (1 + 2**-6) = 2**-12 * 65/64, |e|^2 = e.d = 2**-12.
    assert result["cosine"] == pytest.approx(8 / math.sqrt(65))
    assert result["norm_ratio"] == pytest.approx(8 / math.sqrt(65))
    assert result["error"] == pytest.approx(1 / math.sqrt(65))  # |e - d| = 2**-9
    assert (result["changed"], result["moved"]) == (0.5, 1.0)


def test_rounded_forward_weights_need_fp32_rows(monkeypatch, capsys):
    monkeypatch.setattr(
        sys, "argv", ["learning.py", "--systems", "ours", "--row", "x=bf16=true", "--forward-weights", "bf16"]
    )
    with pytest.raises(SystemExit):
        learning.main()
    assert "--row runs with bf16=false" in capsys.readouterr().err


def test_stochastic_bf16_rounds_to_a_neighbour_in_proportion_to_the_distance():
    import torch
    from weight_rounding import stochastic_bf16

    # 1 + 2**-9 is a quarter of the way from 1 to its upper bf16 neighbour 1 + 2**-7; -(1 + 2**-9) mirrors it.
    w = torch.tensor([1 + 2**-9, -(1 + 2**-9), 1.0]).repeat(100_000)
    rounded = stochastic_bf16(w, torch.Generator().manual_seed(0)).float().view(-1, 3)
    assert set(rounded[:, 0].unique().tolist()) == {1.0, 1 + 2**-7}
    assert set(rounded[:, 1].unique().tolist()) == {-1.0, -(1 + 2**-7)}  # away from zero as often for negatives
    assert (rounded[:, 2] == 1.0).all()  # values bf16 holds exactly stay
    # Binomial(100000, 1/4): standard deviation 0.0014 of the fraction.
    assert (rounded[:, 0] > 1).float().mean().item() == pytest.approx(0.25, abs=0.007)
    assert (rounded[:, 1] < -1).float().mean().item() == pytest.approx(0.25, abs=0.007)


def test_stochastic_rounding_draws_once_per_value_of_the_weight():
    import torch
    from torch import nn
    from weight_rounding import WeightRounding

    layer = nn.Linear(4096, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1 + 2**-9)
    WeightRounding([layer], mode="stochastic", seed=0)
    ones = torch.ones(1, 4096)
    first = layer(ones)
    with torch.no_grad():
        assert layer(ones).item() == first.item()  # generation and the loss see the same copy of one value
        layer.parametrizations.weight.original.add_(2**-20)  # a step: a new value, a new draw
        assert layer(ones).item() != first.item()
    # About a quarter of the 4096 weights rounded up by 2**-7: 4096 + 1024 * 2**-7 = 4104 on average.
    assert first.item() == pytest.approx(4104, abs=1.5)


def test_relative_rounding_moves_a_weight_only_by_whole_spacings_of_its_own_change():
    import torch
    from weight_rounding import relative_bf16

    # w0 just below the midpoint between 1 and 1 + 2**-7 (bf16 value 1.0); a change of 2**-11 takes it past the midpoint:
    # nearest rounding jumps a whole spacing, relative rounding stays (2**-11 is under half a spacing, 2**-8).
    w0 = torch.tensor([1 + 2**-8 - 2**-12, 1 + 2**-8 - 2**-12, -0.75, 0.0])
    w = w0 + torch.tensor([2**-11, 3 * 2**-8, -(2**-8), 2**-20])
    assert w[0].to(torch.bfloat16).item() == 1 + 2**-7
    rounded = relative_bf16(w, w0).float()
    assert rounded[0].item() == 1.0
    assert rounded[1].item() == 1 + 2**-6  # 1.5 spacings, rounded half to even: 2 spacings of 2**-7
    assert rounded[2].item() == -0.75 - 2**-8  # the spacing at 0.75 is 2**-8: one spacing
    assert rounded[3].item() == 2**-20  # at zero the change itself, which bf16 holds


def test_spacing_summary_compares_the_step_with_bf16_spacing_at_each_weight():
    import torch
    from weight_rounding import spacing_summary

    # Spacings: 0.75 in [0.5, 1): 2**-8 = 0.0039; -0.1 in [2**-4, 2**-3): 2**-11; 3.0 in [2, 4): 2**-6. Zero is left out.
    summary = spacing_summary([torch.tensor([[0.75, -0.1], [0.0, 3.0]])], step=1e-3)
    assert summary["median_magnitude"] == pytest.approx(0.1, rel=1e-6)  # torch's lower middle of 0, 0.1, 0.75, 3
    assert summary["median_spacing"] == 2**-8
    assert summary["above_four_steps"] == pytest.approx(1 / 3)  # only 2**-6 exceeds 0.004; 2**-8 = 0.0039 does not
    assert summary["elements"] == 4
