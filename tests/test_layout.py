"""docs/layout.md is the tree's own account of itself: one row per source file of ``rust/`` and
``python/zbuf/``, its text the first sentence of the file's module doc, so a file added, moved or
removed without the table following fails here. Regenerate with
``python tests/test_layout.py > docs/layout.md``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = ROOT / "docs" / "layout.md"
SOURCES = (("rust", "*.rs"), ("python/zbuf", "*.py"))
FOLDERS = (
    ("benches/", "benchmarks, and their committed results in `benches/results/` (measurement "
                 "history included)"),
    ("tests/", "pytest: one file per concern, distributed on CPU, `tests/gpu/` marked `cuda`"),
    ("docs/", "the reference the README leaves out: the command (`cli.md`), the Python API "
              "(`python-api.md`), tests and benchmarks (`testing.md`), this layout"),
)
_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.(?=\s|$)")


def _first_sentence(text: str) -> str:
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    end = _SENTENCE_END.search(paragraph)
    return paragraph[:end.start() + 1] if end else paragraph


def _doc(path: Path) -> str:
    source = path.read_text()
    if path.suffix == ".py":
        return ast.get_docstring(ast.parse(source)) or ""
    lines = []
    for line in source.splitlines():
        if not line.startswith("//!"):
            break
        lines.append(line[3:].strip())
    return "\n".join(lines)


def _is_test(path: Path) -> bool:
    return path.stem in ("tests", "model_tests")


def render() -> str:
    rows = ["# Layout", "",
            "Generated from the tree by `python tests/test_layout.py > docs/layout.md` "
            "(tests/test_layout.py fails when it is out of date): each source file and the first "
            "sentence of its module doc.", "", "| path | what |", "| --- | --- |"]
    for folder, pattern in SOURCES:
        for path in sorted((ROOT / folder).rglob(pattern)):
            if _is_test(path):
                continue
            what = _first_sentence(_doc(path)).replace("|", "\\|")
            rows.append(f"| `{path.relative_to(ROOT)}` | {what} |")
    rows += [f"| `{folder}` | {what} |" for folder, what in FOLDERS]
    return "\n".join(rows) + "\n"


def test_the_layout_table_is_the_trees():
    assert LAYOUT.read_text() == render(), (
        "docs/layout.md differs from the tree: regenerate it with "
        "`python tests/test_layout.py > docs/layout.md`")


def test_every_source_file_says_what_it_is():
    silent = [str(p.relative_to(ROOT)) for folder, pattern in SOURCES
              for p in (ROOT / folder).rglob(pattern) if not _is_test(p) and not _doc(p).strip()]
    assert not silent, f"source files without a module doc: {silent}"


if __name__ == "__main__":
    print(render(), end="")
