"""Pieces shared by the two-agent coding tasks (`code_feedback`, `humaneval`).

Agent 0 writes a helper `def aux(...)`, agent 1 the problem's main function, which may call `aux`. This module
holds what both tasks do the same way: pulling the code out of a completion, the structure bonus, running
several programs in parallel, the revision prompts of multi-turn training, and the pass@k estimator.
"""

import ast
import os
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .sandbox import SandboxResult


HELPER_NAME = "aux"
STRUCTURE_BONUS = 0.1  # for defining the entry point, and again for calling the helper
MAX_FEEDBACK_ERRORS = 3  # failing tests shown in a revision prompt
MAX_FEEDBACK_CODE_CHARS = 600  # each code listing in a revision prompt is cut to this length
MAX_WORKERS = 8  # sandboxes run at once by `run_parallel`

T = TypeVar("T")
R = TypeVar("R")


# ----- code extraction -----

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)
_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]", re.MULTILINE)
_IMPORT = re.compile(r"^[ \t]*(?:import[ \t]+\w|from[ \t]+[\w.]+[ \t]+import[ \t])")


def extract_code(completion: str) -> str:
    """The Python code in a model's completion: `""` when it defines no function.

    Markdown fences are stripped (the first fenced block that contains a `def`, else the first block; a block
    may be unterminated), then the text from the first line starting with `def` is kept, together with the
    import lines right above it. Trailing lines that keep the code from parsing (prose after the code, a cut-off
    last statement) are dropped; if no prefix parses, the text is returned as is and the sandbox reports the
    syntax error.
    """
    text = completion.replace("\r\n", "\n")
    blocks = _FENCE.findall(text)
    if blocks:
        text = next((block for block in blocks if _DEF.search(block)), blocks[0])
    match = _DEF.search(text)
    if match is None:
        return ""
    lines = text[: match.start()].split("\n")[:-1]
    start = len(lines)
    while start > 0 and (_IMPORT.match(lines[start - 1]) or not lines[start - 1].strip()):
        start -= 1
    imports = [line.strip() for line in lines[start:] if line.strip()]
    indent = match.group(1)  # the first def's indentation is removed from every line that has it
    body = [
        line[len(indent) :] if line.startswith(indent) else line for line in text[match.start() :].rstrip().split("\n")
    ]
    for end in range(len(body), 0, -1):  # the longest prefix that parses, always with the first `def`
        code = "\n".join(imports + body[:end])
        if parses(code):
            return code
    return "\n".join(imports + body)


def parses(code: str) -> bool:
    """Whether `code` is syntactically valid Python."""
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


# ----- joint program and structure bonus -----


def joint_program(*parts: str) -> str:
    """The program the tests run against: the non-empty parts (e.g. helper code, then main code), in order."""
    return "\n\n".join(part.strip("\n") for part in parts if part.strip()) + "\n"


def structure_bonus(main_code: str, entry_point: str) -> float:
    """+0.1 if `main_code` defines `entry_point`, +0.1 more if that function calls the teammate's `aux`
    (and `main_code` does not define `aux` itself)."""
    try:
        tree = ast.parse(main_code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return 0.0
    functions = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    entry = next((node for node in functions if node.name == entry_point), None)
    if entry is None:
        return 0.0
    defines_helper = any(node.name == HELPER_NAME for node in functions)
    calls_helper = any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == HELPER_NAME
        for node in ast.walk(entry)
    )
    return STRUCTURE_BONUS + (STRUCTURE_BONUS if calls_helper and not defines_helper else 0.0)


def run_parallel(function: Callable[[T], R], inputs: Iterable[T]) -> list[R]:
    """`[function(x) for x in inputs]`, in up to `MAX_WORKERS` threads (each sandbox is its own process)."""
    inputs = list(inputs)
    workers = max(1, min(len(inputs), os.cpu_count() or 1, MAX_WORKERS))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(function, inputs))


def joint_rewards(
    helper_completions: Sequence[str],
    main_completions: Sequence[str],
    entry_point: str,
    run_tests: Callable[[str, str], SandboxResult],
) -> list[float]:
    """One reward per joint action: the fraction of tests `run_tests(helper_code, main_code)` passes, plus
    `structure_bonus`. The programs run in parallel."""
    helpers = [extract_code(text) for text in helper_completions]
    mains = [extract_code(text) for text in main_completions]
    results = run_parallel(lambda pair: run_tests(*pair), zip(helpers, mains))
    return [result.pass_rate + structure_bonus(main, entry_point) for result, main in zip(results, mains)]


