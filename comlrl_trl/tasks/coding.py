"""Pieces shared by the two-agent coding tasks (`code_feedback`, `humaneval`).

Agent 0 writes a helper `def aux(...)`, agent 1 the problem's main function, which may call `aux`. This module
holds what both tasks do the same way: pulling the code out of a completion, the structure bonus, running
several programs in parallel, the revision prompts of multi-turn training, and the pass@k estimator.
"""

import ast
import operator
import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .sandbox import SandboxResult, parse, printable


HELPER_NAME = "aux"
STRUCTURE_BONUS = 0.1  # for defining the entry point, and again for calling the helper
MAX_FEEDBACK_ERRORS = 3  # failing tests shown in a revision prompt
MAX_FEEDBACK_CODE_CHARS = 600  # each code listing in a revision prompt is cut to this length
MAX_FEEDBACK_ERROR_CHARS = 200  # each failing test in a revision prompt is cut to this length
MAX_WORKERS = 8  # sandboxes run at once by `run_parallel`
MAX_COMPLETION_CHARS = 100_000  # a longer completion is scored as one without code ("too long")
MAX_PARSE_ATTEMPTS = 32  # prefixes `extract_code` tries to parse, at most
MAX_AST_DEPTH = 100  # code nested deeper gets no structure bonus ("too deep"); real code stays far below

T = TypeVar("T")
R = TypeVar("R")


# ----- malformed code: why the analysis gave up -----

_MALFORMED: Counter[str] = Counter()
_MALFORMED_LOCK = threading.Lock()


def malformed_counts() -> dict[str, int]:
    """How often, since the process started, the analysis of model-written code in this process (`extract_code`,
    `structure_bonus`) scored a completion as malformed, per reason: `"too long"`, `"too deep"`, or the error
    that parsing or a walk of the code raised (`"SyntaxError"`, `"ValueError"` for NUL bytes, huge int literals
    or lone surrogates, `"RecursionError"`, `"MemoryError"`). A metric to log; a reward never raises for them."""
    with _MALFORMED_LOCK:
        return dict(_MALFORMED)


def _malformed(reason: str) -> None:
    with _MALFORMED_LOCK:
        _MALFORMED[reason] += 1


# What `ast.parse` raises for hostile source text: bad syntax, NUL bytes, lone surrogates (UnicodeEncodeError)
# and int literals over the digit limit (all ValueError), nesting beyond the parser's stack (RecursionError,
# MemoryError).
_PARSE_ERRORS = (SyntaxError, ValueError, RecursionError, MemoryError)


def parse_bounded(code: str) -> tuple[ast.Module | None, str | None]:
    """`(tree, None)` when `code` parses, is at most `MAX_COMPLETION_CHARS` long and nested at most
    `MAX_AST_DEPTH` deep (so recursive walks of the tree stay short); else `(None, reason)`."""
    if len(code) > MAX_COMPLETION_CHARS:
        return None, "too long"
    try:
        tree = parse(code)
    except _PARSE_ERRORS as error:
        return None, type(error).__name__
    if _deeper_than(tree, MAX_AST_DEPTH):
        return None, "too deep"
    return tree, None


def _deeper_than(tree: ast.AST, limit: int) -> bool:
    """Whether `tree` has a node more than `limit` levels below its root (walked without recursion)."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    return False


def malformed_reason(*completions: str) -> str | None:
    """Why the analysis scores one of these completions (say, a joint action's) as malformed: `"too long"`,
    `"too deep"` or the error parsing its code raised (`"SyntaxError"`, `"RecursionError"`, ...); None when every
    one of them is without code or analysable. What the code tasks' evaluation rows record (`turn_k/malformed`)."""
    for completion in completions:
        if len(completion) > MAX_COMPLETION_CHARS:
            return "too long"
        code = extract_code(completion)
        reason = parse_bounded(code)[1] if code else None
        if reason is not None:
            return reason
    return None


# ----- code extraction -----

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)
_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]", re.MULTILINE)
_IMPORT = re.compile(r"^[ \t]*(?:import[ \t]+\w|from[ \t]+[\w.]+[ \t]+import[ \t])")


def extract_code(completion: str) -> str:
    """The Python code in a model's completion: `""` when it defines no function.

    Markdown fences are stripped (the first fenced block that contains a `def`, else the first block; a block
    may be unterminated), then the text from the first line starting with `def` is kept, together with the
    import lines right above it. Trailing lines that keep the code from parsing (prose after the code, a cut-off
    last statement) are dropped (from the line of the syntax error on, at most `MAX_PARSE_ATTEMPTS` tries); if no
    prefix parses, the text is returned as is and the sandbox reports the syntax error. A completion longer than
    `MAX_COMPLETION_CHARS` counts as one without code (reason "too long" in `malformed_counts`).
    """
    if len(completion) > MAX_COMPLETION_CHARS:
        _malformed("too long")
        return ""
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
    end = len(body)
    for _ in range(MAX_PARSE_ATTEMPTS):  # the longest prefix that parses, always with the first `def`
        code = "\n".join(imports + body[:end])
        error_line = _syntax_error_line(code)
        if error_line is None:
            return code
        end = min(end - 1, error_line - 1 - len(imports))  # a prefix that still holds that line fails there too
        if end < 1:
            break
    return "\n".join(imports + body)


