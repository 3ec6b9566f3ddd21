"""docs/reliability.md names the test behind each row: every test it names exists."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_test_the_reliability_table_names_exists():
    text = (ROOT / "docs" / "reliability.md").read_text()
    named: list[tuple[str, str]] = []
    for match in re.finditer(r"`(tests/[\w/]+\.py)((?:::\w+)?)`((?:, `::\w+`)*)", text):
        path = match[1]
        names = [n for n in [match[2].lstrip(":"), *re.findall(r"`::(\w+)`", match[3])] if n]
        named.extend((path, n) for n in names)
    for match in re.finditer(r"`(tests/[\w/]+\.py)` \(([^)]*)\)", text):  # `file` (`test_a_*`, ...)
        named.extend((match[1], n.rstrip("*")) for n in re.findall(r"`(\w+\*?)`", match[2]))
    assert len(named) > 40
    for path, name in named:
        tree = ast.parse((ROOT / path).read_text())
        functions = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        assert any(f == name or (name.endswith("_") and f.startswith(name)) for f in functions), (path, name)
