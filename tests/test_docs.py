"""The README and the docs/ pages stay honest.

- Every relative link points to a file that exists, and to a heading that exists where it names one (catches a
  page or file renamed or moved, and a section retitled under a link).
- Every ```python block compiles (catches a snippet that could never run, e.g. a `...` after keywords).
- Its import statements run (catches a class renamed, moved or removed from comlrl_trl).
- Its calls to classes and functions imported from comlrl_trl bind to their real signatures, and a config's
  keywords are fields of the config (catches an argument or field renamed or removed, a misspelt keyword). Calls
  on a name bound to such a class (`trainer = MAGRPOTrainer(...)` or `trainer: MAGRPOTrainer`) are checked
  against the class's methods too (catches `trainer.train(...)` keywords that `train` does not take).

A block that cannot be checked is marked on the line before it with `<!-- doc-test: skip (the reason) -->`; the
reason is required.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
HISTORY = ROOT / "benchmarks" / "HISTORY.md"  # the benchmarks' lab notebook, linked from docs/benchmarks.md

FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SKIP_MARK = re.compile(r"^\s*<!--\s*doc-test:\s*skip\b(.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # 1-based line of the block's first code line
    skip_reason: str | None  # None: not marked; "": marked without a reason


def parse(text: str) -> tuple[list[str], list[Block]]:
    """The lines outside fenced code blocks (code blocks blanked, so line numbers hold) and the fenced blocks."""
    lines = text.splitlines()
    prose, blocks = [], []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            prose.append(lines[i])
            i += 1
            continue
        indent, fence, language = match.groups()
        previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
        mark = SKIP_MARK.match(previous)
        start = i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[start:i]]
        blocks.append(
            Block(language, "\n".join(body) + "\n", start + 1, mark.group(1).strip(" ():") if mark else None)
        )
        prose.extend([""] * (i - start + 2))
        i += 1
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lower case, punctuation other than `-` and `_` removed."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in parse(page.read_text())[0]:
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def link_problems(page: Path) -> list[str]:
    """Every relative link of the page (outside code) must name an existing file, and an existing heading of a
    Markdown page where it names an anchor."""
    problems = []
    shown = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    for number, line in enumerate(parse(page.read_text())[0], start=1):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # https:, mailto:, ...: not checked offline
            path_part, _, anchor = target.partition("#")
            path = page if not path_part else (page.parent / path_part).resolve()
            where = f"{shown}:{number}"
            if not path.exists():
                problems.append(f"{where}: link to {target!r}: {path_part} does not exist")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                problems.append(f"{where}: link to {target!r}: {path.name} has no heading with anchor #{anchor}")
    return problems


def mro_problem(cls: type, attr: str, positional: list, keywords: list[str]) -> str | None:
    """Why `cls.attr(*positional, **keywords)` does not bind (`attr` "__init__" for `cls(...)`), or None. A method
    that takes `**kwargs` hands the keywords it does not name on to the same method of the next class in the MRO
    (`super().__init__(*args, **kwargs)`), as the library's trainers do; a keyword that no class names is an error
    (transformers' `Trainer.train(**kwargs)` refuses it only when it runs)."""
    for klass in cls.__mro__:
        if attr not in vars(klass):
            continue
        raw = vars(klass)[attr]
        function = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
        implicit = [] if isinstance(raw, staticmethod) else [None]  # self or cls
        if not callable(function):
            return None
        try:
            signature = inspect.signature(function)
        except ValueError:  # a builtin without a signature
            return None
        explicit = list(signature.parameters.values())[len(implicit) :]
        if explicit and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in explicit):
            continue  # only *args, **kwargs: everything goes on to the next class
        try:
            bound = signature.bind_partial(*implicit, *positional, **dict.fromkeys(keywords))
        except TypeError as error:
            via = "" if klass is cls else f" (handed on to {klass.__name__}.{attr})"
            return f"{cls.__name__}.{attr}{via}{signature}: {error}"
        rest = next((bound.arguments.get(p.name) for p in explicit if p.kind is p.VAR_KEYWORD), None)
        if not rest:
            return None
        keywords, positional = list(rest), []
    return f"{cls.__name__}.{attr}: no class in its MRO takes {', '.join(map(repr, keywords))}"


