"""Hostile completions (issue 55): nothing a completion contains raises out of a shipped reward function or
transition, or makes the trainer-side analysis of model-written code slow, and what that analysis gave up on is
counted by reason (`coding.malformed_counts`).

The sources are generated: every kind of AST nesting past `MAX_AST_DEPTH` (expressions and statements), huge
literals, NUL bytes, lone surrogates and text past `MAX_COMPLETION_CHARS`. Each reward is called from a deep stack,
as a trainer calls it (TRL, accelerate and the trainer's own frames sit below it): before the bounds, a run of 30
to 1000 unary minus signs or brackets raised `RecursionError` out of the structure bonus there, and `range(10**30)`
an `OverflowError` anywhere.
"""

import math
import subprocess
import sys
import time

import pytest

from comlrl_trl.tasks import code_feedback, coding, humaneval, length_ratio, summarize
from comlrl_trl.tasks.coding import MAX_AST_DEPTH, MAX_COMPLETION_CHARS, extract_code, structure_bonus


HEAD = "def f(x):\n    return aux(x)\n"  # the entry point `f` calls the teammate's helper
TRAINER_STACK = 900  # frames below a reward or transition call, as deep as a trainer's stack may be
ANALYSIS_STACK = 600  # frames below a direct call of the analysis (it needs about 2 frames per level of nesting)

# Expression templates: each wraps `{}` one level deeper.
EXPRESSIONS = {
    "parentheses": "({})",
    "list": "[{}]",
    "tuple": "({},)",
    "set": "{{{}}}",
    "dict": "{{1: {}}}",
    "call": "g({})",
    "keyword argument": "g(k={})",
    "attribute of a call": "g({}).a",
    "subscript": "x[{}]",
    "lambda": "lambda: {}",
    "unary minus": "-{}",
    "not": "not {}",
    "binary operation": "1 + ({})",
    "comparison": "1 < ({})",
    "boolean operation": "x and ({})",
    "conditional expression": "1 if x else ({})",
    "comprehension": "[{} for y in x]",
    "starred": "[*{}]",
    "await": "(await {})",
    "f-string": "f'{{{{{}}}}}'",
}
# Statement templates: (lines before the block, lines after it), the block one level deeper.
STATEMENTS = {
    "if": (["if x:"], []),
    "for": (["for y in x:"], []),
    "while": (["while x:"], []),
    "with": (["with x:"], []),
    "try": (["try:"], ["except E:", " pass"]),
    "def": (["def g():"], []),
    "class": (["class C:"], []),
    "async for": (["async def g():", " async for y in x:"], []),
}
# Chains: `{}` is the chain so far; long chains nest as deep as brackets do, without any bracket.
CHAINS = {
    "binary operations": "{} + x",
    "string concatenation": "{} + 's'",
    "attributes": "{}.a",
    "calls": "{}()",
    "subscripts": "{}[0]",
    "method calls": "{}.a()",
}


def _nested_expression(template: str, depth: int) -> str:
    text = "1"
    for _ in range(depth):
        text = template.format(text)
    return text


def _nested_statement(head: list[str], tail: list[str], depth: int) -> list[str]:
    """`depth` nested blocks, each indented one space (Python allows at most 100 levels of indentation)."""
    lines = ["y = -x"]
    for _ in range(depth):
        lines = head + [" " * len(head) + line for line in lines] + tail
    return lines


