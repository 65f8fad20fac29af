"""docs/development.md's drawing of the layout matches the tree (issue 57).

The drawing is the first ```text block of its "Layout" section: one entry a line, two spaces of indent per level,
a name (`name/` for a directory) and its job; wider-indented lines continue the job above them.
"""

from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "comlrl_trl"


def drawn_paths(text: str) -> set[str]:
    """The paths the drawing names, relative to the repository (`comlrl_trl/tasks/sandbox/`, `comlrl_trl/x.py`)."""
    section = text[text.index("## Layout") :]
    block = section[section.index("```text\n") + len("```text\n") :]
    block = block[: block.index("```")]
    paths, stack = set(), []
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if indent % 2 or indent // 2 > len(stack):
            continue  # a continuation of the job above
        name = line.split()[0]
        stack[indent // 2 :] = [name]
        paths.add("".join(stack))
    return paths


def test_drawing_parser_reads_levels_and_skips_continuations():
    text = (
        "## Layout\n\n```text\npkg/\n  a/     job\n    b/   job\n                 more\n  c.py   job\ntop/  job\n```\n"
    )
    assert drawn_paths(text) == {"pkg/", "pkg/a/", "pkg/a/b/", "pkg/c.py", "top/"}


def test_the_layout_drawing_matches_the_tree():
    drawn = drawn_paths((ROOT / "docs" / "development.md").read_text())
    packages = {f"comlrl_trl/{p.parent.relative_to(PACKAGE)}/" for p in PACKAGE.glob("*/__init__.py")}
    modules = {f"comlrl_trl/{p.name}" for p in PACKAGE.glob("*.py")}
    missing = sorted((packages | modules) - drawn)
    assert missing == [], f"not drawn in docs/development.md's Layout: {missing}"
    absent = sorted(path for path in drawn if not (ROOT / path).exists())
    assert absent == [], f"drawn in docs/development.md's Layout but not in the tree: {absent}"
    for top in ("recipes/", "tests/", "benchmarks/", "examples/", "scripts/"):
        assert top in drawn