@dataclass(frozen=True)
class Instance:
    cls: type


def resolve(node: ast.expr, names: dict[str, object]) -> object | None:
    """What a call's function is, when it is a comlrl_trl name imported in the block, an attribute of one, or a
    method of a name bound to a comlrl_trl class. None when it cannot be known without running the block."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = resolve(node.value, names)
        if owner is None:
            return None
        if isinstance(owner, Instance):
            return (owner.cls, node.attr)
        if isinstance(owner, tuple):
            return None  # an attribute of a method's result: unknown
        if not hasattr(owner, node.attr):
            return ("missing", owner, node.attr)
        return getattr(owner, node.attr)
    return None


def call_problem(call: ast.Call, target: object) -> str | None:
    """Why the call's arguments do not fit the target's signature, or None."""
    keywords = [k.arg for k in call.keywords if k.arg is not None]
    starred = any(isinstance(a, ast.Starred) for a in call.args)
    positional = [] if starred else [0] * len(call.args)
    if isinstance(target, tuple) and target[0] == "missing":
        return f"{getattr(target[1], '__name__', target[1])} has no attribute {target[2]!r}"
    if isinstance(target, tuple):  # a method called on an instance
        cls, name = target
        if not hasattr(cls, name):
            return f"{cls.__name__} has no attribute {name!r}"
        return mro_problem(cls, name, positional, keywords)
    if inspect.isclass(target):
        if dataclasses.is_dataclass(target):
            fields = {f.name for f in dataclasses.fields(target) if f.init}
            unknown = [k for k in keywords if k not in fields]
            if unknown:
                return f"{target.__name__} has no field {', '.join(map(repr, unknown))}"
        return mro_problem(target, "__init__", positional, keywords)
    if callable(target):
        signature = inspect.signature(target)
        try:
            signature.bind_partial(*positional, **dict.fromkeys(keywords))
        except TypeError as error:
            return f"{getattr(target, '__qualname__', target)}{signature}: {error}"
    return None


def python_problems(page: Path) -> list[str]:
    """Every python block compiles, its imports run, and its calls into comlrl_trl fit the real signatures."""
    problems = []
    shown = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    for block in parse(page.read_text())[1]:
        if block.language != "python":
            continue
        where = f"{shown}:{block.line}"
        if block.skip_reason is not None:
            if not block.skip_reason:
                problems.append(f"{where}: a doc-test skip mark must say why the block cannot be checked")
            continue
        try:
            tree = ast.parse(block.code, filename=where)
        except SyntaxError as error:
            problems.append(f"{where}: does not compile: {error.msg} (block line {error.lineno})")
            continue
        names: dict[str, object] = {}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            namespace: dict[str, object] = {}
            try:
                exec(compile(ast.Module([node], []), where, "exec"), namespace)
            except ImportError as error:
                problems.append(f"{where}: line {node.lineno}: {error}")
                continue
            module = node.module if isinstance(node, ast.ImportFrom) else None
            for alias in node.names:
                if (module or alias.name).split(".")[0] == "comlrl_trl":
                    bound = alias.asname or alias.name.split(".")[0]
                    names[bound] = namespace[bound]
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value = node.value.func if isinstance(node.value, ast.Call) else None
                cls = resolve(value, names) if value is not None else None
                if inspect.isclass(cls):
                    names[node.targets[0].id] = Instance(cls)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                cls = resolve(node.annotation, names)
                if inspect.isclass(cls):
                    names[node.target.id] = Instance(cls)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                target = resolve(node.func, names)
                problem = call_problem(node, target) if target is not None else None
                if problem:
                    problems.append(f"{where}: line {node.lineno}: {problem}")
    return problems


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [*PAGES, HISTORY], ids=page_id)
def test_links_resolve(page):
    assert link_problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_blocks_run_against_the_library(page):
    assert python_problems(page) == []


def test_every_page_is_listed_in_the_docs_index():
    """A page nobody links to is a page nobody finds."""
    index = (DOCS / "README.md").read_text()
    listed = {Path(target.partition("#")[0]).name for target in LINK.findall(index)}
    assert sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md" and p.name not in listed) == []


def test_the_readme_stays_short_and_keeps_its_two_commands():
    """The README is the front page (about 250 lines at most); CI and .ci/run rely on its `make test` command."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first = parse(text)[1][0]
    commands = [line.split("#")[0].strip() for line in first.code.splitlines()]
    assert first.language == "bash" and commands == ["make demo", "make test"]