def parses(code: str) -> bool:
    """Whether `code` is syntactically valid Python."""
    return _syntax_error_line(code) is None


def _syntax_error_line(code: str) -> int | None:
    """None when `code` parses, else the line of the error (past the end when unknown)."""
    try:
        parse(code)
    except SyntaxError as error:
        return error.lineno or code.count("\n") + 2
    except _PARSE_ERRORS:
        return code.count("\n") + 2
    return None


# ----- joint program and structure bonus -----


def joint_program(*parts: str) -> str:
    """The program the tests run against: the non-empty parts (e.g. helper code, then main code), in order."""
    return "\n\n".join(part.strip("\n") for part in parts if part.strip()) + "\n"


def structure_bonus(main_code: str, entry_point: str, helper_ran: bool | None = None) -> float:
    """+0.1 if `main_code` defines `entry_point` (its last binding of that exact name is a top-level `def`), +0.1
    more if that function reachably calls the teammate's `aux`: the call is not in code that cannot run (`if
    False:`, after `return`, a loop over `[]`, an unused nested function, ...), `aux` is not a local name of the
    function, and `main_code` does not bind `aux` at the top level itself (`def`, assignment, import, star import,
    `global`, or the name in a string, or `exec`, `globals`, `setattr`, ...); and, where the run gave evidence
    (`helper_ran`, see `SandboxResult.watched`), the tests called the program's own `entry_point` and that call ran
    the teammate's own `aux`.

    Code that is malformed for the analysis (it does not parse, is longer than `MAX_COMPLETION_CHARS` or nested
    deeper than `MAX_AST_DEPTH`) gets 0.0, with the reason counted in `malformed_counts`."""
    tree, reason = parse_bounded(main_code)
    if tree is None:
        _malformed(reason)
        return 0.0
    try:
        return _structure_bonus(tree, entry_point, helper_ran is not False)
    except RecursionError:  # only where the caller's own stack is nearly full: the walks are MAX_AST_DEPTH deep
        _malformed("RecursionError")
        return 0.0


