"""docs/reliability.md cannot rot silently: every test file and test function it names exists,
every item of issue 11 has a row naming its tests, and the figures it quotes are categories that
tests really count (tests/tally.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "reliability.md"

#: `tests/x.py`, `tests/x.py::test_name`, `tests/x.py::TestClass::test_name`, `tests/x.py::test_prefix_*`
_REFERENCE = re.compile(r"(?P<file>tests/[\w/]+\.py)(?:::(?P<name>\w+(?:::\w+)*\*?))?")
#: a test named without its file (`::test_name`, `test_name`, `test_prefix_*`): the file is the
#: last one named before it in the same table row or paragraph
_BARE = re.compile(r"(?:::)?(?P<name>test_\w*\*?)")


def blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each table row and each paragraph of ``text``; fenced code
    blocks (commands and their output) are left out."""
    out: list[tuple[int, str]] = []
    start, lines = 0, []
    fenced = False
    for number, line in enumerate([*text.splitlines(), ""], 1):
        if line.startswith("```"):
            fenced = not fenced
            line = ""  # a fence ends the paragraph before it
        elif fenced:
            continue
        if line.startswith("|") or not line.strip():
            if lines:
                out.append((start, " ".join(lines)))
                lines = []
            if line.startswith("|"):
                out.append((number, line))
        else:
            if not lines:
                start = number
            lines.append(line)
    return out


def named_tests(text: str) -> tuple[list[tuple[int, str, str | None]], list[str]]:
    """Every test reference in ``text`` as (line, file, name or None), and the references that
    cannot be resolved (a bare name with no file before it, a malformed path)."""
    named: list[tuple[int, str, str | None]] = []
    problems: list[str] = []
    for line, block in blocks(text):
        current: str | None = None
        for span in re.findall(r"`([^`\n]+)`", block):
            if "tests/" in span:
                m = _REFERENCE.fullmatch(span)
                if m is None:
                    problems.append(f"line {line}: `{span}` is not tests/<file>.py[::<test>]")
                    continue
                current = m["file"]
                named.append((line, current, m["name"]))
            elif (m := _BARE.fullmatch(span)) is not None:
                if current is None:
                    problems.append(f"line {line}: `{span}` names a test but no file before it")
                else:
                    named.append((line, current, m["name"]))
    return named, problems


def collected_names(path: Path) -> set[str]:
    """The names pytest collects from a test file: module-level ``test*`` functions and
    assignments (a hypothesis state machine's ``TestCase``), and ``Class::test*`` methods of
    ``Test*`` classes."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("test"))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names.update(
                f"{node.name}::{item.name}"
                for item in node.body
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test")
            )
    return names


def missing(named: list[tuple[int, str, str | None]], root: Path = ROOT) -> list[str]:
    """The references of ``named`` whose file or test does not exist under ``root``."""
    out = []
    for line, file, name in named:
        path = root / file
        if not path.is_file():
            out.append(f"line {line}: {file} does not exist")
            continue
        if name is None:
            continue
        names = collected_names(path)
        found = any(n.startswith(name[:-1]) for n in names) if name.endswith("*") else name in names
        if not found:
            out.append(f"line {line}: {file} has no test {name}")
    return out


def test_every_test_file_and_function_the_doc_names_exists():
    named, problems = named_tests(DOC.read_text())
    assert problems == []
    assert missing(named) == []
    assert len({(f, n) for _, f, n in named if n}) > 80
    assert len({f for _, f, _ in named}) > 25


def test_the_checker_finds_what_would_rot():
    doc = "\n".join(
        [
            "| fault | `tests/test_tally.py::test_tried_adds_up_by_category`, `::test_gone` |",
            "| other | `tests/test_nowhere.py` |",
            "| prefix | `tests/test_tally.py` (`test_counts_made_*`, `test_no_such_*`) |",
            "| bare | `test_tried_adds_up_by_category` |",
            "| odd | `tests/test_tally.py::test_tried_adds_up_by_category[1]` |",
            "",
            "A paragraph naming `tests/core/test_adversarial_resume.py` and, on its next line,",
            "`::test_checkpoint_restore_and_passes_at_random_equal_the_uninterrupted_run` (a state machine).",
            "```text",
            "python -m pytest tests/test_tally.py tests/test_*.py  # a command, not a reference",
            "```",
        ]
    )
    named, problems = named_tests(doc)
    assert problems == [
        "line 4: `test_tried_adds_up_by_category` names a test but no file before it",
        "line 5: `tests/test_tally.py::test_tried_adds_up_by_category[1]` is not tests/<file>.py[::<test>]",
    ]
    assert missing(named) == [
        "line 1: tests/test_tally.py has no test test_gone",
        "line 2: tests/test_nowhere.py does not exist",
        "line 3: tests/test_tally.py has no test test_no_such_*",
    ]
    assert (7, "tests/core/test_adversarial_resume.py", None) in named
    assert len(named) == 8


def issue_rows(text: str) -> dict[int, list[str]]:
    """Issue item number -> the rows of the doc's issue table that cover it (its first column)."""
    section = text.split("## Issue 11", 1)[1].split("\n## ", 1)[0]
    rows: dict[int, list[str]] = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if row.startswith("|") and re.fullmatch(r"\d+(?:, \d+)*", cells[0]):
            for item in cells[0].split(", "):
                rows.setdefault(int(item), []).append(row)
    return rows


def test_every_item_of_issue_11_has_a_row_naming_its_tests():
    rows = issue_rows(DOC.read_text())
    assert sorted(rows) == list(range(1, 20))
    for item, covering in rows.items():
        for row in covering:
            named, problems = named_tests(row)
            assert problems == [] and any(name for _, _, name in named), (item, row)


def counted_categories() -> set[str]:
    """The categories that tests pass to ``tally.tried`` (the tally's own tests count made-up ones)."""
    found: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        if path.name == "test_tally.py":
            continue
        found.update(re.findall(r"\btried\(\s*\"([^\"]+)\"", path.read_text()))
    return found


def test_the_figures_quoted_are_categories_tests_count():
    text = DOC.read_text()
    block = text.split("adversarial suite: what was tried", 1)[1].split("```", 1)[0]
    figures = dict(re.findall(r"^(.+): (\d+)$", block, flags=re.MULTILINE))
    assert {"kills survived", "outages survived", "records lost"} <= set(figures)
    assert set(figures) <= counted_categories()
    assert figures["records lost"] == "0"
