"""MAGRPOConfig and its variants: defaults, spec/TRL aliases, validation and CLI parsing (no models)."""

import pytest
import torch
from transformers import HfArgumentParser
from transformers.utils import is_torch_bf16_gpu_available
from trl import TrlParser

from comlrl_trl import precision
from comlrl_trl.integrations.machine import cpu_model
from comlrl_trl.precision import cpu_has_fast_bf16
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAREINFORCEConfig, MAReMaxConfig, MARLOOConfig
from comlrl_trl.utils.reward_processor import RewardProcessors


@pytest.fixture
def out(tmp_path):
    return str(tmp_path / "out")


def config(out, cls=MAGRPOConfig, **kwargs):
    return cls(output_dir=out, **kwargs)


# ----- defaults -----


def test_plain_config_runs_on_this_machine_without_precision_flags(out):
    cfg = MAGRPOConfig(num_agents=2, output_dir=out)
    assert cfg.num_agents == 2
    assert cfg.fp16 is False
    if not torch.cuda.is_available():
        assert cfg.bf16 is cpu_has_fast_bf16()
    else:
        assert cfg.bf16 is is_torch_bf16_gpu_available()


@pytest.mark.parametrize("fast", [True, False])
def test_on_the_cpu_bf16_follows_the_cpus_bf16_support(out, monkeypatch, fast):
    monkeypatch.setattr(precision, "cpu_has_fast_bf16", lambda: fast)
    cfg = config(out, use_cpu=True)
    assert cfg.bf16 is fast
    assert cfg.mixed_precision == ("bf16" if fast else "no")


def test_cpu_flags_decide_fast_bf16(tmp_path):
    def with_flags(flags):
        cpuinfo = tmp_path / f"cpuinfo-{len(flags)}"
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
        return precision.cpu_has_fast_bf16(str(cpuinfo))

    assert with_flags("avx2 avx512f avx512_bf16") is True
    assert with_flags("avx2 amx_tile amx_bf16 x") is True
    assert with_flags("avx2 avx512f avx512_vnni avx512_fp16") is False  # bf16 would be emulated: slower than fp32
    assert precision.cpu_has_fast_bf16(str(tmp_path / "missing")) is False


def test_cpu_model_is_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\nflags\t\t: avx2\n")
    assert cpu_model(str(cpuinfo)) == "AMD EPYC 7B13"
    (tmp_path / "arm").write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # no model name line (some ARM kernels)
    assert cpu_model(str(tmp_path / "arm")) == "unknown"
    assert cpu_model(str(tmp_path / "missing")) == "unknown"


def test_explicit_bf16_false_is_kept(out):
    cfg = config(out, bf16=False)
    assert cfg.bf16 is False
    assert cfg.bf16_from_default is False


def test_gradient_checkpointing_is_off_on_the_cpu_unless_asked_for(out):
    assert config(out, use_cpu=True).gradient_checkpointing is False
    assert config(out, use_cpu=True, gradient_checkpointing=True).gradient_checkpointing is True
    if "activation_checkpointing" in MAGRPOConfig.__dataclass_fields__:  # transformers >= 5.18's name
        assert config(out, use_cpu=True, activation_checkpointing=True).gradient_checkpointing is True


def test_defaults(out):
    cfg = config(out)
    assert cfg.learning_rate == 5e-6
    assert cfg.agent_learning_rate == 5e-6
    assert cfg.max_completion_length == 256
    assert cfg.max_new_tokens == 256
    assert cfg.num_generations == 4
    assert cfg.per_device_train_batch_size == cfg.num_generations  # one task item per optimiser update
    assert cfg.steps_per_generation == 2  # up to two updates sampled at once, fitted to the training set later
    assert cfg.shuffle_dataset is False
    assert cfg.save_strategy == "no"
    assert (cfg.temperature, cfg.top_p, cfg.top_k) == (0.6, 0.6, 50)  # CoMLRL's sampling, not TRL's (1.0, 1.0, 0)
    assert cfg.logprob_temperature is None  # TRL's log-probabilities, at the sampling temperature (CoMLRL's: 1.0)
    assert cfg.lr_scheduler_type == "constant"  # CoMLRL's plain AdamW, not TRL's linear decay to 0
    assert cfg.num_agents == 2
    assert cfg.num_turns == 1
    assert cfg.joint_mode == "align"
    assert cfg.advantage_mode == "mean"
    assert cfg.advantage_normalization is True
    assert cfg.scale_rewards == "group"
    assert cfg.logging_nan_inf_filter is False
    assert cfg.eval_interval == 16
    assert cfg.eval_num_samples == 4
    assert cfg.eval_batch_size == 1


