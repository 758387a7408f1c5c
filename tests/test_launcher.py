"""The launcher blames the rank that failed, not the peers that noticed ([Note: which rank failed])."""

import signal
import textwrap

from zbuf.faults import RANK_FAILURE_EXIT_CODE
from zbuf.train.launcher import launch_group


def _group(tmp_path, body: str, nproc: int = 2, **kw):
    script = tmp_path / "rank.py"
    script.write_text("import os, sys, time\nrank = int(os.environ['RANK'])\n" + textwrap.dedent(body))
    return launch_group([str(script)], nproc, **kw)


def test_slow_dying_rank_is_blamed_not_the_peer_that_saw_it_first(tmp_path):
    # Rank 0 notices at once ("a peer died"); rank 1, the cause, takes a while to exit.
    group = _group(tmp_path, f"""
        if rank == 0:
            sys.exit({RANK_FAILURE_EXIT_CODE})
        time.sleep(1.0)
        sys.exit(3)
    """)
    assert group.failed_rank == 1, group
    assert group.returncodes == [RANK_FAILURE_EXIT_CODE, 3]
    assert group.describe(1) == "exited with status 3"


def test_signal_death_is_named(tmp_path):
    group = _group(tmp_path, f"""
        if rank == 0:
            sys.exit({RANK_FAILURE_EXIT_CODE})
        time.sleep(0.5)
        os.kill(os.getpid(), {int(signal.SIGSEGV)})
    """)
    assert group.failed_rank == 1, group
    assert group.describe(1) == "was killed by SIGSEGV (a crash in native code)"


def test_only_peer_failures_blame_the_first(tmp_path):
    # Nobody failed on its own (a rank hung and was timed out elsewhere): the first is reported,
    # after at most cause_wait.
    group = _group(tmp_path, f"sys.exit({RANK_FAILURE_EXIT_CODE} if rank == 0 else 0)\n",
                   cause_wait=0.5)
    assert group.failed_rank == 0 and group.returncodes == [RANK_FAILURE_EXIT_CODE, 0]


def test_peers_still_running_are_stopped(tmp_path):
    group = _group(tmp_path, """
        if rank == 0:
            sys.exit(4)
        time.sleep(60)
    """, grace=2.0)
    assert group.failed_rank == 0
    assert group.returncodes[1] == -signal.SIGTERM


def test_success(tmp_path):
    group = _group(tmp_path, "sys.exit(0)\n", nproc=3)
    assert group.failed_rank is None and group.returncodes == [0, 0, 0]
