"""The structure bonus by what ran (issue 55): the call bonus needs the tests' call of the entry point to be the
main agent's own `def` (its code object) and that call to run the teammate's own `aux`. Each bypass below met the
rules on paper (the source defines the entry point, which reachably calls `aux`, and binds no `aux`) and got the
full 0.2 bonus for a program that fails every test; now it gets 0.1, as a program that does not call `aux` does."""

import pytest

from comlrl_trl.tasks import code_feedback, humaneval
from comlrl_trl.tasks.sandbox import run_python


HELPER = "def aux(ch):\n    return ch.lower() in 'aeiou'\n"
MAIN = "def count_vowels(s):\n    return sum(1 for ch in s if aux(ch)) - 100\n"  # calls aux; fails every test
ITEM = next(
    item
    for split in ("train", "eval")
    for item in code_feedback.build_dataset(split)
    if item["entry_point"] == "count_vowels"
)

BYPASSES = {
    "a decorator replaces the entry point": "def replace(function):\n    return lambda s: -1\n@replace\n" + MAIN,
    "the entry point's __code__ is replaced through an alias": MAIN
    + "def wrong(s):\n    return -1\n[count_vowels][0].__code__ = wrong.__code__\n",
    "aux is re-bound through a frame's f_globals": MAIN
    + "import sys\nsys._getframe().f_globals['a' + 'ux'] = lambda ch: False\n",
    "aux is re-bound through the globals dict (__globals__)": MAIN
    + "count_vowels.__globals__['a' + 'ux'] = lambda ch: False\n",
    "aux is re-bound by a star import": MAIN
    + "import sys, types\nmodule = types.ModuleType('helpers')\nmodule.__dict__['a' + 'ux'] = lambda ch: False\n"
    "sys.modules['helpers'] = module\nfrom helpers import *\n",
}


@pytest.mark.parametrize("name", sorted(BYPASSES))
def test_a_bypass_of_the_bonus_rules_gets_no_call_bonus(name):
    assert code_feedback.reward([HELPER], [BYPASSES[name]], batch_items=[ITEM]) == [pytest.approx(0.1)]


def test_code_that_calls_the_teammates_aux_keeps_the_bonus():
    honest = "def count_vowels(s):\n    return sum(1 for ch in s if aux(ch))\n"
    decorated_helper = "import functools\n@functools.lru_cache(maxsize=None)\n" + HELPER  # aux's own code still runs
    rewards = code_feedback.reward([HELPER, HELPER, decorated_helper], [honest, MAIN, honest], batch_items=[ITEM])
    assert rewards == [pytest.approx(1.2), pytest.approx(0.2), pytest.approx(1.2)]


HUMANEVAL_ITEM = {
    "task_id": "Custom/1",
    "prompt": 'def add_one(x):\n    """x plus one."""\n',
    "entry_point": "add_one",
    "canonical_solution": "    return x + 1\n",
    "test": "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(2) == 3\n",
}


def test_humaneval_bonus_is_by_what_ran_too():
    helper = "def aux(x):\n    return x + 1\n"
    honest = "def add_one(x):\n    return aux(x)\n"
    replaced = "def replace(function):\n    return lambda x: x + 1\n@replace\ndef add_one(x):\n    return aux(x)\n"
    rewards = humaneval.reward([helper, helper], [honest, replaced], batch_items=[HUMANEVAL_ITEM])
    assert rewards == [pytest.approx(1.2), pytest.approx(1.1)]  # both pass; only the first ran its own def


# ----- the evidence itself (`run_python(..., watch=...)`) -----

PROGRAM = "def aux(x):\n    return x + 1\ndef f(x):\n    return aux(x)\n"
WATCHED = {
    "the own f runs the own aux": (PROGRAM, ["assert f(1) == 2"], True),
    "f is not called by the tests": (PROGRAM, ["assert aux(1) == 2"], False),
    "f calls aux only on some inputs (one is enough)": (
        "def aux(x):\n    return x\ndef f(x):\n    return 0 if x else aux(x)\n",
        ["assert f(1) == 0", "assert f(0) == 0"],
        True,
    ),
    "a module-level sys.settrace cannot stop the tracer (taken before the code loads)": (
        "import sys\nsys.settrace = lambda function: None\n" + PROGRAM,
        ["assert f(1) == 2"],
        True,
    ),
    "f removes the tracer before calling aux": (
        "import sys\ndef aux(x):\n    return x + 1\ndef f(x):\n    sys.settrace(None)\n    return aux(x)\n",
        ["assert f(1) == 2"],
        False,
    ),
    "f runs aux in another thread": (
        "import threading\ndef aux(x, out):\n    out.append(x + 1)\ndef f(x):\n    out = []\n"
        "    thread = threading.Thread(target=aux, args=(x, out))\n    thread.start()\n    thread.join()\n"
        "    return out[0]\n",
        ["assert f(1) == 2"],
        False,
    ),
    "a copy of f with other globals": (
        PROGRAM + "import types\nf = types.FunctionType(f.__code__, {'aux': lambda x: x + 1})\n",
        ["assert f(1) == 2"],
        False,
    ),
    "f reaches aux only through another function (not traced: f does not name aux)": (
        "def aux(x):\n    return x + 1\ndef g(x):\n    return aux(x)\ndef f(x):\n    return g(x)\n",
        ["assert f(1) == 2"],
        False,
    ),
    "aux is a lambda, not a def": (
        "aux = lambda x: x + 1\ndef f(x):\n    return aux(x)\n",
        ["assert f(1) == 2"],
        False,
    ),
    "the program does not load": ("def f(x):\n    return aux(x\n", ["assert f(1) == 2"], False),
}


@pytest.mark.parametrize("case", sorted(WATCHED))
def test_the_evidence_is_positive_and_only_for_the_own_code(case):
    code, tests, expected = WATCHED[case]
    assert run_python(code, tests, timeout=2.0, watch=("f", "aux")).watched is expected


def test_no_evidence_without_watch():
    assert run_python(PROGRAM, ["assert f(1) == 2"], timeout=2.0).watched is None
    with pytest.raises(TypeError, match="watch"):
        run_python(PROGRAM, [], watch="f")
