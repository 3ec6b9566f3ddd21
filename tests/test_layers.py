"""The package's layers (docs/design.md): data flows one way and no module reaches into another.

Every import of every module under ``siftpipe/`` is parsed (function-level imports included). A
new module must be given a layer here, so the layering is a decision, not an accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "siftpipe"

#: Lowest first. A module may import its own layer and the layers below; ``audit`` and
#: ``streaming`` are peers that do not import each other.
LAYERS: dict[str, set[str]] = {
    # the shared vocabulary: errors, the sink interface, codes, small helpers; torch/numpy at most
    "base": {
        "errors",
        "sink",
        "_vocab",
        "_registry",
        "_batch",
        "_optional",
        "_secrets",
        "_ranks",
        "_shardcounts",
        "_cliopts",
    },
    # the stage and what it decides with; knows no log, no shard format, no framework
    "core": {
        "history",
        "memory",
        "policies",
        "scorers",
        "_decide",
        "_state",
        "_scoring",
        "_ledger",
        "_account",
        "_rows",
        "_resume",
        "_source",
        "_decider",
        "_passes",
        "_settings",
        "_stats",
        "sifter",
        "recipe",
    },
    # the audit log (a sink), its wire format, reading, replay
    "audit": {"_audit_io", "audit", "reader", "replay"},
    # opening and reading shards; writing them
    "streaming": {"_open", "shards", "handlers"},
    # the stage inside webdataset, torchdata, DataLoader workers and ranks
    "adapters": {"webdataset", "nodes", "predecode", "distributed"},
    # entry points: use the public API; nothing in the library imports them
    "leaves": {
        "siftpipe",
        "__main__",
        "cli",
        "logtools",
        "demo",
        "integrations",
        "integrations._common",
        "integrations.hf",
        "integrations.lightning",
    },
}
RANK = {"base": 0, "core": 1, "audit": 2, "streaming": 2, "adapters": 3, "leaves": 4}
PEERS_APART = {frozenset({"audit", "streaming"})}


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


def layer_violations(graph: dict[str, set[str]], layers: dict[str, set[str]] = LAYERS) -> list[str]:
    """Every way ``graph`` breaks the layering: unplaced modules, imports upwards or across
    peers, the package root imported from below the leaves, cycles."""
    where = {m: layer for layer, mods in layers.items() for m in mods}
    found = [
        f"{m}: not placed in a layer (add it to LAYERS in tests/test_layers.py)"
        for m in graph
        if m not in where
    ]
    for mod, deps in graph.items():
        for dep in deps:
            if mod not in where or dep not in where:
                continue
            a, b = where[mod], where[dep]
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
    assert "sifter" in graph and "sink" in graph["sifter"]  # the parser sees the real imports
    assert layer_violations(graph) == []


def test_core_imports_nothing_above_it():
    graph, _ = import_graph()
    for mod in LAYERS["core"] | LAYERS["base"]:
        above = {d for d in graph[mod] if d not in LAYERS["core"] | LAYERS["base"]}
        assert not above, f"{mod} imports {sorted(above)}"


def test_no_module_imports_another_modules_private_names():
    _, private = import_graph()
    assert private == []


def test_the_checker_catches_what_it_claims_to(tmp_path):
    """A check that says OK must mean it: a planted cycle, an upward import, a peer import, a
    private import and an unplaced module are each reported."""
    pkg = tmp_path / "siftpipe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .sifter import x\n")
    (pkg / "errors.py").write_text("")
    (pkg / "sifter.py").write_text("from .audit import y\nx = 1\n")
    (pkg / "audit.py").write_text("from . import sifter\nfrom ._open import _hidden\ny = 2\n")
    (pkg / "_open.py").write_text("_hidden = 3\n")
    (pkg / "newthing.py").write_text("import siftpipe.errors\n")
    graph, private = import_graph(pkg)
    found = "\n".join(layer_violations(graph))
    assert "sifter (core) imports audit (audit)" in found
    assert "audit (audit) imports _open (streaming)" in found
    assert "import cycle: audit -> sifter -> audit" in found
    assert "newthing: not placed" in found
    assert private == ["audit: from _open import _hidden"]
    assert graph["newthing"] == {"errors"}
