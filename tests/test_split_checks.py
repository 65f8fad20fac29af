"""Split checks against a generated family of mutation channels (issue 55).

A HumanEval-format `check(candidate)` is split into tests; a test that calls the candidate and does not assert
passes for any answer, so a check whose value the call could have changed must stay in the call's test. Every
variant here passes the candidate's result into an object through some channel (a method, a built-in, a helper
the test defines, an operator of a class it defines, a generator, a closure, ...), reaches that object through
some alias (a second name, a list element, an attribute, an accessor function, ...), and checks the object at
some distance from the call. Most variants are checked without the sandbox: the tests `split_check` returns are
run here, in order, in one namespace, as the sandbox runs them, with plain Python candidates; a few run through
`run_tests` and the sandbox.
"""

import ast
import itertools
import textwrap

import pytest

from comlrl_trl.tasks import humaneval as task


SQUARE_PROMPT = 'def square(x: int) -> int:\n    """The square of x."""\n'
HONEST = "def square(x):\n    return x * x"
WRONG = "def square(x):\n    return 2 * x"  # right for 0 and 2, wrong for 3


def honest_square(x):
    return x * x


def wrong_square(x):
    return 2 * x


# Each channel: test-module code, check-body code, the handle (the object the call is made through), the call
# ({t}: the handle as reached through an alias, {v}: the candidate's value) and the check of the changed object.
CHANNELS = {
    "method": ("", "out = []", "out", "{t}.append({v})", "assert out == [9]"),
    "method_reference": ("", "out = []\npush = out.append", "push", "{t}({v})", "assert out == [9]"),
    "augmented_assignment": ("", "out = []", "out", "{t} += [{v}]", "assert out == [9]"),
    "attribute_assignment": (
        "",
        "import types\nout = types.SimpleNamespace()",
        "out",
        "{t}.v = {v}",
        "assert out.v == 9",
    ),
    "print_file": (
        "",
        "import io\nout = io.StringIO()",
        "out",
        "print({v}, file={t})",
        "assert out.getvalue() == '9\\n'",
    ),
    "json_dump": (
        "",
        "import io, json\nout = io.StringIO()",
        "out",
        "json.dump({v}, {t})",
        "assert out.getvalue() == '9'",
    ),
    "operator_setitem": (
        "",
        "import operator\nout = {}",
        "out",
        "operator.setitem({t}, 'k', {v})",
        "assert out == {'k': 9}",
    ),
    "operator_iadd": ("", "import operator\nout = []", "out", "operator.iadd({t}, [{v}])", "assert out == [9]"),
    "heapq": ("", "import heapq\nout = []", "out", "heapq.heappush({t}, {v})", "assert out == [9]"),
    "unbound_method": ("", "out = []", "out", "list.append({t}, {v})", "assert out == [9]"),
    "setattr": (
        "",
        "import types\nout = types.SimpleNamespace()",
        "out",
        "setattr({t}, 'v', {v})",
        "assert out.v == 9",
    ),
    "sort_key": ("", "out = []", "out", "sorted([{v}], key={t}.append)", "assert out == [9]"),
    "lazy_map": ("", "out = []", "out", "list(map({t}.append, [{v}]))", "assert out == [9]"),
    "dict_update": ("", "out = {}", "out", "{t}.update(k={v})", "assert out == {'k': 9}"),
    "helper_in_check": (
        "",
        "out = []\ndef push(box, value):\n    box.append(value)",
        "out",
        "push({t}, {v})",
        "assert out == [9]",
    ),
    "helper_in_module": (
        "def push(box, value):\n    box.append(value)",
        "out = []",
        "out",
        "push({t}, {v})",
        "assert out == [9]",
    ),
    "module_global": (
        "LOG = []\n\ndef record(value):\n    LOG.append(value)",
        "",
        "record",
        "{t}({v})",
        "assert LOG == [9]",
    ),
    "default_argument": (
        "def remember(value, seen=[]):\n    seen.append(value)\n    return seen",
        "",
        "remember",
        "{t}({v})",
        "assert remember.__defaults__[0] == [9]",
    ),
    "closure": (
        "",
        "out = []\ndef make(box):\n    def push(value):\n        box.append(value)\n    return push\npusher = make(out)",
        "pusher",
        "{t}({v})",
        "assert out == [9]",
    ),
    "generator": (
        "",
        "out = []\ndef sink():\n    while True:\n        out.append((yield))\ngen = sink()\nnext(gen)",
        "gen",
        "{t}.send({v})",
        "assert out == [9]",
    ),
    "defaultdict_read": (
        "",
        "import collections\nout = collections.defaultdict(int)",
        "out",
        "{t}[{v}]",
        "assert list(out) == [9]",
    ),
    "operator_of_a_test_class": (
        "class Log:\n    def __init__(self):\n        self.items = []\n\n"
        "    def __lshift__(self, value):\n        self.items.append(value)\n        return self",
        "out = Log()",
        "out",
        "{t} << {v}",
        "assert out.items == [9]",
    ),
}