def test_per_device_batch_follows_num_generations(out):
    cfg = config(out, num_generations=6)
    assert cfg.per_device_train_batch_size == 6  # one item of 6 completions
    assert config(out, num_generations=2, per_device_train_batch_size=8).per_device_train_batch_size == 8


@pytest.mark.parametrize("top_k", [None, 0])
def test_top_k_disabled(out, top_k):
    assert config(out, top_k=top_k).top_k == 0


def test_top_k_value_kept(out):
    assert config(out, top_k=7).top_k == 7


# ----- spec / TRL aliases -----


@pytest.mark.parametrize(
    "spec, trl, value",
    [("agent_learning_rate", "learning_rate", 3e-4), ("max_new_tokens", "max_completion_length", 17)],
)
def test_alias_set_through_either_name(out, spec, trl, value):
    via_spec = config(out, **{spec: value})
    assert getattr(via_spec, spec) == value and getattr(via_spec, trl) == value
    via_trl = config(out, **{trl: value})
    assert getattr(via_trl, spec) == value and getattr(via_trl, trl) == value


@pytest.mark.parametrize(
    "spec, trl, a, b",
    [("agent_learning_rate", "learning_rate", 1e-4, 2e-4), ("max_new_tokens", "max_completion_length", 8, 16)],
)
def test_alias_conflict_names_both_fields(out, spec, trl, a, b):
    with pytest.raises(ValueError) as info:
        config(out, **{spec: a, trl: b})
    assert spec in str(info.value) and trl in str(info.value)


def test_alias_same_value_twice_is_fine(out):
    cfg = config(out, agent_learning_rate=1e-4, learning_rate=1e-4, max_new_tokens=9, max_completion_length=9)
    assert cfg.learning_rate == 1e-4 and cfg.max_completion_length == 9


# ----- advantage normalisation / scale_rewards -----


def test_advantage_normalization_false_disables_scaling(out):
    cfg = config(out, advantage_normalization=False)
    assert cfg.advantage_normalization is False
    assert cfg.scale_rewards == "none"


def test_advantage_normalization_true_keeps_group_scaling(out):
    cfg = config(out, advantage_normalization=True)
    assert cfg.advantage_normalization is True
    assert cfg.scale_rewards == "group"


@pytest.mark.parametrize("scale, expected", [(False, False), ("none", False), (True, True), ("batch", True)])
def test_scale_rewards_drives_advantage_normalization(out, scale, expected):
    cfg = config(out, scale_rewards=scale)
    assert cfg.advantage_normalization is expected
    assert cfg.scale_rewards == {False: "none", True: "group"}.get(scale, scale)


@pytest.mark.parametrize("scale, norm", [("none", True), (False, True), ("batch", False)])
def test_conflicting_normalization_raises(out, scale, norm):
    with pytest.raises(ValueError, match="advantage_normalization") as info:
        config(out, advantage_normalization=norm, scale_rewards=scale)
    assert "scale_rewards" in str(info.value)


def test_unknown_scale_rewards_raises(out):
    with pytest.raises(ValueError, match="scale_rewards"):
        config(out, scale_rewards="per-token")


# ----- validation -----


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate"])
def test_an_unbounded_truncate_mode_is_refused_while_the_correction_may_be_on(out, mode):
    unbounded = dict(vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=None)
    with pytest.raises(ValueError, match=rf"clip_max must be set when vllm_importance_sampling_mode is '{mode}'"):
        config(out, **unbounded)  # unset: it resolves to on for an agent that samples untruncated
    assert config(out, vllm_importance_sampling_correction=False, **unbounded).vllm_importance_sampling_mode == mode
    assert config(out, vllm_importance_sampling_mode=mode).vllm_importance_sampling_clip_max == 3.0  # TRL's bound


@pytest.mark.parametrize("k", [1, 0, None])
def test_num_generations_below_two_raises(out, k):
    with pytest.raises(ValueError, match="num_generations"):
        config(out, num_generations=k)


@pytest.mark.parametrize("name", ["joint_mode", "advantage_mode"])
def test_unknown_choice_names_the_field(out, name):
    with pytest.raises(ValueError, match=name):
        config(out, **{name: "bogus"})


@pytest.mark.parametrize("joint_mode", ["align", "cross"])
@pytest.mark.parametrize("advantage_mode", ["mean", "raw", "max", "rloo"])
def test_all_documented_choices_accepted(out, joint_mode, advantage_mode):
    cfg = config(out, joint_mode=joint_mode, advantage_mode=advantage_mode)
    assert (cfg.joint_mode, cfg.advantage_mode) == (joint_mode, advantage_mode)


