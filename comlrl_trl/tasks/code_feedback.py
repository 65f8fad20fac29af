"""A multi-turn, two-agent coding task with test feedback: a helper agent and a main agent write one program.

Every problem names a main function (`entry_point`) and a helper it should use. Agent 0 writes the helper
`def aux(...)`; agent 1 writes the main function, which may call `aux`. The joint program (helper code, then
main code) runs the problem's `assert` tests in the sandbox of `comlrl_trl.tasks.sandbox`.

Reward of one joint action (at most 1.2):

* the fraction of the problem's tests the joint program passes (0.0 to 1.0), plus
* 0.1 when the main agent's code defines the entry point, plus
* 0.1 when that function calls `aux` and the main agent did not define `aux` itself (so the call uses the
  teammate's helper).

The structure bonus gives a learning signal before any test passes; it is small, so a correct program always
beats a well-shaped wrong one.

Hidden tests (`hidden_tests=True`, the default of `reward` and `transition`): each problem's tests are split once
into a shown part (tests 0, 2, ...) and a hidden part (tests 1, 3, ...; a single test is hidden), see
`shown_and_hidden`. The feedback between turns reports and quotes only the shown tests, and the reward counts
only the hidden ones, so a revision that hard-codes the expected values it was shown earns nothing for them. The
reward cannot tell turns apart (the trainer calls it with the same item at every turn), so every turn is scored on
the hidden part. `hidden_tests=False` (pass it to both, e.g. with `functools.partial`) scores and reports all
tests, as before; it suits single-turn training, where no feedback is shown.

Reward integrity: the tests are checked by `sandbox.run_python` outside the agents' code, which only returns
plain data, so no object with a rigged `__eq__`, patched builtin, forged report, early exit or `StopIteration`
raises the pass rate. On Linux as root the code runs isolated (namespaces, own uid, read-only tree without the
repository or these tests, no network, cgroup limits, no process outliving the run); elsewhere the sandbox refuses
to run it unless `COMLRL_SANDBOX_ALLOW_UNISOLATED=1` is set (see `sandbox.py`, 'Fallback'). Kernel exploits and CPU
side channels are not covered. The structure bonus is computed from the source text here (only reachable calls of
`aux` count, any top-level binding of `aux` by the main agent cancels the call bonus, and the entry point must be
defined under its exact name) and, for the call bonus, from what ran: the tests' call of the entry point must be
the main agent's own `def` and must run the helper agent's own `aux` (see `docs/sandbox.md`).

Between turns, `transition` runs the shown tests again and gives each agent a revision prompt with the test results
(the first failing tests, with the values obtained, quoted as escaped single lines in a `~~~text` block), its own
previous code and the teammate's code (in fences longer than any run of backticks in them); the
formatters put the problem statement and the agent's role in front of it. Keep the trainer's
`external_prompt_passthrough=False` (the default), so that later prompts still contain the problem.

    from comlrl_trl.tasks import code_feedback as task

    trainer = MAGRPOTrainer(agent_model=..., formatters=task.formatters(), reward_func=task.reward,
                            external_transition=task.transition, train_dataset=task.build_dataset("train"),
                            eval_dataset=task.build_dataset("eval"), eval_logger=task.eval_logger,
                            eval_aggregator=task.eval_aggregator, args=MAGRPOConfig(num_turns=2, ...))
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from datasets import Dataset

from .coding import (
    HELPER_NAME,
    STRUCTURE_BONUS,
    extract_code,
    joint_program,
    joint_rewards,
    malformed_reason,
    revision_prompts,
    with_feedback,
)
from .sandbox import SandboxResult, run_python


SANDBOX_TIMEOUT = 2.0  # seconds per joint program
T = TypeVar("T")
MAX_REWARD = 1.0 + 2 * STRUCTURE_BONUS

# (entry_point, prompt, helper_hint, tests)
_PROBLEMS: list[tuple[str, str, str, list[str]]] = [
    (
        "count_vowels",
        "Write `count_vowels(s: str) -> int` that returns the number of vowels (a, e, i, o, u, in either case) in `s`.",
        "`aux(ch: str) -> bool` returns True when the single character `ch` is a vowel (a, e, i, o, u, either case)",
        [
            'assert count_vowels("hello") == 2',
            'assert count_vowels("AEIOU xyz") == 5',
            'assert count_vowels("rhythm") == 0',
            'assert count_vowels("") == 0',
        ],
    ),
    (
        "reverse_words",
        "Write `reverse_words(s: str) -> str` that returns the words of `s` (separated by any whitespace) in reverse "
        "order, joined by single spaces.",
        "`aux(s: str) -> list[str]` returns the words of `s`, split on any whitespace",
        [
            'assert reverse_words("hello world") == "world hello"',
            'assert reverse_words("  a  b c ") == "c b a"',
            'assert reverse_words("one") == "one"',
            'assert reverse_words("") == ""',
        ],
    ),
    (
        "is_palindrome",
        "Write `is_palindrome(s: str) -> bool` that tells whether `s` reads the same backwards, ignoring case and every "
        "character that is not a letter or a digit.",
        "`aux(s: str) -> str` returns the letters and digits of `s`, lower-cased, in order",
        [
            'assert is_palindrome("A man, a plan, a canal: Panama") == True',
            'assert is_palindrome("race a car") == False',
            'assert is_palindrome("") == True',
            "assert is_palindrome(\"No 'x' in Nixon\") == True",
        ],
    ),
    (
        "sum_of_squares",
        "Write `sum_of_squares(nums: list[int]) -> int` that returns the sum of the squares of the numbers in `nums`.",
        "`aux(x: int) -> int` returns `x` squared",
        [
            "assert sum_of_squares([1, 2, 3]) == 14",
            "assert sum_of_squares([]) == 0",
            "assert sum_of_squares([-4]) == 16",
            "assert sum_of_squares([0, 5, -1]) == 26",
        ],
    ),
    (
        "count_primes",
        "Write `count_primes(n: int) -> int` that returns how many prime numbers are smaller than `n`.",
        "`aux(k: int) -> bool` returns True when `k` is a prime number (False for k < 2)",
        [
            "assert count_primes(10) == 4",
            "assert count_primes(2) == 0",
            "assert count_primes(3) == 1",
            "assert count_primes(30) == 10",
        ],
    ),
    (
        "gcd_list",
        "Write `gcd_list(nums: list[int]) -> int` that returns the greatest common divisor of the positive integers in "
        "the non-empty list `nums`.",
        "`aux(a: int, b: int) -> int` returns the greatest common divisor of `a` and `b`",
        [
            "assert gcd_list([12, 18, 24]) == 6",
            "assert gcd_list([7]) == 7",
            "assert gcd_list([10, 25]) == 5",
            "assert gcd_list([8, 9]) == 1",
        ],
    ),
    (
        "flatten",
        "Write `flatten(items: list) -> list` that returns the elements of the arbitrarily nested list `items` that "
        "are not lists themselves, in order.",
        "`aux(x) -> bool` returns True when `x` is a list",
        [
            "assert flatten([1, [2, [3, 4]], 5]) == [1, 2, 3, 4, 5]",
            "assert flatten([]) == []",
            "assert flatten([[], [[]]]) == []",
            'assert flatten(["a", ["b"]]) == ["a", "b"]',
        ],
    ),
    (
        "most_common_char",
        "Write `most_common_char(s: str) -> str` that returns the character occurring most often in the non-empty "
        "string `s`; on a tie, the one that occurs first in `s`.",
        "`aux(s: str) -> dict[str, int]` maps every character of `s` to the number of times it occurs",
        [
            'assert most_common_char("banana") == "a"',
            'assert most_common_char("abc") == "a"',
            'assert most_common_char("aabbb") == "b"',
            'assert most_common_char("xyyx") == "x"',
        ],
    ),
    (
        "caesar_shift",
        "Write `caesar_shift(s: str, k: int) -> str` that shifts every letter of `s` by `k` places in the alphabet, "
        "wrapping around and keeping its case; other characters stay the same.",
        "`aux(ch: str, k: int) -> str` shifts the single character `ch` by `k` letters (wrapping, keeping its case) "
        "and returns any other character unchanged",
        [
            'assert caesar_shift("abc", 1) == "bcd"',
            'assert caesar_shift("xyz", 3) == "abc"',
            'assert caesar_shift("Hello, World!", 13) == "Uryyb, Jbeyq!"',
            'assert caesar_shift("abc", -1) == "zab"',
        ],
    ),
    (
        "digital_root",
        "Write `digital_root(n: int) -> int` that repeatedly replaces the non-negative integer `n` by the sum of its "
        "decimal digits until one digit remains, and returns that digit.",
        "`aux(n: int) -> int` returns the sum of the decimal digits of `n`",
        [
            "assert digital_root(16) == 7",
            "assert digital_root(942) == 6",
            "assert digital_root(0) == 0",
            "assert digital_root(999999999999) == 9",
        ],
    ),
    (
        "run_length_encode",
        "Write `run_length_encode(s: str) -> str` that replaces every run of equal characters in `s` by the character "
        'followed by the length of the run, e.g. "aaab" -> "a3b1".',
        "`aux(s: str, i: int) -> int` returns the length of the run of equal characters that starts at index `i` of `s`",
        [
            'assert run_length_encode("aaab") == "a3b1"',
            'assert run_length_encode("") == ""',
            'assert run_length_encode("abc") == "a1b1c1"',
            'assert run_length_encode("zzzzzzzzzzzz") == "z12"',
        ],
    ),
    (
        "fizzbuzz",
        'Write `fizzbuzz(n: int) -> list[str]` that returns the FizzBuzz words for 1..n: "FizzBuzz" for multiples of '
        '15, "Fizz" for other multiples of 3, "Buzz" for other multiples of 5, else the number as a string.',
        "`aux(i: int) -> str` returns the FizzBuzz word for the single number `i`",
        [
            'assert fizzbuzz(5) == ["1", "2", "Fizz", "4", "Buzz"]',
            "assert fizzbuzz(0) == []",
            'assert fizzbuzz(15)[-1] == "FizzBuzz"',
            'assert fizzbuzz(15).count("Fizz") == 4',
        ],
    ),
]


# ----- dataset -----


def build_dataset(split: str = "train") -> Dataset:
    """The built-in problems: every 4th one (3 of 12) is `"eval"`, the others `"train"`; the order is fixed.

    Columns: `task_id`, `prompt` (the problem), `entry_point`, `helper_hint`, `tests` (list of `assert` lines).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    rows = [
        {
            "task_id": entry_point,
            "prompt": prompt,
            "entry_point": entry_point,
            "helper_hint": hint,
            "tests": list(tests),
        }
        for index, (entry_point, prompt, hint, tests) in enumerate(_PROBLEMS)
        if (index % 4 == 3) == (split == "eval")
    ]
    return Dataset.from_list(rows)


