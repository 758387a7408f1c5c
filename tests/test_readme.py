"""The README's code runs as written and its sample output is a real run's, so neither can rot;
the same for the reference pages in docs/.

The rule for their fenced blocks:

- ``python``: runs as written, each block on its own in a fresh interpreter (so each must carry
  its imports) in an empty directory, and must exit 0. They are small on purpose (the tiny
  model under ``aot_eager``).
- ``bash`` (README only): the set-up commands (install and train, the whole test suite). Not
  run here: one installs into the caller's environment, the other is this suite. The README
  promises exactly two of them, and this checks that it still shows two.
- ``console`` (docs): command lines for a GPU machine, not run.
- no language: sample output, not code. The README's samples of ``$ zbuf train`` and ``$ zbuf
  report`` are checked against a real CPU run in tests/test_cli_train.py
  (``check_sample``): their rows are the run's, in its order, and the values that do not depend
  on timing or the step count are equal.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = sorted(os.path.join(ROOT, "docs", n) for n in os.listdir(os.path.join(ROOT, "docs"))
              if n.endswith(".md"))
_FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```$", re.M | re.S)


def _blocks(language: str, path: str = README) -> list[str]:
    with open(path) as f:
        return [body for lang, body in _FENCE.findall(f.read()) if lang == language]


_PYTHON = [(os.path.relpath(path, ROOT), i) for path in [README, *DOCS]
           for i in range(len(_blocks("python", path)))]


def test_the_setup_commands_are_two():
    commands = [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]
    assert commands == ["pip install . && zbuf train", "bash .ci/run"], commands


@pytest.mark.parametrize("path, index", _PYTHON)
def test_python_block_runs_as_written(path, index, tmp_path):
    code = _blocks("python", os.path.join(ROOT, path))[index]
    script = tmp_path / f"readme_{index}.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{path} python block {index}:\n{code}\n{res.stderr[-4000:]}"
    if "zbuf.schedule_report" in code:  # the API tour shows the user what zbuf planned
        lines = res.stdout.splitlines()
        # [Note: measure first, then spend]: the measured step's plan, and the one grown after it
        kinds = [l.split(":")[0] for l in lines if "parameters gathered in" in l]
        assert kinds in (["forward", "backward"], ["forward", "backward"] * 2), res.stdout
        assert any(l.startswith("saved ") and l.endswith("ckpt") for l in lines), res.stdout


def test_there_is_python_to_run():
    assert len(_blocks("python")) >= 1 and len(_PYTHON) >= 3, _PYTHON


def test_the_readme_is_what_a_newcomer_needs_first():
    """Issue 37: at 27 KB the README's options and ``zbuf.compile`` paragraphs were hard going;
    the reference is in docs/, and every page the README points to is there."""
    text = open(README).read()
    assert len(text.encode()) < 14_000, len(text.encode())
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert os.path.isfile(os.path.join(ROOT, link)), link
    assert {os.path.relpath(p, ROOT) for p in DOCS} <= set(re.findall(r"\]\((docs/[^)#]+)", text))


def test_the_knobs_defaults_are_the_tests_own():
    """Each ``ZBUF_*`` knob's default in docs/testing.md is what a test reads (the README said
    ``ZBUF_EXIT_RUNS`` defaulted to 13; tests/test_exit.py reads 4)."""
    with open(os.path.join(ROOT, "docs", "testing.md")) as f:
        knobs = re.findall(r"^- `(ZBUF_\w+)`: (.*?)(?=^- |^$)", f.read(), re.M | re.S)
    sources = ""
    for name in os.listdir(os.path.dirname(__file__)):
        if name.endswith(".py"):
            with open(os.path.join(os.path.dirname(__file__), name)) as f:
                sources += f.read()
    stated = [(knob, default) for knob, text in knobs
              for default in re.findall(r"default (\d+)", text)]
    assert ("ZBUF_EXIT_RUNS", "4") in stated, stated
    for knob, default in stated:
        assert f'os.environ.get("{knob}", "{default}")' in sources, (knob, default)


SAMPLE_STABLE = frozenset({
    # summary
    "status", "alloc retries per rank", "pool high water", "peak live gathered",
    "activations kept for backward",
    # zbuf report: the block frames' schedule, the step's memory
    "blocks", "one block's weights", "gathered one block ahead", "peak live gathered (planned)",
    "pool budget", "blocks kept/selective/recomputed", "blocks kept for backward",
    "frames compiled", "forward peak", "backward peak", "optimizer peak", "re-planned at step",
    "re-plan compiled", "weights kept for backward (run time)",
    "steps the pool lent to the optimizer", "alloc retries per rank after step 2"})
"""Rows of the README's samples whose values a CPU run of the same configuration reproduces
whatever the machine's speed, its free memory or the number of steps (sizes of the tiny model's
plan, what the measured step decided). The gather budget is not one of them: the block frames
may hold what the host's free memory allows ([Note: ranks share the host] in zbuf/memory/device.py)."""


def table_rows(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(label, values) of every row of the rich tables in ``text``; a label wrapped over two
    lines is joined."""
    rows: list[tuple[str, tuple[str, ...]]] = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        label, *values = [c.strip() for c in line.strip().strip("│").split("│")]
        if rows and not any(values):  # the rest of a wrapped label
            rows[-1] = (f"{rows[-1][0]} {label}", rows[-1][1])
            continue
        rows.append((label, tuple(values)))
    return rows


def readme_sample(command: str) -> str:
    """The README's sample output of ``$ zbuf COMMAND``."""
    return next(b for b in _blocks("") if b.startswith(f"$ zbuf {command}"))


def check_sample(command: str, output: str) -> None:
    """The README's sample of ``zbuf COMMAND`` is true of ``output``, a real run's: each of its
    rows is one of the run's, in the run's order, with the run's values where they do not depend
    on timing or the step count (``SAMPLE_STABLE``)."""
    real = table_rows(output)
    labels = [label for label, _ in real]
    at = 0
    for label, values in table_rows(readme_sample(command)):
        assert label in labels[at:], f"README's zbuf {command} row {label!r} is not in the " \
                                     f"run's output after row {at}:\n{output}"
        at = labels.index(label, at) + 1
        if label in SAMPLE_STABLE:
            assert real[at - 1][1] == values, (command, label, values, real[at - 1][1])


def readme_report_plots() -> list[str]:
    """The PNG files the README's sample ``zbuf report`` output says it wrote, in order."""
    return [line.split("/")[-1] for block in _blocks("") for line in block.splitlines()
            if line.startswith("wrote plots/")]


def test_the_readme_lists_the_plots_zbuf_report_documents():
    # The README listed 5 of the 7 plots. What a real CPU run writes is compared with this list
    # in tests/test_cli_train.py::test_train_default_engine_then_report.
    import zbuf.train.report as report

    documented = re.findall(r"^- ``(\w+\.png)``", report.__doc__, re.M)
    # The sample's run (--ac off on CPU) checkpoints nothing, so it draws no recompute.png.
    assert sorted(readme_report_plots() + ["recompute.png"]) == sorted(documented), \
        (readme_report_plots(), documented)

