"""A multi-rank job that did everything right exits 0 on every rank (issue: gloo SIGABRT at exit).

Runs ``exit_job.py`` (the README's pattern: import zbuf, init, shard, train, save, load, full
state dict, destroy) as 2- and 3-rank gloo jobs, each rank its own process that finalises its own
interpreter: 6 runs per world size in CI (4 forked eager, 1 forked compiled, 1 with fresh
interpreters), ``ZBUF_EXIT_RUNS`` forked eager runs per world size (default 4) for a longer soak.
Every rank must exit 0, and exits 3 itself if a gloo worker thread survived
``destroy_process_group()`` ([Note: a model does not keep its group alive] in
``zbuf/shard_state.py``).

Why 12 runs show it: a reference that keeps the group alive leaves its gloo threads running after
destroy in every run, which the thread check sees deterministically (exit 3), whatever the
finalisation does; the SIGABRT it causes came in about 5 runs of 6 on a 2-rank job, so 6 runs of
one world size all passing with the bug present has a chance of (1/6)^6, about 2e-5, even without
the thread check. A rarer exit race, at rate p per run, is caught by the 12 runs with chance
1 - (1 - p)^12 (97 % at p = 0.25, 72 % at 0.1); the 30 runs this test made before caught p = 0.1
with 96 % for 40 s more CPU (153 s against 113 s, 2 ranks' runs and 3 ranks' together);
``ZBUF_EXIT_RUNS=50`` is the soak for rarer ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("exit_job.py")


@pytest.mark.parametrize("world", [2, 3])
def test_multi_rank_jobs_exit_cleanly(world):
    runs = int(os.environ.get("ZBUF_EXIT_RUNS", "4"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(JOB), "--world", str(world), "--runs", str(runs),
           "--compile-runs", "1", "--fresh-runs", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300 + 60 * runs)
    total = runs + 2
    summary = f"{world}-rank runs: {total} of {total} exited cleanly"
    assert done.returncode == 0 and summary in done.stdout, (
        f"exit status {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n"
        f"{done.stderr[-4000:]}")
