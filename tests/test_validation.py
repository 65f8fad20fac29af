"""Input validation: trainer construction errors, runtime reward/formatter errors, the formatter and joint reward
contracts."""

import importlib.util
import math

import numpy as np
import pytest
import torch
from datasets import Dataset, IterableDataset
from helpers import length_ratio_reward
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from comlrl_trl.formatters import build_formatters, default_formatter, format_prompt
from comlrl_trl.joint_reward import JointReward, accepts_keyword
from comlrl_trl.trainers.reinforce import MAGRPOTrainer
from comlrl_trl.utils.reward_processor import RewardProcessors


@pytest.fixture(scope="module")
def qwen_model(qwen_path):
    return AutoModelForCausalLM.from_pretrained(qwen_path)


@pytest.fixture
def build(qwen_path, prompts_dataset, make_config):
    """Construct an MAGRPOTrainer with valid defaults; keyword arguments replace them."""

    def make(**kwargs):
        settings = dict(agent_model=qwen_path, reward_func=length_ratio_reward, train_dataset=prompts_dataset)
        settings.update(kwargs)
        if "args" not in settings:
            settings["args"] = make_config(max_steps=1)
        return MAGRPOTrainer(**settings)

    return make


# ----- construction: agents -----


def test_neither_agent_model_nor_agents(build):
    with pytest.raises(ValueError, match="agent_model.*agents"):
        build(agent_model=None)


def test_agent_model_and_agents_with_different_names(build, llama_path):
    with pytest.raises(ValueError, match="agent_model and agents conflict"):
        build(agents=[llama_path, llama_path])


def test_agent_model_and_matching_agents_is_accepted(build, qwen_path):
    trainer = build(agents=[qwen_path, qwen_path])
    assert len(trainer.agents) == 2


def test_agents_length_differs_from_num_agents(build, qwen_path):
    with pytest.raises(ValueError, match="num_agents=3"):
        build(agent_model=None, agents=[qwen_path, qwen_path], num_agents=3)


def test_agents_length_differs_from_args_num_agents(build, qwen_path):
    with pytest.raises(ValueError, match="num_agents") as info:
        build(agent_model=None, agents=[qwen_path] * 3)  # default make_config has num_agents=2
    assert "3" in str(info.value) and "2" in str(info.value)


def test_num_agents_argument_differs_from_args(build):
    with pytest.raises(ValueError, match="num_agents"):
        build(num_agents=3)


@pytest.mark.parametrize("agents", [[], "a/path"])
def test_agents_must_be_a_non_empty_list(build, agents):
    with pytest.raises(TypeError, match="agents must be a non-empty list"):
        build(agent_model=None, agents=agents)


def test_agents_entries_not_none(build, qwen_path):
    with pytest.raises(ValueError, match="must not be None"):
        build(agent_model=None, agents=[qwen_path, None])


def test_model_object_as_shared_agent_model_is_rejected(build, qwen_model):
    with pytest.raises(ValueError, match="agents=\\[model_0, model_1"):
        build(agent_model=qwen_model)


def test_model_objects_without_tokenizer(build, qwen_path):
    models = [AutoModelForCausalLM.from_pretrained(qwen_path) for _ in range(2)]
    with pytest.raises(ValueError, match="[Tt]okenizer"):
        build(agent_model=None, agents=models)


def test_tokenizer_list_of_wrong_length(build, qwen_path):
    tokenizer = AutoTokenizer.from_pretrained(qwen_path)
    with pytest.raises(ValueError, match="1 tokenizers for 2 agents"):
        build(tokenizer=[tokenizer])