# ----- prompts -----


def helper_formatter(item: dict[str, Any], external_prompts: str | None = None) -> str:
    """Agent 0's prompt: the problem and the helper to write; at later turns also the revision prompt."""
    head = (
        f"You write the helper function of a two-agent Python team.\nProblem: {item['prompt']}\n"
        f"Write only the helper: {item['helper_hint']}. Your teammate writes `{item['entry_point']}` and calls "
        f"`{HELPER_NAME}`."
    )
    return with_feedback(head, external_prompts)


def main_formatter(item: dict[str, Any], external_prompts: str | None = None) -> str:
    """Agent 1's prompt: the problem, the helper it may call; at later turns also the revision prompt."""
    head = (
        f"You write the main function of a two-agent Python team.\nProblem: {item['prompt']}\n"
        f"Your teammate writes the helper: {item['helper_hint']}. Write `{item['entry_point']}` and call "
        f"`{HELPER_NAME}` instead of repeating its work; do not define `{HELPER_NAME}` yourself."
    )
    return with_feedback(head, external_prompts)


def formatters() -> list[Callable[..., str]]:
    """The agents' formatters in actor order: `[helper_formatter, main_formatter]`."""
    return [helper_formatter, main_formatter]


# ----- reward -----


def shown_and_hidden(tests: Sequence[T]) -> tuple[list[T], list[T]]:
    """An item's tests split for multi-turn feedback, deterministically: `(shown, hidden)`.

    Tests 0, 2, 4, ... are shown (turn 1's feedback quotes them), tests 1, 3, 5, ... are hidden (the reward scores
    them); a single test is hidden and nothing is shown.
    """
    tests = list(tests)
    if len(tests) == 1:
        return [], tests
    return tests[0::2], tests[1::2]