# ----- prompts -----


def with_feedback(head: str, feedback: str | None) -> str:
    """An agent's prompt: the task `head`, then (at later turns) the revision prompt, then the answer format."""
    parts = [head] if feedback is None else [head, feedback.strip()]
    return "\n\n".join(parts) + "\nAnswer with Python code only.\n"


def revision_prompts(
    agent_completions: Sequence[str],
    num_agents: int,
    attempt: int,
    entry_point: str,
    run_tests: Callable[[str, str], SandboxResult],
    task_name: str,
) -> list[str]:
    """The next turn's `[helper_prompt, main_prompt]` for one joint action: the test results of the joint program
    (the first failing tests, truncated), the agent's own previous code and the teammate's code, and a request to
    revise. `attempt` is the number of the turn that produced `agent_completions`."""
    if num_agents != 2:
        raise ValueError(f"The {task_name} task has 2 agents (helper, main), got num_agents={num_agents}.")
    helper_code, main_code = (extract_code(text) for text in agent_completions)
    report = _test_report(run_tests(helper_code, main_code), attempt)
    helper_prompt = "\n".join(
        [
            report,
            f"Your previous `{HELPER_NAME}`:",
            _listing(helper_code),
            f"Your teammate's `{entry_point}`:",
            _listing(main_code),
            f"Revise `{HELPER_NAME}` so that the joint program passes the tests.",
        ]
    )
    main_prompt = "\n".join(
        [
            report,
            f"Your previous `{entry_point}`:",
            _listing(main_code),
            f"Your teammate's `{HELPER_NAME}`:",
            _listing(helper_code),
            f"Revise `{entry_point}` so that the joint program passes the tests.",
        ]
    )
    return [helper_prompt, main_prompt]


def _test_report(result: SandboxResult, attempt: int) -> str:
    head = f"Attempt {attempt}: the joint program passed {result.passed} of {result.total} tests."
    if result.timed_out:
        return head + " It ran out of time (an endless loop?)."
    if not result.errors:
        return head
    return "\n".join([head, "Problems:", *(f"- {error}" for error in result.errors[:MAX_FEEDBACK_ERRORS])])


def _listing(code: str) -> str:
    if not code.strip():
        return "(no function found)"
    if len(code) > MAX_FEEDBACK_CODE_CHARS:
        code = code[:MAX_FEEDBACK_CODE_CHARS].rstrip() + "\n# ... (cut)"
    return f"```python\n{code}\n```"


# ----- pass@k -----


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate of the HumanEval paper (Chen et al., 2021) for one problem.

    With `n` samples of which `c` are correct: `1 - C(n - c, k) / C(n, k)`, the probability that at least one of
    `k` samples drawn without replacement is correct, computed as `1 - prod_{i=n-c+1}^{n} (1 - k / i)`.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}.")
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and the number of samples n={n}, got k={k}.")
    if c > n:
        raise ValueError(f"c (correct samples) cannot exceed n (samples): c={c}, n={n}.")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def pass_at_k_values(num_samples: int) -> list[int]:
    """The k reported for `num_samples` samples per problem: 1, 2, 5, 10, 20, 50, 100 up to it, and itself."""
    return sorted({k for k in (1, 2, 5, 10, 20, 50, 100) if k <= num_samples} | {num_samples})


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k averaged over problems, each given as `(samples, correct)`."""
    if not counts:
        raise ValueError("mean_pass_at_k needs at least one problem.")
    return sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def group_counts(rows: Sequence[dict[str, Any]], key: str, flag: str) -> list[tuple[int, int]]:
    """`(samples, correct)` per value of `rows[i][key]` (first-seen order), counting rows whose `flag` is true."""
    counts: dict[Any, list[int]] = {}
    for row in rows:
        entry = counts.setdefault(row[key], [0, 0])
        entry[0] += 1
        entry[1] += int(bool(row[flag]))
    return [(n, c) for n, c in counts.values()]
