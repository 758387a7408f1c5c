"""The package's shape, checked from its source with ``ast`` (nothing is imported):

* the import graph of ``python/zbuf`` has no cycle (module-level and function-level imports both
  count: an import inside a function that closes a cycle hides it, it does not remove it), other
  than through a package ``__init__``'s re-exports;
* the pool's budget is set only by the memory package (``zbuf/memory/``: [Note: one writer of
  the pool's budget] in pool_budget.py);
* comments and docstrings say what and why, and leave history (which commit did what) to commit
  messages and ``benches/results/``: no commit hash in them;
* no module keeps mutable state at module level (dicts, lists, sets, counters assigned at module
  level, ``global`` statements) unless it is named in ``MUTABLE_GLOBALS`` with the reason it
  must stay.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
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


def _cycles(edges, nodes=None) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan); the nodes: every module
    unless given."""
    graph: dict[str, list[str]] = {m: [] for m in (MODULES if nodes is None else nodes)}
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


def test_import_graph_has_no_cycle():
    edges = import_edges()
    # A package __init__ that re-exports its children imports them; a child that imports a
    # sibling through the package face is no cycle of modules. Drop the faces' own arrows.
    kept = {e: w for e, w in edges.items() if not _is_package(e[0])}
    problems = []
    for comp in _cycles(kept):
        inside = sorted(f"{a} -> {b} ({w}-level)" for (a, b), w in kept.items()
                        if a in comp and b in comp)
        problems.append(f"cycle {comp}:\n    " + "\n    ".join(inside))
    assert not problems, "import cycles in python/zbuf:\n" + "\n".join(problems)