def _hostile_sources() -> dict[str, str]:
    sources = {}
    for name, template in EXPRESSIONS.items():
        for depth in (150, 990):  # past MAX_AST_DEPTH; 990 also past the parser's own limits for most kinds
            if name == "parentheses" and depth == 150:
                continue  # parentheses make no AST node: 150 of them are well-formed
            nested = _nested_expression(template, depth)
            sources[f"{name} x{depth} at module level"] = HEAD + "y = " + nested + "\n"
            sources[f"{name} x{depth} in the entry point"] = "def f(x):\n    return aux(" + nested + ")\n"
    for name, (head, tail) in STATEMENTS.items():  # nested as deep as Python's indentation limit allows
        body = "\n".join(" " + line for line in _nested_statement(head, tail, 98 // len(head)))
        sources[f"{name} nested in the entry point"] = "def f(x):\n" + body + "\n return aux(x)\n"
    for name, template in CHAINS.items():
        for length in (150, 900):
            chain = _nested_expression(template, length).replace("1", "x", 1)
            sources[f"{length} {name} at module level"] = HEAD + "y = " + chain + "\n"
            sources[f"{length} {name} in the entry point"] = "def f(x):\n    return aux(" + chain + ")\n"
    elifs = "".join(" elif x:\n  pass\n" for _ in range(900))
    sources["900 elif branches"] = "def f(x):\n if x:\n  pass\n" + elifs + " return aux(x)\n"
    sources["NUL byte"] = HEAD + "y = 1\x00\n"
    sources["lone surrogate in a string"] = "def f(x):\n    return aux('\ud800')\n"
    sources["lone surrogate in a comment"] = HEAD + "# \udcff\n"
    sources["int literal over the digit limit"] = HEAD + "y = " + "9" * 5000 + "\n"
    sources["completion past the size limit"] = HEAD + "y = 1\n" * (MAX_COMPLETION_CHARS // 6)
    return sources


HOSTILE = _hostile_sources()


def _at_depth(frames: int, function, *args):
    """`function(*args)` called with `frames` more frames on the stack."""
    return function(*args) if frames <= 0 else _at_depth(frames - 1, function, *args)


@pytest.fixture
def fast_sandbox(monkeypatch):
    """Short sandbox timeouts (none of these programs loops) and no results cached from other tests."""
    monkeypatch.setattr(code_feedback, "SANDBOX_TIMEOUT", 1.0)
    monkeypatch.setattr(humaneval, "SANDBOX_TIMEOUT", 1.0)
    code_feedback._run_cached.cache_clear()
    humaneval._run_cached.cache_clear()


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_structure_bonus_scores_hostile_code_as_malformed_with_a_reason(name):
    """Each source is malformed for the analysis (nested deeper than `MAX_AST_DEPTH`, longer than
    `MAX_COMPLETION_CHARS`, or it does not parse): no bonus, the reason counted. The entry point calls `aux`, so
    well-formed code of this shape would get the full 0.2."""
    before = sum(coding.malformed_counts().values())
    bonus = _at_depth(ANALYSIS_STACK, lambda: structure_bonus(HOSTILE[name], "f"))
    assert bonus == 0.0
    assert sum(coding.malformed_counts().values()) == before + 1


# Well-formed code on which an analysis step used to raise: scored as usual (worked out by hand).
WELL_FORMED = {
    # `range(...)` too long for `len`: a loop that can run, so the call after it counts
    "range(10**30)": ("def f(x):\n    for i in range(" + "9" * 30 + "):\n        break\n    return aux(x)\n", 0.2),
    "range(-10**30, 10**30)": (
        "def f(x):\n    for i in range(-" + "9" * 30 + ", " + "9" * 30 + "):\n        return aux(x)\n",
        0.2,
    ),
    "range(10**30, 0) is empty": ("def f(x):\n    for i in range(" + "9" * 30 + ", 0):\n        aux(x)\n", 0.1),
    "60 unary minus signs": (HEAD + "y = " + "-" * 60 + "1\n", 0.2),
}


@pytest.mark.parametrize("name", sorted(WELL_FORMED))
def test_well_formed_code_that_used_to_raise_is_scored_as_usual(name):
    code, expected = WELL_FORMED[name]
    assert _at_depth(ANALYSIS_STACK, lambda: structure_bonus(code, "f")) == pytest.approx(expected)


HUMANEVAL_ITEM = {
    "task_id": "Custom/0",
    "prompt": 'def f(x):\n    """x plus one."""\n',
    "entry_point": "f",
    "canonical_solution": "    return x + 1\n",
    "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(2) == 3\n",
}
CODE_FEEDBACK_ITEM = next(item for item in code_feedback.build_dataset("train") if item["entry_point"] == "flatten")


def _transition(task, item, helper, main):
    return task.transition(
        prompt="",
        agent_completions=[helper, main],
        num_agents=2,
        prompt_history_per_agent=[[], []],
        response_history_per_agent=[["a"], ["b"]],
        batch_item=item,
    )


@pytest.mark.parametrize(
    "task, item",
    [(code_feedback, CODE_FEEDBACK_ITEM), (humaneval, HUMANEVAL_ITEM)],
    ids=["code_feedback", "humaneval"],
)
def test_coding_rewards_and_transitions_return_numbers_and_prompts(task, item, fast_sandbox):
    """Every hostile source as both agents' completion, from a trainer-deep stack: one finite reward each (no
    test passes and no `aux` is defined, so at most the entry-point bonus, for code that is well-formed once
    `extract_code` dropped a trailing line that does not parse), with the reasons counted, and two revision prompts
    per joint action."""
    sources = list(HOSTILE.values())
    item = dict(item, entry_point="f") if task is code_feedback else item
    before = sum(coding.malformed_counts().values())
    rewards = _at_depth(TRAINER_STACK, lambda: task.reward(sources, sources, batch_items=[item]))
    assert sum(coding.malformed_counts().values()) > before
    expected = [structure_bonus(extract_code(source), "f", helper_ran=False) for source in sources]
    assert all(isinstance(value, float) and math.isfinite(value) for value in rewards)
    assert rewards == pytest.approx(expected)
    for source in sources:
        prompts = _at_depth(TRAINER_STACK, _transition, task, item, source, source)
        assert len(prompts) == 2 and all(isinstance(prompt, str) for prompt in prompts)
        for prompt in prompts:
            prompt.encode("utf-8")  # no lone surrogate, so a tokenizer takes it


@pytest.mark.parametrize("task", [length_ratio, summarize])
def test_text_rewards_return_numbers_for_hostile_text(task):
    item = task.build_dataset("train")[0]
    texts = [*HOSTILE.values(), "", "\x00" * 1000, "\ud800" * 1000, "x" * 10_000_000]
    rewards = task.reward(texts, list(reversed(texts)), batch_items=[item])
    assert len(rewards) == len(texts)
    assert all(isinstance(value, float) and math.isfinite(value) for value in rewards)


def test_a_ten_megabyte_completion_is_dropped_at_once():
    """A completion past `MAX_COMPLETION_CHARS` counts as one without code, before any regular expression or parse
    runs on it (10 MB of code took seconds to parse and analyse)."""
    completion = HEAD + "y = 1\n" * (10_000_000 // 6)
    before = coding.malformed_counts().get("too long", 0)
    started = time.perf_counter()
    assert extract_code(completion) == ""
    assert structure_bonus(completion, "f") == 0.0
    assert time.perf_counter() - started < 0.5
    assert coding.malformed_counts()["too long"] == before + 2


def test_finding_the_code_in_a_long_completion_is_not_quadratic():
    """A syntax error in the middle of a long completion: the code before it is found in a few parses, not by
    dropping one trailing line per parse (thousands of parses of thousands of lines)."""
    lines = "\n".join(f"    y{i} = {i}" for i in range(3000))
    completion = "def f(x):\n" + lines + "\n    return aux(x)\nThis is (prose\n" + lines + "\n"
    started = time.perf_counter()
    code = extract_code(completion)
    assert time.perf_counter() - started < 2.0
    assert code.endswith("    return aux(x)") and "prose" not in code
    assert structure_bonus(code, "f") == pytest.approx(0.2)


def test_the_depth_bound_leaves_real_code_alone():
    """HumanEval-style code is far below `MAX_AST_DEPTH`; a 40-deep expression still gets the bonus."""
    code = HEAD + "y = " + _nested_expression("({} + 1)", 40) + "\n"
    assert coding.parse_bounded(code)[1] is None
    assert structure_bonus(code, "f") == pytest.approx(0.2)
    assert sys.getrecursionlimit() >= 1000 and MAX_AST_DEPTH <= 100


def test_nested_conditions_are_worked_out_once(monkeypatch):
    """Red team: a condition of 60 nested `and`s has its truth asked at every level of the walk; each node is
    worked out once (121 nodes: 60 `and`s and 61 names), not again at every level above it (3,781 calls before),
    so a 100,000-character completion of such conditions cannot make the analysis quadratic (1.2 s before, 0.3 s
    now for the worst such completion found)."""
    calls = []
    truth_of = coding._truth_of
    monkeypatch.setattr(coding, "_truth_of", lambda node, known: calls.append(node) or truth_of(node, known))
    condition = _nested_expression("x and ({})", 60).replace("1", "x")
    assert structure_bonus(f"def f(x):\n    if {condition}:\n        return aux(x)\n", "f") == pytest.approx(0.2)
    assert len(calls) == len(set(map(id, calls))) <= 121


RACE = r"""
import gc, sys, threading, time
from comlrl_trl.tasks.coding import parses


class Slow:
    def __del__(self):
        time.sleep(0)  # a finalizer the GC runs inside the AST's construction: another thread may take the GIL


def churn():
    a, b = Slow(), Slow()
    a.other, b.other = b, a


gc.set_threshold(1, 1, 1)
source = "x = " + "-" * 80 + "1\ny = " + "[" * 50 + "]" * 50 + "\n"
reasons = []


def work():
    for _ in range(3000):
        churn()
        reasons.append(parses(source))


threads = [threading.Thread(target=work) for _ in range(4)]
[thread.start() for thread in threads]
[thread.join() for thread in threads]
print(sorted(set(map(str, reasons))))
"""


def test_parsing_on_several_threads_at_once_gives_every_thread_its_tree():
    """CPython 3.11 counts the AST constructor's recursion in per-interpreter state: threads parsing at once (the
    rewards score joint actions on worker threads) failed with "SystemError: AST constructor recursion depth
    mismatch", seen once in a full test run and reproduced by this script with plain `ast.parse` (1 of 4 threads).
    Every parse of the code tasks holds one lock."""
    result = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "['True']"
