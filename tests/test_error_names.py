"""Every ``zbuf.<name>`` that an error message of python/zbuf tells the user to call exists
(issue 15, item 3: messages named ``zbuf.list_checkpoints`` and ``zbuf.checkpoint_path`` when
``zbuf`` exported neither).

Error messages are found statically: string literals (f-string parts included) inside ``raise``
statements, inside calls of ``*Error`` / ``*Exception`` / ``*Warning`` classes, ``warn`` and
``print_error``, and anywhere in functions whose name says they build a message
(``*message*``, ``*difference*``, ``_damaged``, ``way_back``).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import zbuf

SOURCES = Path(zbuf.__file__).parent
NAME = re.compile(r"\bzbuf\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
MESSAGE_CALLS = re.compile(r"(Error|Exception|Warning)$|^(warn|print_error)$")
MESSAGE_FUNCTIONS = re.compile(r"message|difference|^_damaged$|^way_back$")


def _strings(node: ast.AST):
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n.value


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _message_strings(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise):
            yield from _strings(node)
        elif isinstance(node, ast.Call) and MESSAGE_CALLS.search(_callee(node)):
            yield from _strings(node)
        elif isinstance(node, ast.FunctionDef) and MESSAGE_FUNCTIONS.search(node.name):
            # Every literal of a function that builds a message is a part of one (its advice may
            # be chosen before the return), its docstring left out.
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            for stmt in body:
                yield from _strings(stmt)


def _mentions() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(SOURCES.rglob("*.py")):
        for text in _message_strings(ast.parse(path.read_text(), str(path))):
            for m in NAME.finditer(text):
                found.setdefault(m.group(1), set()).add(str(path.relative_to(SOURCES.parent)))
    return found


def _resolves(dotted: str) -> bool:
    obj, prefix = zbuf, "zbuf"
    for part in dotted.split("."):
        prefix = f"{prefix}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:  # a submodule not imported by its package
            obj = importlib.import_module(prefix)
        except ImportError:
            return False
    return True


MENTIONS = _mentions()


def test_messages_were_found():
    # The scan sees the messages it is meant to check (guards the heuristics above).
    for name in ("shard", "save_checkpoint", "list_checkpoints", "faults.configure_timeout"):
        assert name in MENTIONS, sorted(MENTIONS)


@pytest.mark.parametrize("name", sorted(MENTIONS))
def test_every_named_function_exists(name):
    assert _resolves(name), f"zbuf.{name} is named in an error message of {sorted(MENTIONS[name])} but does not exist"
