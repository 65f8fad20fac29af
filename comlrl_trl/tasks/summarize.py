"""A two-agent summarisation task on short paragraphs shipped with the package (no download).

Both agents read the same paragraph. Agent 0 writes a one-sentence summary (a TL;DR), agent 1 a longer
three-sentence summary, in the spirit of the TLDR writing task of the MAGRPO paper
(https://huggingface.co/papers/2508.04652).
The 16 paragraphs below (60-120 words each, varied topics) were written for this package.

The joint reward of a pair (brief, detailed) for a paragraph P lies in [0, 1]:

    reward = (0.4 * structure + 0.6 * min(1, coverage / 0.4)) * (1 - copied)

- structure: with ratio = words(detailed) / words(brief) (a word is a run of letters or digits), 1.0 when
  1.5 <= ratio <= 4, else exp(-distance to the nearest bound). An item's fields `ratio_min` / `ratio_max`
  override the bounds.
- coverage: the fraction of P's content words (words of 3+ letters not in a small stopword list, lowercased,
  a final "s" dropped) that appear in brief or detailed. Mentioning 40% of them earns full credit: a good
  summary paraphrases, and the summaries are much shorter than the paragraph.
- copied: the fraction of the summaries' word 8-grams that occur verbatim in P (0 when the summaries are
  shorter than 8 words); copying the paragraph scores 0.
- The reward is 0.0 when either summary is empty (or has no words).

The reward is lexical: it does not check grammar, facts or the requested sentence counts, so a list of the
paragraph's keywords in the right proportions would score well. It is a cheap, deterministic training signal,
not a quality metric.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

from datasets import Dataset


__all__ = ["PARAGRAPHS", "build_dataset", "formatters", "reward", "content_words"]

RATIO_MIN = 1.5
RATIO_MAX = 4.0
COVERAGE_TARGET = 0.4
COPY_NGRAM = 8

# (topic, paragraph)
PARAGRAPHS = (
    (
        "honeybees",
        "When a honeybee finds a rich patch of flowers, she returns to the hive and performs a waggle dance on the "
        "vertical comb. The angle of her run relative to straight up tells her sisters the direction of the food "
        "compared with the sun, and the length of the waggle tells them how far away it is. Other foragers follow "
        "the dancer, smell the nectar she carries, and then fly out to search. This simple signal lets a colony "
        "shift its workforce within an hour toward whichever fields are blooming best.",
    ),
    (
        "lighthouses",
        "Before satellite navigation, lighthouses were among the most important safety tools for sailors. Each "
        "tower flashed its own pattern, so a captain who counted the seconds between flashes could tell exactly "
        "which coast he was passing. Keepers lived in the towers for months, trimming wicks, polishing lenses and "
        "winding the clockwork that turned the light. Most lights are automatic today, and many old keepers' "
        "cottages have become small museums or guest houses for visitors who enjoy storms.",
    ),
    (
        "sourdough",
        "A sourdough starter is a mixture of flour and water in which wild yeast and lactic acid bacteria live "
        "together. The bacteria produce acids that give the bread its tangy flavour and keep unwanted microbes "
        "away, while the yeast releases gas that makes the dough rise. Bakers feed a starter with fresh flour every "
        "day or store it in the fridge between bakes. A healthy starter doubles in size a few hours after feeding "
        "and smells pleasantly sour, a little like yogurt.",
    ),
    (
        "tides",
        "Ocean tides come mainly from the pull of the moon. Its gravity is slightly stronger on the side of the "
        "earth that faces it and slightly weaker on the far side, which stretches the oceans into two bulges. As "
        "the earth spins, most coasts pass through both bulges each day and see two high tides. When the sun and "
        "moon line up, their pulls add together and produce especially large spring tides; when they are at right "
        "angles, the smaller neap tides follow.",
    ),
    (
        "rust",
        "Rust forms when iron reacts with oxygen and water to make iron oxide, a flaky reddish material that is "
        "weaker than the metal underneath. Salt speeds up the reaction, which is why cars in snowy regions, where "
        "roads are salted, often rust faster. Unlike the thin oxide layer on aluminium, rust does not protect the "
        "surface; it crumbles and exposes fresh iron. Paint, oil and a coating of zinc, called galvanising, keep "
        "water and air away and slow the damage.",
    ),
    (
        "heat islands",
        "Cities are often several degrees warmer than the countryside around them, an effect known as the urban "
        "heat island. Asphalt, brick and concrete absorb sunlight during the day and release the heat slowly at "
        "night, while engines and air conditioners add warmth of their own. Because there are fewer trees, less "
        "water evaporates to cool the air. Planners fight the effect with street trees, parks, green roofs and "
        "light-coloured pavements that reflect more sunlight back into the sky.",
    ),
    (
        "octopuses",
        "Octopuses are among the most intelligent invertebrates. They can open screw-top jars, find their way "
        "through mazes and recognise individual people who have treated them well or badly. Much of their nervous "
        "system sits in their eight arms, so each arm can taste, touch and react partly on its own. They also "
        "change the colour and texture of their skin in a fraction of a second to hide from predators, even "
        "though most species are thought to be colour-blind.",
    ),
    (
        "compost",
        "Composting turns kitchen scraps and garden waste into dark, crumbly soil food. Bacteria and fungi do most "
        "of the work, breaking down the material while worms and insects mix it. A good heap needs a balance of "
        "green items such as vegetable peels and grass, which supply nitrogen, and brown items such as dry leaves "
        "and cardboard, which supply carbon. Turning the pile lets in air, and keeping it as damp as a wrung-out "
        "sponge helps the microbes thrive.",
    ),
    (
        "sleep",
        "Sleep is not simply rest for the brain. During deep sleep, the brain replays patterns of activity from "
        "the day, which helps move new memories into long-term storage. Students who sleep after learning a list "
        "of words usually remember more of them the next morning than students who stay awake for the same "
        "number of hours. Dreaming sleep seems to help with emotional memories and creative connections, although "
        "scientists still debate exactly how.",
    ),
    (
        "volcanic islands",
        "Some island chains form above hot spots, places where a plume of molten rock rises from deep inside the "
        "earth. As a tectonic plate slides slowly over the hot spot, a volcano grows until it breaks the ocean "
        "surface. The plate keeps moving, carrying the island away from its source of magma, so the volcano goes "
        "quiet and begins to erode while a new one forms behind it. The result is a line of islands that grow "
        "older with distance.",
    ),
    (
        "libraries",
        "Public libraries lend far more than books today. Many branches offer free internet access, quiet study "
        "rooms and classes on everything from job applications to coding. Some even lend tools, musical "
        "instruments, seeds for the garden or passes to local museums. Librarians help visitors find reliable "
        "information and fill in official forms. For people without a computer at home, the library is often the "
        "only place where they can apply for work or government services.",
    ),
    (
        "bicycle gears",
        "Bicycle gears let a rider keep pedalling at a comfortable pace whatever the terrain. A large front ring "
        "combined with a small rear cog moves the bike far with each turn of the pedals, which suits flat roads "
        "and descents. A small front ring with a large rear cog needs less force per stroke, so it makes steep "
        "hills manageable even though the bike moves more slowly. The derailleur shifts the chain between cogs "
        "while the wheels are turning.",
    ),
    (
        "coral reefs",
        "Coral reefs are built by tiny animals called polyps, which live in partnership with algae inside their "
        "tissues. The algae make food from sunlight and share it with the coral, giving reefs their bright "
        "colours. When the water becomes too warm for too long, the coral expels the algae and turns white, a "
        "process called bleaching. Bleached coral is not dead, but it starves if cool conditions do not return "
        "within weeks, and the fish that depend on it leave.",
    ),
    (
        "tea",
        "Green tea and black tea come from the same plant. The difference lies in processing after the leaves are "
        "picked. For green tea, the fresh leaves are heated quickly by steaming or pan-firing, which stops the "
        "enzymes that would darken them and keeps a grassy flavour. For black tea, the leaves are rolled and left "
        "exposed to air, so the enzymes oxidise them into a dark, malty product. Oolong tea is partly oxidised and "
        "sits in between.",
    ),
    (
        "passphrases",
        "A long passphrase made of several random words is usually stronger than a short password full of symbols. "
        "Attackers guess passwords with programs that try common words and predictable substitutions, such as "
        "replacing a letter with a digit. Every extra random word multiplies the number of possible combinations, "
        "while staying easy for a person to remember. Security experts also recommend a different passphrase for "
        "each site and a password manager to store them safely.",
    ),
    (
        "bird migration",
        "Many songbirds migrate thousands of kilometres at night without getting lost. Young birds inherit a rough "
        "direction and distance to fly, then refine their route with experience. They read the position of the "
        "setting sun, the patterns of stars around the celestial pole and the earth's magnetic field, which some "
        "species may sense through special proteins in their eyes. Landmarks such as coastlines and mountain ranges "
        "help them correct their course near the end.",
    ),
)

# Every fourth paragraph is held out for evaluation: 12 training items, 4 evaluation items.
_EVAL_EVERY = 4

_WORD = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(
    "a an the and or but if then than so as of to in on at by for with from into onto over under about after "
    "before between during without within through is are was were be been being am do does did done has have "
    "had having can could will would shall should may might must it its this that these those there here their "
    "they them he she his her him we our us you your i me my not no nor yes also more most less such which who "
    "whom whose what when where while how all any each both few other some very just only own same too up out "
    "off again once even still often usually many much".split()
)


def build_dataset(split: Literal["train", "eval"] = "train") -> Dataset:
    """The task items of `split` ("train": 12 paragraphs, "eval": 4), in a fixed order.

    Columns: `topic` and `prompt` (the paragraph to summarise).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    held_out = split == "eval"
    rows = [row for i, row in enumerate(PARAGRAPHS) if (i % _EVAL_EVERY == _EVAL_EVERY - 1) == held_out]
    return Dataset.from_dict({"topic": [topic for topic, _ in rows], "prompt": [text for _, text in rows]})