# The checkers themselves: each must report the doc bug it exists for, and stay quiet on correct text.

GOOD_SNIPPET = """\
from comlrl_trl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer

trainer: MAGRPOTrainer
trainer.train(checkpoint_dir="./checkpoints", checkpoint_interval=1)
runner = MAGRPOTrainer(agent_model="m", num_agents=2, args=MAGRPOConfig(num_agents=2, max_new_tokens=8))
runner.save_model("out")
"""


def write_page(tmp_path: Path, body: str, name: str = "page.md") -> Path:
    page = tmp_path / name
    page.write_text(body)
    return page


def test_link_checker_reports_missing_files_and_anchors(tmp_path):
    write_page(tmp_path, "# Other page\n\n## Real section\n", "other.md")
    page = write_page(
        tmp_path,
        "# Title\n\n## Speed (`make bench-vllm`)\n\n## Speed (`make bench-vllm`)\n\n"
        "[ok](other.md#real-section) [ok](#speed-make-bench-vllm) [ok](#speed-make-bench-vllm-1) "
        "[web](https://example.org/missing.md) `[in code](missing.md)`\n\n"
        "```md\n[in a block](missing.md)\n```\n\n"
        "[gone](missing.md)\n[bad anchor](other.md#no-such-section)\n[bad local](#nowhere)\n",
    )
    problems = link_problems(page)
    assert len(problems) == 3, problems
    assert "page.md:13: link to 'missing.md': missing.md does not exist" in problems[0]
    assert "other.md has no heading with anchor #no-such-section" in problems[1]
    assert "page.md has no heading with anchor #nowhere" in problems[2]


def test_python_checker_accepts_a_correct_snippet(tmp_path):
    assert python_problems(write_page(tmp_path, f"```python\n{GOOD_SNIPPET}```\n")) == []


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("x = f(a=1, ...)\n", "does not compile"),
        ("from comlrl_trl.trainers.reinforce import NoSuchTrainer\n", "cannot import name 'NoSuchTrainer'"),
        (
            "from comlrl_trl.trainers.reinforce import MAGRPOConfig\nMAGRPOConfig(num_agnets=2)\n",
            "MAGRPOConfig has no field 'num_agnets'",
        ),
        (
            "from comlrl_trl.trainers.reinforce import MAGRPOTrainer\nMAGRPOTrainer(agent_model='m', critic_model='c')\n",
            "unexpected keyword argument 'critic_model'",
        ),
        (
            "from comlrl_trl.trainers.preference import MADPOTrainer\nMADPOTrainer(agent_model='m', num_agnets=2)\n",
            "unexpected keyword argument 'num_agnets'",
        ),
        (
            "from comlrl_trl.trainers.reinforce import MAGRPOTrainer\nt: MAGRPOTrainer\nt.train(checkpoint_every=1)\n",
            "MAGRPOTrainer.train",
        ),
        (
            "from comlrl_trl.trainers.reinforce import MAGRPOTrainer\nt = MAGRPOTrainer()\nt.fit()\n",
            "MAGRPOTrainer has no attribute 'fit'",
        ),
    ],
    ids=["syntax", "import", "config-field", "trainer-keyword", "passthrough-init", "method-keyword", "method"],
)
def test_python_checker_reports_the_doc_bug(tmp_path, snippet, expected):
    problems = python_problems(write_page(tmp_path, f"# Page\n\n```python\n{snippet}```\n"))
    assert len(problems) == 1 and expected in problems[0] and "page.md:4" in problems[0], problems


def test_skip_marks_need_a_reason(tmp_path):
    broken = "```python\nx = f(a=1, ...)\n```\n"
    assert python_problems(write_page(tmp_path, "<!-- doc-test: skip (pseudo-code) -->\n" + broken)) == []
    problems = python_problems(write_page(tmp_path, "<!-- doc-test: skip -->\n" + broken))
    assert len(problems) == 1 and "must say why" in problems[0]