@pytest.mark.parametrize(
    "name, value",
    [
        ("num_agents", 0),
        ("num_agents", -1),
        ("num_agents", 1.5),
        ("num_turns", 0),
        ("eval_num_samples", 0),
        ("eval_interval", -1),
        ("eval_batch_size", 0),
        ("logging_steps", 0),
    ],
)
def test_invalid_integer_fields_raise(out, name, value):
    with pytest.raises(ValueError, match=name):
        config(out, **{name: value})


def test_eval_interval_zero_means_manual(out):
    assert config(out, eval_interval=0).eval_interval == 0


def test_single_agent_team_is_allowed(out):
    assert config(out, num_agents=1).num_agents == 1


def test_eval_strategy_steps_points_to_eval_interval(out):
    with pytest.raises(ValueError, match="eval_interval"):
        config(out, eval_strategy="steps", eval_steps=1)


def test_eval_strategy_no_is_fine(out):
    assert config(out, eval_strategy="no").eval_strategy == "no"


# ----- variants -----


@pytest.mark.parametrize(
    "cls, mode", [(MAGRPOConfig, "mean"), (MAREINFORCEConfig, "raw"), (MARLOOConfig, "rloo"), (MAReMaxConfig, "max")]
)
def test_variant_presets_and_override(out, cls, mode):
    assert config(out, cls).advantage_mode == mode
    other = "max" if mode != "max" else "mean"
    assert config(out, cls, advantage_mode=other).advantage_mode == other
    assert issubclass(cls, MAGRPOConfig)


def test_variant_still_validates(out):
    with pytest.raises(ValueError, match="advantage_mode"):
        config(out, MARLOOConfig, advantage_mode="median")


# ----- command-line parsing -----


def test_hf_argument_parser_round_trip(out):
    (cfg,) = HfArgumentParser(MAGRPOConfig).parse_args_into_dataclasses(
        [
            "--output_dir",
            out,
            "--num_agents",
            "3",
            "--joint_mode",
            "cross",
            "--agent_learning_rate",
            "1e-4",
            "--top_k",
            "5",
        ]
    )
    assert isinstance(cfg, MAGRPOConfig)
    assert cfg.num_agents == 3
    assert cfg.joint_mode == "cross"
    assert cfg.agent_learning_rate == 1e-4 and cfg.learning_rate == 1e-4
    assert cfg.top_k == 5
    assert cfg.max_completion_length == 256 and cfg.per_device_train_batch_size == 4
    assert cfg.save_strategy == "no"


def test_trl_parser_spec_fields(out):
    (cfg,) = TrlParser(MAGRPOConfig).parse_args_and_config(
        [
            "--output_dir",
            out,
            "--max_new_tokens",
            "12",
            "--advantage_normalization",
            "false",
            "--advantage_mode",
            "rloo",
            "--eval_interval",
            "0",
        ]
    )
    assert cfg.max_new_tokens == 12 and cfg.max_completion_length == 12
    assert cfg.advantage_normalization is False and cfg.scale_rewards == "none"
    assert cfg.advantage_mode == "rloo"
    assert cfg.eval_interval == 0


def test_parser_variant_default_and_conflict(out):
    (cfg,) = HfArgumentParser(MAReMaxConfig).parse_args_into_dataclasses(["--output_dir", out])
    assert cfg.advantage_mode == "max"
    with pytest.raises(ValueError, match="learning_rate"):
        HfArgumentParser(MAGRPOConfig).parse_args_into_dataclasses(
            ["--output_dir", out, "--agent_learning_rate", "1e-4", "--learning_rate", "1e-3"]
        )


# ----- reward processors -----


def test_reward_processors():
    assert RewardProcessors.scale(factor=10.0)(0.5) == 5.0
    assert RewardProcessors.scale(-2)(3.0) == -6.0
    assert RewardProcessors.scale()(1.25) == 1.25
    assert RewardProcessors.shift(value=-1.0)(0.5) == -0.5
    assert RewardProcessors.shift(3)(2.0) == 5.0
    assert RewardProcessors.shift()(1.25) == 1.25
    combined = RewardProcessors.shift(1.0)(RewardProcessors.scale(2.0)(0.25))
    assert combined == 1.5


def test_the_documented_utils_paths_name_the_library_objects():
    """`comlrl_trl.utils` (CoMLRL's `comlrl.utils`) only re-exports: a copy there would drift from what trainers use."""
    import comlrl_trl.utils as utils
    from comlrl_trl.checkpoint import read_checkpoint_metadata
    from comlrl_trl.joint_reward import RewardProcessors as applied

    assert RewardProcessors is applied and utils.RewardProcessors is applied
    assert utils.read_checkpoint_metadata is read_checkpoint_metadata
    assert sorted(utils.__all__) == ["RewardProcessors", "read_checkpoint_metadata"]