def _package_of(module: str) -> str:
    """``zbuf.compile.budget`` -> ``zbuf.compile``; a module at the root is its own room."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def test_packages_import_one_way():
    """Arrows between packages (and the root's modules) run one way, deferred imports included:
    a function-level import is still an arrow (at b734542 ``zbuf.compile`` and
    ``zbuf.memory.step``, ``zbuf.compile`` and ``zbuf.block_prefetch`` imported each other, the
    way back through imports inside functions)."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for (a, b), where in import_edges().items():
        pa, pb = _package_of(a), _package_of(b)
        if pa != pb and not _is_package(a):
            arrows.setdefault((pa, pb), []).append(f"{a} -> {b} ({where}-level)")
    problems = []
    for comp in _cycles(arrows, nodes={p for e in arrows for p in e}):
        inside = sorted(x for (a, b), xs in arrows.items() if a in comp and b in comp for x in xs)
        problems.append(f"cycle {comp}:\n    " + "\n    ".join(inside))
    assert not problems, "package-level import cycles in python/zbuf:\n" + "\n".join(problems)


def test_the_walk_sees_function_level_imports():
    # the walk itself: regather's re-gather once hid a cycle with an import inside a function
    edges = import_edges()
    assert edges[("zbuf.shard", "zbuf.param_access")] == "module"
    assert "function" in edges.values()


# ---------------------------------------------------------------------------------------------
# module-level mutable state

_MUTABLE_CALLS = {
    "dict", "list", "set", "bytearray", "Counter", "defaultdict", "OrderedDict", "deque",
    "count", "Lock", "RLock", "local", "WeakValueDictionary", "WeakKeyDictionary", "WeakSet",
}


def _mutable_value(value) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        return name in _MUTABLE_CALLS
    return False


def _module_statements(body):
    """Statements that run at import: the body, and inside module-level if/try/with blocks."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody"):
                yield from _module_statements(getattr(stmt, part, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _module_statements(handler.body)


def mutable_globals() -> set[str]:
    """``module.name`` of every module-level name bound to a mutable object, or rebound by a
    ``global`` statement."""
    found = set()
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for stmt in _module_statements(tree.body):
            if isinstance(stmt, ast.Assign) and _mutable_value(stmt.value):
                targets = stmt.targets
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None and _mutable_value(stmt.value):
                targets = [stmt.target]
            else:
                continue
            for target in targets:
                for node in ast.walk(target):
                    if isinstance(node, ast.Name) and node.id != "__all__":  # the export list
                        found.add(f"{module}.{node.id}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.update(f"{module}.{name}" for name in node.names)
    return found


_CONSTANT = "constant: built at import, never mutated"

MUTABLE_GLOBALS = {
    # constant tables
    "zbuf._NAMES": _CONSTANT,
    "zbuf.checkpoint.layout._DTYPES": _CONSTANT,
    "zbuf.cli._ENGINES": _CONSTANT,
    "zbuf.presets.PRESETS": _CONSTANT,
    "zbuf.memory.optimizer_state.STATE_COPIES": _CONSTANT,
    "zbuf.train.compile_phases.PHASE_LABELS": _CONSTANT,
    "zbuf.train.compile_phases.ZBUF_KEYS": _CONSTANT,
    "zbuf.train.compile_phases._CACHE_COUNTERS": _CONSTANT,
    "zbuf.train.options._UNITS": _CONSTANT,
    "zbuf.cli._GROUPS": _CONSTANT,
    "zbuf.train.loop._PER_RANK": _CONSTANT,
    "zbuf.train.record._MERGE_FREE": _CONSTANT,
    "zbuf.train.resources.RUNTIME_BYTES": _CONSTANT,
    "zbuf.train.config.CLI_SPELLING": _CONSTANT,
    "zbuf.train.config._AC_OF_RECOMPUTE": _CONSTANT,
    # process-wide by nature
    "zbuf.param_access._SUBCLASS_CACHE": "classes are process-wide: one ZbufLinear per (class, "
        "sharded names) for every model, holding no model's state",
    "zbuf.frame_inputs.GATHERED_FOR_SHARDS": "a trace-time stack: only Dynamo's tracing of a "
        "block frame pushes and pops it, so it is empty whenever nothing is traced",
    "zbuf.shard._param_ids": "parameter ids name parameters in op arguments and must be unique "
        "across every model of the process",
    "zbuf.pool._default_pools": "the public zbuf.default_pool(device): one per device per "
        "process, as torch's caching allocator; engines and zbuf bench make their own pools",
    "zbuf.pool._default_lock": "guards _default_pools",
    "zbuf.runtime._POOLS": "weak: ops name pools by int ([Note: pool ids]); an entry dies with "
        "its pool",
    "zbuf.runtime._pool_ids": "pool ids are unique in the process, never reused ([Note: pool ids])",
    "zbuf.runtime._COUNTS": "weak: ops name parameters by int ([Note: counts live with their "
        "model]); parameter id -> its root's counter, an entry dies with that counter",
    "zbuf.runtime._BACKWARD_STEPS": "weak: ops name parameters by int ([Note: optimizer in "
        "backward]); parameter id -> the BackwardStep of its compiled model, an entry dies with it",
    "zbuf.compile.report._OWNERS": "parameter id -> the model's records ([Note: records live "
        "with their model]): a cache-hit graph's check names only ids; weak (an entry dies with "
        "its parameter)",
    "zbuf.compile.report._GRAPH_IDS": "graph ids are unique in the process, as parameter ids",
}


def test_no_module_level_mutable_state():
    found = mutable_globals()
    new = sorted(found - set(MUTABLE_GLOBALS))
    assert not new, (
        f"module-level mutable state in python/zbuf: {new}. Keep state on the object it serves "
        f"(the sharded root, the pool, the compiled model); a constant table never mutated after "
        f"import, or state that must be process-wide, goes into MUTABLE_GLOBALS with its reason"
    )
    gone = sorted(set(MUTABLE_GLOBALS) - found)
    assert not gone, f"MUTABLE_GLOBALS names what no longer exists, delete: {gone}"


# ---------------------------------------------------------------------------------------------
# one writer of the pool's budget

BUDGET_WRITER = "zbuf.memory"
"""The package whose modules alone may set a pool's budget."""
POOL = "zbuf.pool"
"""The pool itself: its ``set_budget`` and ``set_floor`` hand the call to the Rust pool."""
BUDGET_SETTERS = ("set_budget", "set_floor")
"""The pool's methods that move its budget or what its pressure policy may shrink it to."""


def budget_setters(source: str, path: str = "<source>") -> list[int]:
    """Lines of ``source`` that call one of ``BUDGET_SETTERS`` (any receiver: a pool is reached
    through attributes, registries and arguments, so the method's name is what can be
    checked)."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source, path))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in BUDGET_SETTERS)


def test_only_the_memory_package_sets_the_pools_budget():
    """[Note: one writer of the pool's budget]: at b734542 seven calls in six files outside any
    memory package set it (step_memory twice, kept_weights, compile/collectives, block_frames,
    block_replan, train/engines)."""
    outside = [f"{module} line {line}" for module, path in MODULES.items()
               if module != POOL and module != BUDGET_WRITER
               and not module.startswith(BUDGET_WRITER + ".")
               for line in budget_setters(path.read_text(), str(path))]
    assert not outside, (
        "the pool's budget is set outside zbuf/memory/ (ask zbuf.memory.pool_budget, which "
        "says why the budget moves): " + ", ".join(outside))


def test_the_budget_check_sees_a_setter():
    # the check itself: a call through any receiver counts, a mention or a definition does not
    assert budget_setters("frames.pool.set_budget(n)\nx = pool.set_budget\n") == [1]
    assert budget_setters("x = 1\npool.set_floor(n)\n") == [2]
    assert budget_setters("def set_budget(self, n):\n    return n\n") == []


# ---------------------------------------------------------------------------------------------
# history stays out of the code

COMMIT_HASH = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?![0-9A-Za-z_])")
"""An abbreviated commit hash: 7-12 lowercase hex digits, at least one letter and one digit."""
NOT_COMMITS = {"13494faf321"}
"""Hex words that are no commit: a fingerprint shown as an example (train/progress.py)."""


def commit_hashes(source: str) -> list[tuple[int, str]]:
    """(line, hash) of every commit-like hash in ``source``'s comments and strings."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            for m in COMMIT_HASH.finditer(tok.string):
                if m.group(0) not in NOT_COMMITS:
                    found.append((tok.start[0] + tok.string.count("\n", 0, m.start()), m.group(0)))
    return found


def test_no_commit_hashes_in_comments_or_docstrings():
    found = [f"{module} line {line}: {h}" for module, path in MODULES.items()
             for line, h in commit_hashes(path.read_text())]
    assert not found, (
        "history in the code (say why, not when; the measurement and its commit belong in "
        "benches/results/ and the commit message): " + ", ".join(found))


def test_the_hash_check_sees_a_hash():
    assert commit_hashes('x = 1  # as zbuf did up to 4fed11d\n') == [(1, "4fed11d")]
    assert commit_hashes('"""a\nmeasured at b734542"""\n') == [(2, "b734542")]
    assert commit_hashes("y = 0xdeadbeef1  # 1234567 deadbee\n") == []
