"""The package's layers (docs/design.md): data flows one way and no module reaches into another.

Every import of every module under ``siftpipe/`` is parsed (function-level imports included). A
new module must be given a layer here, so the layering is a decision, not an accident.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "siftpipe"

#: Lowest first. A module's layer is its folder (``core/``, ``audit/``, ...); a module at the
#: package's top level is placed by name here, so a new one there is a decision, not an accident.
#: A module may import its own layer and the layers below; ``audit`` and ``streaming`` are peers
#: that do not import each other.
FOLDERS = ("core", "audit", "streaming", "adapters", "demo", "cli", "integrations")
TOP_LEVEL: dict[str, str] = {
    # the shared vocabulary every layer may use: errors, credential redaction, optional extras
    "errors": "base",
    "_secrets": "base",
    "_optional": "base",
    # the public API: the names users import (demo/, integrations/ and cli/ use it like user code)
    "siftpipe": "api",
    # entry points and the documented old import paths (each is the module it names)
    "__main__": "leaves",
    "webdataset": "leaves",
    "nodes": "leaves",
    "shards": "leaves",
    "handlers": "leaves",
    "logtools": "leaves",
}
RANK = {
    "base": 0,
    "core": 1,
    "audit": 2,
    "streaming": 2,
    "adapters": 3,
    "api": 4,
    "demo": 5,
    "integrations": 5,
    "cli": 6,
    "leaves": 7,
}
PEERS_APART = {frozenset({"audit", "streaming"}), frozenset({"demo", "integrations"})}
#: What core/ may import besides the standard library and itself: torch and numpy; fsspec only
#: inside the functions that save, publish and load a ``ScoreMemory`` at a URL.
CORE_THIRD_PARTY = {"torch", "numpy"}
CORE_LAZY_THIRD_PARTY = {"fsspec"}


def layer_of(module: str) -> str | None:
    """The layer of a module named relative to the package (``core.stage``, ``errors``)."""
    head = module.split(".", maxsplit=1)[0]
    if head in FOLDERS:
        return head
    return TOP_LEVEL.get(module)


def _name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "siftpipe"


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """(module -> siftpipe modules it imports, names like ``x._private`` imported from another
    module). Module names are relative to the package (``sifter``, ``integrations.hf``)."""
    modules = {_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    private: list[str] = []
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" and mod != "siftpipe" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "siftpipe" or alias.name.startswith("siftpipe."):
                        deps.add(
                            alias.name.removeprefix("siftpipe.") if alias.name != "siftpipe" else "siftpipe"
                        )
                continue
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".") if package and package != "siftpipe" else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module == "siftpipe" or (node.module or "").startswith("siftpipe."):
                target = node.module.removeprefix("siftpipe").lstrip(".")  # type: ignore[union-attr]
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in modules:
                    deps.add(sub)
                else:
                    deps.add(target or "siftpipe")
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{mod}: from {target or 'siftpipe'} import {alias.name}")
        deps.discard(mod)
        graph[mod] = deps
    return graph, private


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every way ``graph`` breaks the layering: unplaced modules, imports upwards or across
    peers, the package root imported from below the leaves, cycles."""
    where = {m: layer_of(m) for m in graph}
    found = [
        f"{m}: not placed in a layer (put it in a layer's folder, or in TOP_LEVEL in tests/test_layers.py)"
        for m, layer in where.items()
        if layer is None
    ]
    for mod, deps in graph.items():
        for dep in deps:
            a, b = where.get(mod), where.get(dep, layer_of(dep))
            if a is None or b is None:
                continue
            if RANK[b] > RANK[a] or (a != b and frozenset({a, b}) in PEERS_APART):
                found.append(f"{mod} ({a}) imports {dep} ({b})")
    # cycles (the package root imports everything for the public API; edges into it are checked above)
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep == "siftpipe":
                continue
            if state.get(dep) == 1:
                found.append("import cycle: " + " -> ".join([*stack[stack.index(dep) :], dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state and node != "siftpipe":
            visit(node, [])
    return found


def test_the_package_keeps_its_layers_and_has_no_cycle():
    graph, _ = import_graph()
    assert "core.stage" in graph and "core.sink" in graph["core.stage"]  # the parser sees the real imports
    assert layer_violations(graph) == []


def test_core_imports_nothing_outside_core_and_errors():
    # and the credential rules (_secrets, stdlib only): the memory publishes at a URL, and must
    # refuse one with credentials in it as the filters that read it do (since 2026-12-05)
    graph, _ = import_graph()
    core = [m for m in graph if layer_of(m) == "core"]
    assert len(core) > 20
    for mod in core:
        outside = {d for d in graph[mod] if layer_of(d) != "core" and d not in ("errors", "_secrets")}
        assert not outside, f"{mod} imports {sorted(outside)}"


def _third_party(path: Path) -> tuple[set[str], set[str]]:
    """(top-level packages imported at module level, those imported inside functions) by a file,
    the standard library and siftpipe left out."""
    std = set(sys.stdlib_module_names) | {"siftpipe", "__future__"}
    tree = ast.parse(path.read_text(), str(path))
    inside = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
    }
    top: set[str] = set()
    lazy: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            head = name.split(".")[0]
            if head not in std:
                (lazy if id(node) in inside else top).add(head)
    return top, lazy


def test_core_needs_torch_and_numpy_only():
    for path in sorted((ROOT / "core").glob("*.py")):
        top, lazy = _third_party(path)
        assert top <= CORE_THIRD_PARTY, f"{path.name} imports {sorted(top - CORE_THIRD_PARTY)}"
        assert lazy <= CORE_THIRD_PARTY | CORE_LAZY_THIRD_PARTY, f"{path.name} imports {sorted(lazy)}"


def test_only_the_demo_command_imports_the_demo():
    graph, _ = import_graph()
    importers = {m for m, deps in graph.items() if any(layer_of(d) == "demo" for d in deps)}
    assert {m for m in importers if layer_of(m) != "demo"} == {"cli.demo"}


def test_every_module_opens_with_what_it_owns():
    """docs/design.md: every module opens with a line saying what it owns."""
    for path in sorted(ROOT.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(), str(path)))
        assert doc and len(doc.split()) >= 4, f"{path.relative_to(ROOT)} has no docstring saying what it owns"


def test_no_module_imports_another_modules_private_names():
    _, private = import_graph()
    assert private == []


def test_the_checker_catches_what_it_claims_to(tmp_path):
    """A check that says OK must mean it: a planted cycle, an upward import, a peer import, a
    private import and an unplaced module are each reported."""
    pkg = tmp_path / "siftpipe"
    for folder in ("core", "audit", "streaming"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .core.stage import x\n")
    (pkg / "errors.py").write_text("")
    (pkg / "core" / "stage.py").write_text("from ..audit.log import y\nx = 1\n")
    (pkg / "audit" / "log.py").write_text(
        "from ..core import stage\nfrom ..streaming.opener import _hidden\ny = 2\n"
    )
    (pkg / "streaming" / "opener.py").write_text("_hidden = 3\n")
    (pkg / "newthing.py").write_text("import siftpipe.errors\n")
    graph, private = import_graph(pkg)
    found = "\n".join(layer_violations(graph))
    assert "core.stage (core) imports audit.log (audit)" in found
    assert "audit.log (audit) imports streaming.opener (streaming)" in found
    assert "import cycle: audit.log -> core.stage -> audit.log" in found
    assert "newthing: not placed" in found
    assert private == ["audit.log: from streaming.opener import _hidden"]
    assert graph["newthing"] == {"errors"}


def test_the_old_import_paths_are_the_moved_modules():
    """Code written before the layering keeps importing the modules from where they were."""
    import importlib

    import siftpipe

    moved = {
        "webdataset": "adapters.webdataset",
        "nodes": "adapters.nodes",
        "shards": "streaming.shards",
        "handlers": "streaming.handlers",
        "logtools": "audit.summary",
        **siftpipe._MOVED,
    }
    for old, new in moved.items():
        assert importlib.import_module(f"siftpipe.{old}") is importlib.import_module(f"siftpipe.{new}"), old
    from siftpipe.policies import Policy

    from siftpipe.webdataset import WebDataset

    assert Policy is siftpipe.Policy and WebDataset.__module__ == "siftpipe.adapters.webdataset"
    assert siftpipe.policies is siftpipe.core.policies and callable(siftpipe.recipe)
