"""``bash .ci/run`` (the README's test command) leaves the caller's Python environment alone.

It once ran ``pip install -e`` into whatever ``python3`` was first on PATH: a user's torch 2.15
became the pinned 2.11 and their install an editable one. Here ``python3``, ``pip`` and ``cargo``
are stand-ins that only log how they were called, so the script's every step is seen without
installing anything.
"""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stand_in(path, name: str, log, extra: str = "") -> None:
    path.write_text(f'#!/bin/sh\necho "{name} PYTHONPATH=${{PYTHONPATH-unset}} $*" >> {log}\n'
                    + extra)
    path.chmod(0o755)


def test_ci_run_installs_and_tests_in_its_own_venv(tmp_path):
    bin_dir, log, venv = tmp_path / "bin", tmp_path / "calls.log", tmp_path / "venv"
    bin_dir.mkdir()
    venv_python = (f'if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin" && '
                   f'printf \'#!/bin/sh\\necho "venv-python PYTHONPATH=${{PYTHONPATH-unset}} $*"'
                   f' >> {log}\\n\' > "$3/bin/python" && chmod +x "$3/bin/python"; fi\n')
    _stand_in(bin_dir / "python3", "host-python3", log, venv_python)
    for name in ("python", "pip", "pip3"):
        _stand_in(bin_dir / name, f"host-{name}", log)
    _stand_in(bin_dir / "cargo", "cargo", log)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "ZBUF_CI_VENV": str(venv),
           "PYTHONPATH": "/somewhere/else"}
    res = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    calls = log.read_text().splitlines()
    host = [c for c in calls if c.startswith("host-")]
    assert host == [f"host-python3 PYTHONPATH=/somewhere/else -m venv {venv}"], calls
    steps = [c.split(" ", 2)[0] + " " + c.split(" ", 2)[2] for c in calls if not c.startswith("host-")]
    assert steps == [
        "venv-python -m pip install --quiet --upgrade pip",
        "venv-python -m pip install --quiet -c ci/constraints.txt .[test]",
        "cargo test --locked --release",
        "venv-python -m pytest -q -ra --durations=20 -n 2 --dist loadfile --no-loadscope-reorder",
    ], calls
    # The caller's PYTHONPATH does not reach the suite (it would test another zbuf).
    assert all("PYTHONPATH=unset" in c for c in calls if not c.startswith("host-")), calls

    # A second run reuses the environment.
    log.write_text("")
    assert subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], env=env,
                          capture_output=True, timeout=60).returncode == 0
    assert not [c for c in log.read_text().splitlines() if c.startswith("host-")]
