"""A command started in the background for a test fixture, so that runs that each take one core
for a minute (a ``zbuf train`` of one rank, a simulated run) overlap on CI's two cores."""

from __future__ import annotations

import subprocess

__all__ = ["Started"]


class Started:
    """``cmd`` running in the background, its output going to ``where/name.out`` and ``.err``."""

    def __init__(self, cmd: list[str], where, name: str, env: dict[str, str]) -> None:
        self.cmd, self.out, self.err = cmd, where / f"{name}.out", where / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Its exit, once it ended (killed after ``timeout`` seconds, which raises)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return subprocess.CompletedProcess(self.cmd, code, self.out.read_text(),
                                           self.err.read_text())