@pytest.mark.parametrize(
    "env, nvidia_smi, warns",
    [
        ({"CUDA_VISIBLE_DEVICES": "0"}, None, True),
        ({}, "/usr/bin/nvidia-smi", True),
        ({"CUDA_VISIBLE_DEVICES": ""}, None, False),
        ({}, None, False),
    ],
)
def test_config_warns_when_a_gpu_is_expected_but_torch_sees_none(monkeypatch, tmp_path, env, nvidia_smi, warns):
    """A CPU build of torch on a GPU machine would silently train on the CPU: the config says so."""
    import shutil
    import warnings

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(shutil, "which", lambda name: nvidia_smi if name == "nvidia-smi" else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = MAGRPOConfig(output_dir=str(tmp_path), report_to="none")
    messages = [str(w.message) for w in caught if "sees no GPU" in str(w.message)]
    assert config.use_cpu
    assert len(messages) == (1 if warns else 0)
    if warns:
        assert "CPU-only build" in messages[0] and "make install TORCH=" in messages[0]


@pytest.mark.parametrize(
    "num_items, evaluates, eval_interval, updates_per_generation",
    [
        (10, False, 16, 2),  # the tutorial: five generations of 2 items per epoch
        (16, False, 16, 2),
        (7, False, 16, 1),  # generations of 2 items would leave the seventh out (3 x 2 = 6)
        (3, False, 16, 1),
        (1, False, 16, 1),
        (10, True, 16, 2),  # 2 divides eval_interval=16
        (10, True, 5, 1),  # 2 does not divide eval_interval=5
        (16, False, 5, 2),  # eval_interval counts only with evaluations
    ],
)
def test_default_generation_fits_the_training_set(out, num_items, evaluates, eval_interval, updates_per_generation):
    cfg = config(out, num_generations=3, eval_interval=eval_interval)
    assert cfg.per_device_train_batch_size == 3  # one task item per optimiser update
    cfg.fit_generation_to_dataset(num_items, evaluates=evaluates)
    assert cfg.steps_per_generation == updates_per_generation
    assert cfg.generation_batch_size == 3 * updates_per_generation


def test_default_generation_spans_accumulation_steps(out):
    # Two micro-steps per update: 12 items make 6 updates of 2 items, generated 2 updates (4 micro-steps) at once.
    cfg = config(out, num_generations=3, gradient_accumulation_steps=2)
    cfg.fit_generation_to_dataset(12)
    assert (cfg.steps_per_generation, cfg.generation_batch_size) == (4, 12)
    # 10 items: generations of 4 items would leave 2 out (2 x 4 = 8), so one update (2 micro-steps) at a time.
    cfg = config(out, num_generations=3, gradient_accumulation_steps=2)
    cfg.fit_generation_to_dataset(10)
    assert (cfg.steps_per_generation, cfg.generation_batch_size) == (2, 6)


def test_a_set_generation_is_never_fitted(out):
    cfg = config(out, num_generations=3, steps_per_generation=2)
    cfg.fit_generation_to_dataset(7, evaluates=True)
    assert (cfg.steps_per_generation, cfg.generation_batch_size) == (2, 6)
    cfg = config(out, num_generations=3, generation_batch_size=9)
    cfg.fit_generation_to_dataset(7, evaluates=True)
    assert (cfg.steps_per_generation, cfg.generation_batch_size) == (3, 9)


def test_vllm_lora_mode_is_checked(out):
    assert config(out).vllm_lora_mode == "adapter"
    assert config(out, vllm_lora_mode="merged").vllm_lora_mode == "merged"
    with pytest.raises(ValueError, match="vllm_lora_mode must be 'adapter' or 'merged', got 'shared'"):
        config(out, vllm_lora_mode="shared")


def test_vllm_server_request_timeout_must_be_positive(out):
    assert config(out).vllm_server_request_timeout == 600.0
    with pytest.raises(ValueError, match="vllm_server_request_timeout must be > 0 seconds, got 0"):
        config(out, vllm_server_request_timeout=0)


def test_logprob_temperature_is_a_positive_number_or_none(out):
    assert config(out, logprob_temperature=None).logprob_temperature is None
    assert config(out, logprob_temperature=0.6).logprob_temperature == 0.6
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1.0"):
        with pytest.raises(ValueError, match=rf"logprob_temperature must be a number > 0 .* got {bad!r}"):
            config(out, logprob_temperature=bad)