def _structure_bonus(tree: ast.Module, entry_point: str, helper_may_have_run: bool) -> float:
    bindings = _top_level_bindings(tree)
    entry = bindings.get(entry_point)
    if not isinstance(entry, (ast.FunctionDef, ast.AsyncFunctionDef)) or entry not in tree.body:
        return 0.0  # not defined by a `def` at the top level (e.g. one under `if False:`), or re-bound later
    calls_helper = (
        helper_may_have_run
        and HELPER_NAME not in _local_names(entry)
        and not _changes_attributes_of(tree, entry_point)  # e.g. its __code__ replaced
        and _function_calls(entry, HELPER_NAME)
    )
    defines_helper = HELPER_NAME in bindings or _binds_by_other_means(tree, HELPER_NAME)
    return STRUCTURE_BONUS + (STRUCTURE_BONUS if calls_helper and not defines_helper else 0.0)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _top_level_bindings(tree: ast.Module) -> dict[str, ast.AST]:
    """Every name bound at module level, mapped to its last binding in source order: the `def`/`class` node, or the
    assignment, import, loop, ... that binds it (compound statements at module level included)."""
    bindings: dict[str, ast.AST] = {}

    def visit(node: ast.AST, statement: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                statement_of_child = child
            else:
                statement_of_child = statement
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for part in (*child.decorator_list, *getattr(child, "bases", ())):
                    visit(part, child)
                bindings[child.name] = child
                continue
            if isinstance(child, ast.Lambda):
                continue
            if isinstance(child, ast.Name) and not isinstance(child.ctx, ast.Load):
                bindings[child.id] = statement_of_child
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                for alias in child.names:
                    bindings[alias.asname or alias.name.split(".")[0]] = child
            elif isinstance(child, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and child.name:
                bindings[child.name] = statement_of_child
            elif isinstance(child, ast.MatchMapping) and child.rest:
                bindings[child.rest] = statement_of_child
            visit(child, statement_of_child)

    visit(tree, tree)
    return bindings


# Built-ins through which code binds global names it does not spell out (`exec("a" + "ux = len")`).
_DYNAMIC_BINDERS = frozenset({"exec", "eval", "compile", "globals", "vars", "setattr", "__import__", "__builtins__"})


def _binds_by_other_means(tree: ast.Module, name: str) -> bool:
    """Whether the code may bind `name` globally other than by a top-level statement: `global name` in a function,
    an attribute of that name assigned (`builtins.aux = ...`), the name in a string (`globals()["aux"]`), a star
    import, or any use of `exec`, `eval`, `globals`, `setattr`, ... (which can bind a name built at run time)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(alias.name == "*" for alias in node.names):
            return True
        if isinstance(node, ast.Name) and node.id in _DYNAMIC_BINDERS:
            return True
        if isinstance(node, ast.Global) and name in node.names:
            return True
        if isinstance(node, ast.Attribute) and node.attr == name and not isinstance(node.ctx, ast.Load):
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and name in node.value:
            return True
    return False


def _changes_attributes_of(tree: ast.Module, name: str) -> bool:
    """Whether the code assigns or deletes an attribute of `name` (`f.__code__ = g.__code__`)."""
    return any(
        isinstance(node, ast.Attribute)
        and not isinstance(node.ctx, ast.Load)
        and isinstance(node.value, ast.Name)
        and node.value.id == name
        for node in ast.walk(tree)
    )


def _local_names(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The names `function` binds itself: its parameters and everything assigned, defined or imported in it."""
    arguments = function.args
    names = {
        argument.arg
        for argument in (
            *arguments.posonlyargs,
            *arguments.args,
            *arguments.kwonlyargs,
            arguments.vararg,
            arguments.kwarg,
        )
        if argument is not None
    }
    for node in (node for statement in function.body for node in ast.walk(statement)):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _function_calls(function: ast.FunctionDef | ast.AsyncFunctionDef, name: str) -> bool:
    """Whether `function` calls `name` in code that can run: its body, and the nested functions and lambdas it
    uses (a nested function whose name is read, a lambda that is called, passed, returned or named and read)."""
    used = {node.id for node in ast.walk(function) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return _Reach(name, used).block(function.body)


class _Reach:
    """Finds a reachable call of `name`; code is unreachable after `return`/`raise`/`break`/`continue` in its
    block, under a condition that is constantly false, or in a loop over a literal that is empty."""

    def __init__(self, name: str, used: set[str]):
        self.name, self.used = name, used
        self.truths: dict[ast.expr, bool | None] = {}  # `_truth` of each condition met, so nesting costs no more

    def block(self, statements: list[ast.stmt]) -> bool:
        for statement in statements:
            if self.statement(statement):
                return True
            if isinstance(statement, (ast.Return, ast.Raise, ast.Break, ast.Continue)):
                return False
        return False

    def statement(self, node: ast.stmt) -> bool:
        if isinstance(node, (ast.If, ast.While)):
            truth = _truth(node.test, self.truths)
            if self.expression(node.test):
                return True
            return (truth is not False and self.block(node.body)) or (truth is not True and self.block(node.orelse))
        if isinstance(node, (ast.For, ast.AsyncFor)):
            if self.expression(node.iter):
                return True
            return (not _empty(node.iter) and self.block(node.body)) or self.block(node.orelse)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = node.args
            parts = [*node.decorator_list, *arguments.defaults, *(d for d in arguments.kw_defaults if d is not None)]
            return any(self.expression(part) for part in parts) or (node.name in self.used and self.block(node.body))
        if isinstance(node, ast.ClassDef):
            return any(self.expression(part) for part in (*node.decorator_list, *node.bases)) or self.block(node.body)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):  # f = lambda ...: used if f is read
            named = all(isinstance(target, ast.Name) for target in node.targets)
            if named and not any(target.id in self.used for target in node.targets):
                return False
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Lambda):  # a lambda nobody can call
            return False
        for _, value in ast.iter_fields(node):  # the rest (try, with, match, ...): every part can run
            children = value if isinstance(value, list) else [value]
            if children and isinstance(children[0], ast.stmt):
                if self.block(children):
                    return True
                continue
            for child in children:
                if isinstance(child, ast.expr):
                    parts, body = [child], []
                elif isinstance(child, ast.withitem):
                    parts, body = [child.context_expr], []
                elif isinstance(child, ast.ExceptHandler):
                    parts, body = [child.type], child.body
                elif isinstance(child, ast.match_case):
                    parts, body = [child.guard], child.body
                else:
                    continue
                if any(part is not None and self.expression(part) for part in parts) or self.block(body):
                    return True
        return False

    def expression(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == self.name:
            return True
        if isinstance(node, ast.IfExp):
            truth = _truth(node.test, self.truths)
            return (
                self.expression(node.test)
                or (truth is not False and self.expression(node.body))
                or (truth is not True and self.expression(node.orelse))
            )
        if isinstance(node, ast.BoolOp):
            for value in node.values:
                if self.expression(value):
                    return True
                truth = _truth(value, self.truths)
                if truth is not None and truth == isinstance(node.op, ast.Or):  # short-circuits here
                    return False
            return False
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            if self.expression(node.generators[0].iter):
                return True
            if any(_empty(g.iter) or any(_truth(c, self.truths) is False for c in g.ifs) for g in node.generators):
                return False
            parts = [*(g.iter for g in node.generators[1:]), *(c for g in node.generators for c in g.ifs)]
            parts += [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            return any(self.expression(part) for part in parts)
        if isinstance(node, ast.Lambda):  # reached here as a value that is called, passed, returned or stored
            return self.expression(node.body)
        children = [child.value if isinstance(child, ast.keyword) else child for child in ast.iter_child_nodes(node)]
        return any(self.expression(child) for child in children if isinstance(child, ast.expr))


def _truth(node: ast.expr, known: dict[ast.expr, bool | None]) -> bool | None:
    """The truth value of a condition made of constants (`False`, `0`, `not True`, `1 == 2`, `[]`), else None.
    `known` holds the values already worked out (nested conditions are asked for again at every level)."""
    if node not in known:
        known[node] = _truth_of(node, known)
    return known[node]


def _truth_of(node: ast.expr, known: dict[ast.expr, bool | None]) -> bool | None:
    if isinstance(node, ast.Constant):
        return bool(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _truth(node.operand, known)
        return None if inner is None else not inner
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return bool(node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.keys)
    if isinstance(node, ast.BoolOp):
        truths = [_truth(value, known) for value in node.values]
        if isinstance(node.op, ast.And):
            return False if False in truths else (True if all(t is True for t in truths) else None)
        return True if True in truths else (False if all(t is False for t in truths) else None)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left, right = node.left, node.comparators[0]
        kinds = (int, float, str, bool, type(None))
        if all(isinstance(side, ast.Constant) and isinstance(side.value, kinds) for side in (left, right)):
            compare = _COMPARISONS.get(type(node.ops[0]))
            try:
                return None if compare is None else bool(compare(left.value, right.value))
            except TypeError:
                return None
    return None


_COMPARISONS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}


def _empty(node: ast.expr) -> bool:
    """Whether `node` is a literal that is empty: `[]`, `()`, `""`, `{}`, `range(0)`, `range(3, 3)`."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return not node.elts
    if isinstance(node, ast.Dict):
        return not node.keys
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (str, bytes)) and not node.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "range"
        and not node.keywords
    ):
        if 1 <= len(node.args) <= 2 and all(isinstance(a, ast.Constant) and type(a.value) is int for a in node.args):
            start, stop = (0, node.args[0].value) if len(node.args) == 1 else (node.args[0].value, node.args[1].value)
            return stop <= start  # not len(range(...)): it overflows past sys.maxsize
    return False


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
    `structure_bonus` (with the run's evidence of what the entry point called, where `run_tests` watched it:
    `SandboxResult.watched`). The joint actions are scored in parallel, each in a worker thread: the analysis of
    the code starts there on a fresh stack, whatever depth the trainer called from."""

    def score(completions: tuple[str, str]) -> float:
        helper, main = (extract_code(text) for text in completions)
        result = run_tests(helper, main)
        return result.pass_rate + structure_bonus(main, entry_point, result.watched)

    return run_parallel(score, zip(helper_completions, main_completions))


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
    """The test results: a trusted head line, then the failing tests as quoted data, one line each (they hold
    values and messages of the agents' code)."""
    head = f"Attempt {attempt}: the joint program passed {int(result.passed)} of {int(result.total)} tests."
    if result.timed_out:
        return head + " It ran out of time (an endless loop?)."
    if not result.errors:
        return head
    lines = [f"- {_one_line(str(error), MAX_FEEDBACK_ERROR_CHARS)}" for error in result.errors[:MAX_FEEDBACK_ERRORS]]
    return "\n".join([head, "Problems (test output, quoted):", "~~~text", *lines, "~~~"])


def _one_line(text: str, limit: int) -> str:
    """`text` as one line of printable characters (newlines and other controls escaped), at most `limit` long, with
    no character sequence that could close the quote around it."""
    text = printable(text).replace("~~~", "~ ~ ~").replace("```", "` ` `")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _listing(code: str) -> str:
    """`code` as a fenced block it cannot close: the fence is longer than any run of backticks inside."""
    if not code.strip():
        return "(no function found)"
    code = printable(code, keep="\n\t")
    if len(code) > MAX_FEEDBACK_CODE_CHARS:
        code = code[:MAX_FEEDBACK_CODE_CHARS].rstrip() + "\n# ... (cut)"
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall("`+", code)), default=0))
    return f"{fence}python\n{code}\n{fence}"


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