def test_args_must_be_a_magrpo_config(build, qwen_path, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(TypeError, match="MAGRPOConfig"):
        build(agent_model=None, agents=[qwen_path, qwen_path], args=args)


def test_args_must_be_a_magrpo_config_with_agent_model(build, tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(TypeError, match="MAGRPOConfig"):
        build(args=args)


# ----- construction: formatters, reward, datasets, options -----


def test_formatter_list_of_wrong_length(build):
    with pytest.raises(ValueError, match="3 formatters for 2 agents"):
        build(formatters=[default_formatter] * 3)


def test_non_callable_formatter(build):
    with pytest.raises(TypeError, match=r"formatters\[1\]"):
        build(formatters=[default_formatter, "{prompt}"])


def test_reward_func_none(build):
    with pytest.raises(ValueError, match="reward_func is required"):
        build(reward_func=None)


def test_reward_func_not_callable(build):
    with pytest.raises(TypeError, match="reward_func must be a callable"):
        build(reward_func=[1.0, 2.0])


def test_reward_processor_not_callable(build):
    with pytest.raises(TypeError, match="reward_processor"):
        build(reward_processor=2.0)


def test_multi_turn_without_external_transition(build, make_config):
    with pytest.raises(ValueError, match="external_transition"):
        build(args=make_config(num_turns=2))


def test_external_transition_must_be_callable(build, make_config):
    with pytest.raises(TypeError, match="external_transition must be a callable"):
        build(args=make_config(num_turns=2), external_transition="not a function")


@pytest.mark.parametrize("which", ["eval_logger", "eval_aggregator"])
def test_eval_logger_and_aggregator_go_together(build, which):
    with pytest.raises(ValueError, match="eval_logger and eval_aggregator"):
        build(**{which: lambda *a, **k: {}})


def test_iterable_dataset_needs_max_steps(build, make_config, prompts_dataset):
    with pytest.raises(ValueError, match="max_steps"):
        build(train_dataset=prompts_dataset.to_iterable_dataset(), args=make_config())
    assert isinstance(prompts_dataset.to_iterable_dataset(), IterableDataset)


def test_batch_not_holding_whole_groups_rejected_by_config(make_config):
    with pytest.raises(ValueError, match="num_generations"):
        make_config(per_device_train_batch_size=3, num_generations=4)


def test_batch_not_holding_whole_groups_rejected_by_trainer(build, make_config):
    # On one process the config already rejects it; on several processes only the local batch can be partial.
    # Simulate that by changing the batch size after the config's own checks.
    args = make_config(num_generations=4)
    args.per_device_train_batch_size = 3
    with pytest.raises(ValueError, match="multiple of num_generations"):
        build(args=args)


def test_unknown_wandb_config_key(build):
    with pytest.raises(ValueError, match="projekt"):
        build(wandb_config={"projekt": "x"})


def test_checkpoint_dir_and_save_strategy_are_exclusive(build, make_config, tmp_path):
    trainer = build(args=make_config(save_strategy="steps", save_steps=1))
    with pytest.raises(ValueError, match="either checkpoint_dir .* or TRL's save_strategy"):
        trainer.train(checkpoint_dir=tmp_path / "ckpt")


def test_log_completions_rejected(build, make_config):
    with pytest.raises(ValueError, match="log_completions"):
        build(args=make_config(log_completions=True))


def test_resume_from_a_directory_that_is_not_a_checkpoint(build, tmp_path):
    trainer = build()
    with pytest.raises(FileNotFoundError, match="not a complete comlrl_trl checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path))


# ----- runtime: reward and formatter errors during train() -----


def train_with(build, reward_func=length_ratio_reward, **kwargs):
    trainer = build(reward_func=reward_func, **kwargs)
    trainer.train()
    return trainer


def test_reward_wrong_length(build):
    def reward(first, second):
        return [1.0] * (len(first) - 1)

    with pytest.raises(ValueError, match="expected 4") as info:
        train_with(build, reward)
    assert "task item 0" in str(info.value)


def test_reward_wrong_length_cross_mode(build, make_config):
    def reward(first, second):
        assert len(first) == len(second) == 16  # K^N joint actions
        return [1.0] * 4

    with pytest.raises(ValueError, match="expected 16"):
        train_with(build, reward, args=make_config(max_steps=1, joint_mode="cross"))


def test_reward_nan(build):
    def reward(first, second):
        return [math.nan] + [1.0] * (len(first) - 1)

    with pytest.raises(ValueError, match="finite") as info:
        train_with(build, reward)
    assert "task item 0" in str(info.value)


def test_reward_processor_making_inf(build):
    with pytest.raises(ValueError, match="finite"):
        train_with(build, reward_processor=RewardProcessors.scale(math.inf))


def test_reward_strings(build):
    def reward(first, second):
        return ["1.0"] * len(first)

    with pytest.raises(TypeError, match="real numbers") as info:
        train_with(build, reward)
    assert "task item 0" in str(info.value)


def test_reward_not_a_list(build):
    def reward(first, second):
        return 1.0

    with pytest.raises(TypeError, match="list of numbers") as info:
        train_with(build, reward)
    assert "task item 0" in str(info.value)


class RewardBug(RuntimeError):
    pass


def test_reward_raising_keeps_its_type_and_names_the_item(build):
    def reward(first, second, *, batch_items):
        raise RewardBug("broken reward")

    with pytest.raises(RewardBug, match="broken reward") as info:
        train_with(build, reward)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "task item 0" in notes
    assert "Write a story about item 0" in notes


def test_formatter_returning_int(build):
    with pytest.raises(TypeError, match="formatter of agent 0 returned int"):
        train_with(build, formatters=lambda item: 42)


def test_default_formatter_without_prompt_column(build, make_config):
    dataset = Dataset.from_dict({"question": [f"q{i}" for i in range(8)]})
    with pytest.raises(KeyError, match="question"):
        train_with(build, train_dataset=dataset)


# ----- formatter contract (unit) -----


def test_default_formatter_reads_prompt():
    assert default_formatter({"prompt": "hi", "x": 1}) == "hi"


def test_default_formatter_missing_prompt_names_fields():
    with pytest.raises(KeyError) as info:
        default_formatter({"question": "q", "answer": "a"})
    message = str(info.value)
    assert "'prompt'" in message and "answer" in message and "question" in message


def test_build_formatters_none_is_default_for_all():
    assert build_formatters(None, 3) == [default_formatter] * 3


def test_one_callable_used_for_all_agents():
    def fmt(item):
        return f"Q: {item['q']}"

    formatters = build_formatters(fmt, 3)
    assert formatters == [fmt, fmt, fmt]
    assert [format_prompt(f, {"q": "x"}, i) for i, f in enumerate(formatters)] == ["Q: x"] * 3


def test_formatter_list_gives_per_agent_prompts():
    formatters = build_formatters((lambda item: f"A {item['q']}", lambda item: f"B {item['q']}"), 2)
    assert isinstance(formatters, list)
    assert [format_prompt(f, {"q": "x"}, i) for i, f in enumerate(formatters)] == ["A x", "B x"]


def test_build_formatters_errors():
    with pytest.raises(ValueError, match="1 formatters for 2 agents"):
        build_formatters([default_formatter], 2)
    with pytest.raises(TypeError, match=r"formatters\[0\]"):
        build_formatters([None, default_formatter], 2)
    with pytest.raises(TypeError, match="formatters must be"):
        build_formatters("{prompt}", 2)


def test_format_prompt_accepts_strings_and_chat_messages():
    chat = [{"role": "user", "content": "hi"}]
    assert format_prompt(lambda item: chat, {}, 0) == chat
    with pytest.raises(ValueError, match="agent 0 on task item 5 gave an empty prompt"):
        format_prompt(lambda item: "", {}, 0, label="task item 5")


@pytest.mark.parametrize("bad", [42, None, ["hi"], [{"role": "user", "content": "hi"}, "x"], ("hi",)])
def test_format_prompt_rejects_other_types(bad):
    with pytest.raises(TypeError, match="formatter of agent 1 returned"):
        format_prompt(lambda item: bad, {}, 1)


# ----- joint reward contract (unit) -----

ITEM = {"prompt": "p", "target": 3}
COMPLETIONS = [["a", "bb"], ["ccc", "dddd"]]


def test_batch_items_passed_only_when_accepted():
    seen = {}

    def without(first, second):
        seen["without"] = (first, second)
        return [0.0, 0.0]

    def with_kw(first, second, *, batch_items):
        seen["with"] = batch_items
        return [0.0, 0.0]

    def with_var_kw(*completions, **kwargs):
        seen["var"] = kwargs
        return [0.0, 0.0]

    JointReward(without)(COMPLETIONS, ITEM, "item")
    JointReward(with_kw)(COMPLETIONS, ITEM, "item")
    JointReward(with_var_kw)(COMPLETIONS, ITEM, "item")
    assert seen["without"] == (["a", "bb"], ["ccc", "dddd"])
    assert seen["with"] == [ITEM]
    assert seen["var"] == {"batch_items": [ITEM]}


def test_accepts_keyword():
    assert accepts_keyword(lambda a, batch_items=None: 0, "batch_items")
    assert accepts_keyword(lambda *a, **kw: 0, "batch_items")
    assert not accepts_keyword(lambda a, b: 0, "batch_items")
    assert not accepts_keyword(max, "batch_items")


def test_callable_object_reward():
    class Reward:
        def __call__(self, first, second, batch_items=None):
            return [float(batch_items[0]["target"])] * len(first)

    assert JointReward(Reward())(COMPLETIONS, ITEM, "item") == [3.0, 3.0]


def test_processor_applied_to_every_value():
    joint = JointReward(lambda a, b: [1.0, 2.0], RewardProcessors.scale(10.0))
    assert joint(COMPLETIONS, ITEM, "item") == [10.0, 20.0]
    joint = JointReward(lambda a, b: [1.0, 2.0], RewardProcessors.shift(-1.0))
    assert joint(COMPLETIONS, ITEM, "item") == [0.0, 1.0]


@pytest.mark.parametrize(
    "raw",
    [
        [1, 2.5],
        (1, 2.5),
        torch.tensor([1.0, 2.5]),
        np.array([1.0, 2.5]),
        np.array([1, 2.5], dtype=np.float32),
        [torch.tensor(1.0), torch.tensor(2.5)],
        [np.float32(1.0), np.int64(2) + 0.5],
    ],
    ids=["list", "tuple", "tensor", "ndarray", "ndarray32", "tensor-list", "numpy-scalars"],
)
def test_accepted_return_types(raw):
    result = JointReward(lambda a, b: raw)(COMPLETIONS, ITEM, "item")
    assert result == [1.0, 2.5]
    assert all(type(v) is float for v in result)


@pytest.mark.parametrize(
    "raw", [[True, 1.0], [1.0, np.bool_(False)], torch.tensor([True, False])], ids=["bool", "np-bool", "tensor-bool"]
)
def test_bool_rewards_rejected(raw):
    with pytest.raises(TypeError, match="real numbers"):
        JointReward(lambda a, b: raw)(COMPLETIONS, ITEM, "item 7")


@pytest.mark.parametrize("raw", [1.0, "1.0", {"a": 1.0}, None, (x for x in [1.0, 2.0])])
def test_non_sequence_rejected(raw):
    with pytest.raises(TypeError, match="list of numbers.*item 7"):
        JointReward(lambda a, b: raw)(COMPLETIONS, ITEM, "item 7")


@pytest.mark.parametrize("raw", [[1.0], [1.0, 2.0, 3.0], []])
def test_count_must_match_joint_actions(raw):
    with pytest.raises(ValueError, match=f"returned {len(raw)} values for item 7, expected 2"):
        JointReward(lambda a, b: raw)(COMPLETIONS, ITEM, "item 7")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rejected(bad):
    with pytest.raises(ValueError, match="joint action 1 of item 7.*finite"):
        JointReward(lambda a, b: [0.0, bad])(COMPLETIONS, ITEM, "item 7")


def test_complex_and_nested_rejected():
    with pytest.raises(TypeError, match="real numbers"):
        JointReward(lambda a, b: [1j, 0.0])(COMPLETIONS, ITEM, "item 7")
    with pytest.raises(TypeError, match="real numbers"):
        JointReward(lambda a, b: np.ones((2, 1)))(COMPLETIONS, ITEM, "item 7")


def test_exception_gets_a_note_with_the_item():
    def reward(first, second):
        raise KeyError("missing")

    with pytest.raises(KeyError) as info:
        JointReward(reward)(COMPLETIONS, ITEM, "item 7")
    notes = " ".join(info.value.__notes__)
    assert "item 7" in notes and "'target': 3" in notes


def test_long_items_are_shortened_in_messages():
    item = {"prompt": "x" * 1000}
    with pytest.raises(ValueError) as info:
        JointReward(lambda a, b: [0.0])(COMPLETIONS, item, "item 7")
    assert "x" * 300 not in str(info.value) and "..." in str(info.value)


def test_constructor_type_checks():
    with pytest.raises(TypeError, match="reward_func"):
        JointReward("not callable")
    with pytest.raises(TypeError, match="reward_processor"):
        JointReward(lambda a, b: [0.0], reward_processor=3)


@pytest.mark.parametrize("items, shuffle, left_out", [(12, False, 4), (12, True, 4), (16, False, 0), (9, False, 1)])
def test_a_training_set_that_leaves_items_out_of_every_epoch_warns(caplog, items, shuffle, left_out):
    """TRL's sampler yields whole generation batches (here 8 items: 8 processes with one item each): 12 items make
    one batch per epoch and the remaining 4 are never trained on without shuffling."""
    from trl.trainer.utils import RepeatSampler

    from comlrl_trl.adapters.sampler import fill_small_training_set

    sampler = RepeatSampler(list(range(items)), mini_repeat_count=4, batch_size=8, shuffle=shuffle, seed=0)
    with caplog.at_level("WARNING", logger="comlrl_trl.adapters.sampler"):
        assert fill_small_training_set(sampler) is sampler
    warnings = [r.getMessage() for r in caplog.records if "left out of every epoch" in r.getMessage()]
    assert len(warnings) == (1 if left_out else 0)
    if left_out:
        assert f"{items} task items and a generation batch takes 8, so {left_out} items" in warnings[0]
        assert ("shuffle_dataset=True varies them" in warnings[0]) == (not shuffle)
        batches = len(list(sampler)) // 4 // 8
        assert batches * 8 == items - left_out  # what the sampler really yields per epoch


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_use_vllm_without_vllm_names_the_install(build, make_config):
    with pytest.raises(ImportError, match="make install-vllm"):
        build(args=make_config(use_vllm=True))


def test_vllm_server_mode_needs_no_local_vllm_and_names_an_unreachable_server(build, make_config):
    """Server mode talks HTTP only: without a server it fails at construction, naming the address and the fix."""
    from peft import LoraConfig

    config = make_config(
        max_steps=1,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url="http://127.0.0.1:9",
        vllm_server_timeout=1,
    )
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    with pytest.raises(ConnectionError, match=r"No vLLM server answers at http://127.0.0.1:9 after 1 s.*docs/vllm.md"):
        build(args=config, peft_config=lora)
    with pytest.raises(ValueError, match="LoRA agents only"):
        build(args=config)  # full fine-tuning: refused before any connection