def feedback_tests(tests: Sequence[T], hidden_tests: bool) -> tuple[list[T], bool]:
    """The tests turn 1's feedback reports, and whether it may quote them: with `hidden_tests`, the shown part
    (quoted) or, where nothing is shown (a single test), the hidden test as a count only (no text, no values);
    without it, all tests (quoted)."""
    shown, hidden = shown_and_hidden(tests)
    if not validated_hidden_tests(hidden_tests):
        return list(tests), True
    return (shown, True) if shown else (hidden, False)


def counts_only(result: SandboxResult) -> SandboxResult:
    """`result` without its error texts (which quote the tests and their expected values)."""
    return SandboxResult(result.passed, result.total, timed_out=result.timed_out)


def validated_hidden_tests(hidden_tests: bool) -> bool:
    """`hidden_tests`, checked to be a bool."""
    if not isinstance(hidden_tests, bool):
        raise ValueError(
            f"hidden_tests must be True (score on tests the feedback does not show) or False (score on all tests), "
            f"got {hidden_tests!r}."
        )
    return hidden_tests


def run_tests(helper_code: str, main_code: str, tests: Sequence[str], entry_point: str | None = None) -> SandboxResult:
    """Run `tests` against the joint program (cached: the reward and the transition see the same programs); with
    `entry_point`, the run also says whether it called the teammate's own `aux` (`SandboxResult.watched`)."""
    watch = None if entry_point is None else (entry_point, HELPER_NAME)
    return _run_cached(joint_program(helper_code, main_code), tuple(tests), watch)