# Each alias: check-body code that makes it ({h}: the handle) and the expression the call goes through.
ALIASES = {
    "direct": ("", "{h}"),
    "name": ("alias = {h}", "alias"),
    "chained_names": ("first = {h}\nsecond = first", "second"),
    "list_element": ("box = [{h}]", "box[0]"),
    "dict_value": ("slots = {'h': {h}}", "slots['h']"),
    "attribute": ("import types\nholder = types.SimpleNamespace(h={h})", "holder.h"),
    "accessor": ("def get():\n    return {h}", "get()"),
    "module_attribute": ("import math\nmath.held_by_a_split_check_test = {h}", "math.held_by_a_split_check_test"),
}

# Each position: where the call sits ({call:V}: the call with the value V) relative to the check.
POSITIONS = {
    "inline": "{call:candidate(3)}\n{check}",
    "saved_result": "r = candidate(3)\n{call:r}\n{check}",
    "test_in_between": "{call:candidate(3)}\nassert candidate(2) == 4\n{check}",
    "in_a_loop": "for x in [3]:\n    {call:candidate(x)}\n{check}",
    "in_a_candidate_argument": "candidate(({call:candidate(3)}, 0)[1])\n{check}",  # the call's value is thrown away
}

LEADING_TEST = "assert candidate(0) == 0"  # independent of the channel: it stays a test of its own


def _variant(channel: str, alias: str, position: str) -> dict | None:
    """The HumanEval-format item of one variant, or None where the combination is not valid Python."""
    module, prep, handle, call, check = CHANNELS[channel]
    alias_prep, target = (part.replace("{h}", handle) for part in ALIASES[alias])
    layout = POSITIONS[position]
    value = layout.split("{call:", 1)[1].split("}", 1)[0]
    statement = call.replace("{t}", target).replace("{v}", value)
    body = "\n".join(
        part for part in (LEADING_TEST, prep, alias_prep, layout.replace("{call:" + value + "}", statement)) if part
    ).replace("{check}", check)
    test = (module + "\n\n\n" if module else "") + "def check(candidate):\n" + textwrap.indent(body, "    ") + "\n"
    try:
        ast.parse(test)
    except SyntaxError:  # e.g. `get() += [...]`
        return None
    return {
        "task_id": f"Square/{channel}/{alias}/{position}",
        "prompt": SQUARE_PROMPT,
        "entry_point": "square",
        "test": test,
        "check": check,
        "call": statement,
    }


FAMILY = [
    pytest.param(item, id=item["task_id"].split("/", 1)[1])
    for item in (_variant(*combination) for combination in itertools.product(CHANNELS, ALIASES, POSITIONS))
    if item is not None
]


def _run_here(item: dict, square) -> list[bool]:
    """Whether each test of the split passes for the Python function `square`, run as the sandbox runs them:
    setup once, then the tests in order in one namespace; a test passes when it runs to its end."""
    setup, tests = task.split_check(item["test"], item["prompt"], item["entry_point"])
    namespace = {"square": square}
    exec(setup, namespace)  # noqa: S102 - the test code is ours
    passed = []
    for test in tests:
        try:
            exec(test, namespace)  # noqa: S102
        except Exception:
            passed.append(False)
        else:
            passed.append(True)
    return passed


def test_the_family_is_large_and_covers_every_dimension():
    assert len(FAMILY) >= 800
    ids = [param.id for param in FAMILY]
    for dimension in (CHANNELS, ALIASES, POSITIONS):
        assert all(any(f"{name}/" in f"{i}/" for i in ids) for name in dimension)


@pytest.mark.parametrize("item", FAMILY)
def test_a_check_stays_in_the_test_of_the_call_that_may_change_its_value(item):
    _, tests = task.split_check(item["test"], item["prompt"], item["entry_point"])
    check, call = ast.unparse(ast.parse(item["check"])), ast.unparse(ast.parse(item["call"]))
    holding = [test for test in tests if check in test]
    assert len(holding) == 1 and call in holding[0], tests
    assert _run_here(item, honest_square) == [True] * len(tests)
    wrong = _run_here(item, wrong_square)
    assert not wrong[tests.index(holding[0])]
    if "setattr" not in item["task_id"]:  # setattr reads names dynamically: the whole check is one test
        assert tests[0] == LEADING_TEST and wrong == [True, False], tests  # the independent test stays apart


