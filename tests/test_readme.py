"""The README's code runs as written, so it cannot rot.

The rule for its fenced blocks:

- ``python``: runs as written, each block on its own in a fresh interpreter (so each must carry
  its imports) in an empty directory, and must exit 0. They are small on purpose (the tiny
  model under ``aot_eager``).
- ``bash``: the set-up commands (install and train, the whole test suite). Not run here: one
  installs into the caller's environment, the other is this suite. The README promises exactly
  two of them, and this checks that it still shows two.
- no language: sample output, not code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
_FENCE = re.compile(r"^```([A-Za-z]*)\n(.*?)^```$", re.M | re.S)


def _blocks(language: str) -> list[str]:
    with open(README) as f:
        return [body for lang, body in _FENCE.findall(f.read()) if lang == language]


def test_the_setup_commands_are_two():
    commands = [line for block in _blocks("bash") for line in block.splitlines() if line.strip()]
    assert commands == ["pip install . && zbuf train", "bash .ci/run"], commands


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs_as_written(index, tmp_path):
    code = _blocks("python")[index]
    script = tmp_path / f"readme_{index}.py"
    script.write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"README python block {index}:\n{code}\n{res.stderr[-4000:]}"
    if "zbuf.schedule_report" in code:  # the API tour shows the user what zbuf planned
        lines = res.stdout.splitlines()
        # [Note: measure first, then spend]: the measured step's plan, and the one grown after it
        kinds = [l.split(":")[0] for l in lines if "parameters gathered in" in l]
        assert kinds in (["forward", "backward"], ["forward", "backward"] * 2), res.stdout
        assert any(l.startswith("saved ") and l.endswith("ckpt") for l in lines), res.stdout


def test_there_is_python_to_run():
    assert len(_blocks("python")) >= 2


def readme_report_plots() -> list[str]:
    """The PNG files the README's sample ``zbuf report`` output says it wrote, in order."""
    return [line.split("/")[-1] for block in _blocks("") for line in block.splitlines()
            if line.startswith("wrote plots/")]


def test_the_readme_lists_the_plots_zbuf_report_documents():
    # The README listed 5 of the 7 plots. What a real CPU run writes is compared with this list
    # in tests/test_cli_train.py::test_train_default_engine_then_report.
    import zbuf.train.report as report

    documented = re.findall(r"^- ``(\w+\.png)``", report.__doc__, re.M)
    assert sorted(readme_report_plots()) == sorted(documented), (readme_report_plots(), documented)

