"""The package's shape, checked from its source with ``ast`` (nothing is imported):

* the import graph of ``python/zbuf`` has no cycle (module-level and function-level imports both
  count: an import inside a function that closes a cycle hides it, it does not remove it), other
  than through a package ``__init__``'s re-exports.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "zbuf"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never run)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name in ("TYPE_CHECKING", "_TYPE_CHECKING"):
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _resolve(module: str, node) -> list[str]:
    """The package modules one import statement of ``module`` loads (only zbuf's own)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    if node.level:
        base = module.split(".") if _is_package(module) else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target not in MODULES:
        return []
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in MODULES else target)
    return sorted(set(out))


def import_edges() -> dict[tuple[str, str], str]:
    """(importer, imported) -> "module" or "function" (where the first such import sits)."""
    edges: dict[tuple[str, str], str] = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in skip:
                continue
            # a module-level statement, or inside a module-level try/if: runs at import
            where = "module" if id(node) in top or not _inside_def(tree, node) else "function"
            for target in _resolve(module, node):
                if target != module:
                    key = (module, target)
                    if edges.get(key) != "module":
                        edges[key] = where
    return edges


def _inside_def(tree: ast.Module, target) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if any(n is target for n in ast.walk(node)):
                return True
    return False


def _cycles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, list[str]] = {m: [] for m in MODULES}
    for a, b in edges:
        graph[a].append(b)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


# Cycles another branch removes; the lead deletes each entry when that branch merges.
PENDING_CYCLES = {
    # pending on branch sim (ec6bbac: ConfigError moves to train/errors.py)
    frozenset({"zbuf.train.config", "zbuf.train.hf"}): "pending on branch sim",
}


def test_import_graph_has_no_cycle():
    edges = import_edges()
    # A package __init__ that re-exports its children imports them; a child that imports a
    # sibling through the package face is no cycle of modules. Drop the faces' own arrows.
    kept = {e: w for e, w in edges.items() if not _is_package(e[0])}
    problems = []
    for comp in _cycles(kept):
        if frozenset(comp) in PENDING_CYCLES:
            continue
        inside = sorted(f"{a} -> {b} ({w}-level)" for (a, b), w in kept.items()
                        if a in comp and b in comp)
        problems.append(f"cycle {comp}:\n    " + "\n    ".join(inside))
    assert not problems, "import cycles in python/zbuf:\n" + "\n".join(problems)


def test_the_walk_sees_function_level_imports():
    # the walk itself: regather's re-gather once hid a cycle with an import inside a function
    edges = import_edges()
    assert edges[("zbuf.shard", "zbuf.param_access")] == "module"
    assert "function" in edges.values()