@pytest.mark.parametrize(
    "variant",
    [
        ("module_global", "direct", "inline"),
        ("print_file", "list_element", "saved_result"),
        ("generator", "name", "test_in_between"),
        ("operator_setitem", "accessor", "in_a_loop"),
        ("defaultdict_read", "attribute", "inline"),
        ("closure", "chained_names", "saved_result"),
    ],
    ids="/".join,
)
def test_channels_through_the_sandbox(variant):
    item = _variant(*variant)
    honest = task.run_tests(item, HONEST)
    assert honest.passed == honest.total == 2, honest.errors
    wrong = task.run_tests(item, WRONG)
    assert wrong.passed == 1 and wrong.test_passed == [True, False], wrong.errors
    helper = "def aux(x):\n    return x"  # the reward: the pass rate plus 0.1 for defining `square`
    assert task.reward([helper], [WRONG], batch_items=[item], hidden_tests=False) == [pytest.approx(0.5 + 0.1)]
    assert task.reward([helper], [WRONG], batch_items=[item]) == [pytest.approx(0.1)]  # the hidden test fails


def test_a_test_that_needs_an_earlier_tests_state_stays_with_it():
    """A helper with state, called in the candidate's arguments: the second test's input depends on the first
    test having run. Apart, the hidden part (run without the shown one) would fail an honest program."""
    item = _variant("method", "direct", "inline")
    item["test"] = (
        "COUNTER = [0]\n\ndef nxt():\n    COUNTER[0] += 1\n    return COUNTER[0]\n\n\n"
        "def check(candidate):\n    assert candidate(nxt()) == 1\n    assert candidate(nxt()) == 4\n"
    )
    assert task.split_check(item["test"], item["prompt"], item["entry_point"])[1] == (
        "assert candidate(nxt()) == 1\nassert candidate(nxt()) == 4",
    )
    helper = "def aux(x):\n    return x"
    assert task.reward([helper], [HONEST], batch_items=[item]) == [pytest.approx(1.1)]


@pytest.mark.parametrize(
    "body",
    [
        "match candidate(3):\n    case value:\n        pass\nassert value == 9",
        "match [candidate(3)]:\n    case [first, *rest]:\n        pass\nassert first == 9",
        "match {'k': candidate(3)}:\n    case {**rest}:\n        pass\nassert rest == {'k': 9}",
        "match candidate(3):\n    case int() as value if value > 0:\n        pass\nassert value == 9",
    ],
)
def test_a_name_a_match_case_captures_is_checked_in_the_test_of_the_match(body):
    """Capture patterns bind names without an assignment: a check of a captured value stays with its match."""
    item = _variant("method", "direct", "inline")
    item["test"] = "def check(candidate):\n" + textwrap.indent(f"{LEADING_TEST}\n{body}", "    ") + "\n"
    _, tests = task.split_check(item["test"], item["prompt"], item["entry_point"])
    assert tests == (LEADING_TEST, ast.unparse(ast.parse(body)))
    assert _run_here(item, honest_square) == [True, True] and _run_here(item, wrong_square) == [True, False]


BUFFER_CHECK = "assert out.getvalue() == '9\\n'"
MODULE_STATE = {
    "stdout": ("import io, sys\nout = io.StringIO()\nsys.stdout = out", "print(candidate(3))", BUFFER_CHECK),
    "logging_handler": (
        "import io, logging\nout = io.StringIO()\nlogger = logging.getLogger('comlrl-split-check-test')\n"
        "logger.propagate = False\nlogger.addHandler(logging.StreamHandler(out))",
        "logging.getLogger('comlrl-split-check-test').error(candidate(3))",
        BUFFER_CHECK,
    ),
    "random_seed": (
        "import random",
        "random.seed(candidate(3))",
        "assert random.random() == random.Random(9).random()",
    ),
    "imported_function": (
        "from random import Random, seed, random as draw",
        "seed(candidate(3))",
        "assert draw() == Random(9).random()",
    ),
}


@pytest.mark.parametrize("channel", MODULE_STATE)
def test_a_value_reached_through_module_state_is_checked_in_the_test_of_the_call(channel, monkeypatch):
    """`print` writes to `sys.stdout`, a logger to its handlers, `random.seed` sets the generator `random.random`
    reads: a call that names no value of the test may still change what a later statement checks."""
    import logging
    import sys

    monkeypatch.setattr(sys, "stdout", sys.stdout)  # restored after the test
    prep, call, check = MODULE_STATE[channel]
    item = _variant("method", "direct", "inline")
    item["test"] = "def check(candidate):\n" + textwrap.indent(f"{prep}\n{LEADING_TEST}\n{call}\n{check}", "    ")
    try:
        _, tests = task.split_check(item["test"], item["prompt"], item["entry_point"])
        assert tests == (LEADING_TEST, f"{call}\n{check}")
        assert _run_here(item, honest_square) == [True, True] and _run_here(item, wrong_square) == [True, False]
    finally:
        logging.getLogger("comlrl-split-check-test").handlers.clear()