@functools.lru_cache(maxsize=4096)
def _run_cached(program: str, tests: tuple[str, ...], watch: tuple[str, str] | None = None) -> SandboxResult:
    if not program.strip():
        return SandboxResult(0, len(tests), ["No code: neither agent wrote a function definition"])
    return run_python(program, list(tests), timeout=SANDBOX_TIMEOUT, watch=watch)


def reward(
    helper_completions: Sequence[str],
    main_completions: Sequence[str],
    *,
    batch_items: Sequence[dict[str, Any]],
    hidden_tests: bool = True,
) -> list[float]:
    """One reward per joint action (see the module docstring): tests passed, plus the structure bonus.

    With `hidden_tests` (the default) only the tests `transition`'s feedback does not show are scored, at every
    turn; `hidden_tests=False` scores all of them (then pass the same to `transition`)."""
    item = batch_items[0]
    tests = shown_and_hidden(item["tests"])[1] if validated_hidden_tests(hidden_tests) else item["tests"]
    return joint_rewards(
        helper_completions,
        main_completions,
        item["entry_point"],
        lambda helper, main: run_tests(helper, main, tests, item["entry_point"]),
    )


# ----- transition -----


def transition(
    *,
    prompt: str,
    agent_completions: Sequence[str],
    num_agents: int,
    prompt_history_per_agent: Sequence[Sequence[Any]],
    response_history_per_agent: Sequence[Sequence[str]],
    batch_item: dict[str, Any],
    hidden_tests: bool = True,
) -> list[str]:
    """The next turn's revision prompts `[helper_prompt, main_prompt]` for one joint action.

    Each holds the test results of the joint program (the first failing tests, truncated), the agent's own code
    and the teammate's code, and asks for a revised function. With `hidden_tests` (the default) the results are
    those of the shown tests only (`shown_and_hidden`), so the expected values the reward checks are never quoted;
    `hidden_tests=False` reports all tests (then pass the same to `reward`). `prompt` and
    `prompt_history_per_agent` are part of the transition contract but not needed here.
    """
    tests, quoted = feedback_tests(batch_item["tests"], hidden_tests)

    def feedback(helper: str, main: str) -> SandboxResult:
        result = run_tests(helper, main, tests)
        return result if quoted else counts_only(result)

    return revision_prompts(
        agent_completions,
        num_agents,
        len(response_history_per_agent[0]),
        batch_item["entry_point"],
        feedback,
        "code-feedback",
    )


# ----- evaluation metrics -----


def eval_logger(
    *, agent_completions_turns: list[list[list[str]]], batch_items: list[dict[str, Any]], prompts: list[Any]
) -> list[dict[str, float]]:
    """Per evaluation item and turn: `turn_k/pass_rate` (tests passed), `turn_k/solved` (all passed) and
    `turn_k/malformed` (1.0 when the analysis scored an agent's code as malformed, the reason in
    `turn_k/malformed_reason`; see `coding.malformed_reason`)."""
    rows = []
    for i, item in enumerate(batch_items):
        row = {}
        for turn, (helper_text, main_text) in enumerate(
            zip(agent_completions_turns[0][i], agent_completions_turns[1][i]), start=1
        ):
            result = run_tests(extract_code(helper_text), extract_code(main_text), item["tests"])
            row[f"turn_{turn}/pass_rate"] = result.pass_rate
            row[f"turn_{turn}/solved"] = float(result.total > 0 and result.passed == result.total)
            reason = malformed_reason(helper_text, main_text)
            row[f"turn_{turn}/malformed"] = float(reason is not None)
            row[f"turn_{turn}/malformed_reason"] = reason or ""
        rows.append(row)
    return rows


def eval_aggregator(rows: list[dict[str, float]], *, num_turns: int) -> dict[str, float]:
    """The mean of every `eval_logger` metric over the evaluation items."""
    names = ("pass_rate", "solved", "malformed")
    keys = [f"turn_{turn}/{name}" for turn in range(1, num_turns + 1) for name in names]
    return {key: sum(row[key] for row in rows) / len(rows) for key in keys if rows and all(key in row for row in rows)}