def tldr_formatter(item: dict[str, Any]) -> str:
    """Agent 0's prompt: a one-sentence summary."""
    return f"Summarize the following paragraph in one sentence (a TL;DR).\n\n{item['prompt']}"


def detailed_formatter(item: dict[str, Any]) -> str:
    """Agent 1's prompt: a three-sentence summary."""
    return f"Summarize the following paragraph in three sentences.\n\n{item['prompt']}"


def formatters() -> list[Callable[[dict[str, Any]], str]]:
    """The formatters in actor order: [one-sentence TL;DR, three-sentence summary]."""
    return [tldr_formatter, detailed_formatter]


def content_words(text: str) -> set[str]:
    """Lowercased words of 3+ letters that are not stopwords, with a final "s" dropped (a crude plural fold)."""
    return {_fold(w) for w in _WORD.findall(text.lower()) if len(w) >= 3 and w not in _STOPWORDS}


def reward(
    brief_completions: Sequence[str], detailed_completions: Sequence[str], *, batch_items: Sequence[dict[str, Any]]
) -> list[float]:
    """One reward in [0, 1] per joint action (brief_k, detailed_k); the formula is in the module docstring."""
    item = batch_items[0]
    paragraph = item["prompt"]
    ratio_min = float(item.get("ratio_min", RATIO_MIN))
    ratio_max = float(item.get("ratio_max", RATIO_MAX))
    targets = content_words(paragraph)
    source_ngrams = set(_ngrams(_WORD.findall(paragraph.lower())))
    rewards = []
    for brief, detailed in zip(brief_completions, detailed_completions, strict=True):
        brief_words = _WORD.findall(brief.lower())
        detailed_words = _WORD.findall(detailed.lower())
        if not brief_words or not detailed_words:
            rewards.append(0.0)
            continue
        ratio = len(detailed_words) / len(brief_words)
        structure = math.exp(-max(ratio_min - ratio, ratio - ratio_max, 0.0))
        coverage = len(targets & content_words(f"{brief} {detailed}")) / len(targets)
        summary_ngrams = _ngrams(brief_words) + _ngrams(detailed_words)
        copied = sum(g in source_ngrams for g in summary_ngrams) / len(summary_ngrams) if summary_ngrams else 0.0
        rewards.append((0.4 * structure + 0.6 * min(1.0, coverage / COVERAGE_TARGET)) * (1.0 - copied))
    return rewards


def _fold(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _ngrams(words: list[str], n: int = COPY_NGRAM) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
