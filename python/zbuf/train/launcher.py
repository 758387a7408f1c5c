"""Start N worker processes the way torchrun would, and never leave one behind.

[Note: launching like torchrun]
The workers see exactly the environment torchrun gives (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE=True``), so the worker code has one path for both launches. As
torchrun's agent does, the launcher hosts the rendezvous ``TCPStore`` itself on a port the OS
picks (no free-port race) and every rank connects to it as a client.

[Note: no orphans]
- Ctrl-C in a terminal sends SIGINT to the whole foreground process group: workers stop at once
  (``KeyboardInterrupt``, exit 130) and the launcher waits for them ([Note: a Ctrl-C is the
  workers' too]).
- SIGINT or SIGTERM sent to the launcher alone: it sends SIGTERM to every live worker, waits up to
  ``grace`` seconds, then SIGKILLs what is left, and reaps all of them before exiting.
- Started with SIGINT ignored (``cmd &`` in a script): the launcher and its workers keep
  ignoring it and SIGTERM stops them as above ([Note: an ignored SIGINT stays ignored] in
  ``zbuf/faults.py``).
- The launcher killed outright (SIGKILL): each worker asked the kernel to SIGKILL it when its
  parent dies (``PR_SET_PDEATHSIG``, set by the worker itself at start-up; see
  ``die_with_parent``).
- A worker that fails: its peers would block in their next collective, so the launcher stops
  them and reports the failed rank ([Note: which rank failed]), one line per cause ([Note: one
  line per cause]).

[Note: a Ctrl-C is the workers' too]
After SIGINT the launcher waits up to ``grace`` seconds for the workers to stop on their own
before it sends SIGTERM. It used to send SIGTERM at once, though a terminal's Ctrl-C had
reached the workers too: the SIGTERM landed in a rank still unwinding its Ctrl-C, in a
finaliser ("Exception ignored ... SystemExit: 143") or inside torch's tracing, where one rank
aborted in native code ("trying to set the current FakeTensorMode, but one already exists",
140 lines) when the Ctrl-C came during the first compile (issue 37, item 16). A SIGINT sent to
the launcher alone costs that wait before its workers are stopped; SIGTERM stops them at once.

[Note: which rank failed]
A rank that dies takes its sockets with it, so its peers' next collective fails at once and they
exit with ``RANK_FAILURE_EXIT_CODE`` ("a peer died"), often before the dead rank's own exit is
visible here (a signal death is reaped later; a traceback takes time to print). Reporting the
first exit seen would blame a survivor and hide the cause. So a peer-failure exit is only ever
reported when no rank failed on its own: the launcher waits up to ``cause_wait`` seconds for the
rank that did, and reports that one.

[Note: one line per cause]
A failure seen by N ranks is one cause, not N messages: when one rank dies, every peer stops
with the same "a peer died" paragraph, and a bug that hits every rank prints the same traceback
N times (64 ranks made 60 identical 600-character lines). So the launcher relays the workers'
stderr itself, live, and drops a line when another rank already printed it up to its numbers
(rank ids, ports, addresses differ; the cause does not). A rank's own repeated lines still show.
After a failure, ``GroupResult.causes`` sums up how every rank ended in one line per distinct
ending, naming the ranks.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import NamedTuple, Optional

__all__ = ["GroupResult", "Interrupted", "under_torchrun", "launch_group", "die_with_parent"]

_PR_SET_PDEATHSIG = 1
_LAUNCHER_PID = "ZBUF_LAUNCHER_PID"


class Interrupted(Exception):
    """The launcher got SIGINT / SIGTERM; workers have been stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """128 + the signal, as a shell reports a process it ended: 130 for SIGINT (Ctrl-C),
        143 for SIGTERM (what supervisors and ``kill`` expect)."""
        return 128 + self.signum


class GroupResult(NamedTuple):
    returncodes: list[int]
    """Exit status per rank (negative: killed by that signal)."""
    failed_rank: Optional[int]
    """The rank whose failure stopped the group ([Note: which rank failed]), or None."""

    def describe(self, rank: int) -> str:
        """How ``rank`` ended, in words: ``exited with status 1``, ``was killed by SIGSEGV``."""
        code = self.returncodes[rank]
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            hint = {"SIGKILL": " (the kernel's out-of-memory killer, or a kill -9)",
                    "SIGSEGV": " (a crash in native code)",
                    "SIGABRT": " (an abort in native code)"}.get(name, "")
            return f"was killed by {name}{hint}"
        return f"exited with status {code}"

    def causes(self, own: dict[int, str]) -> list[str]:
        """How the ranks ended, one line per distinct ending, the failed rank's first ([Note:
        one line per cause]): ``rank 1 was killed by SIGKILL ...``, ``ranks 0, 2-63 (63 of 64)
        stopped because another rank failed (exit 75)``, ``rank 0: ValueError: ...``. ``own``: a
        rank's own account (the last line of its traceback) where it left one. Ranks that
        finished are not mentioned."""
        from zbuf.faults import RANK_FAILURE_EXIT_CODE

        def ending(rank: int) -> Optional[str]:
            code = self.returncodes[rank]
            if rank in own:
                return f": {own[rank]}"
            if code == 0:
                return None
            if code == RANK_FAILURE_EXIT_CODE:
                return f" stopped because another rank failed (exit {code})"
            if code in (-signal.SIGTERM, 128 + signal.SIGTERM):
                return " were stopped by the launcher after the failure"
            return f" {self.describe(rank)} and left no traceback"

        groups: dict[str, list[int]] = {}
        order = ([self.failed_rank] if self.failed_rank is not None else []) + \
            [r for r in range(len(self.returncodes)) if r != self.failed_rank]
        for rank in order:
            text = ending(rank)
            if text is not None:
                groups.setdefault(text, []).append(rank)
        n = len(self.returncodes)
        return [f"{_rank_list(ranks, n)}{text}" for text, ranks in groups.items()]


def _rank_list(ranks: list[int], world: int) -> str:
    """``rank 3``, ``ranks 0, 2-63 (63 of 64)``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans, start, prev = [], None, None
    for r in sorted(ranks):
        if start is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            spans.append(f"{start}-{prev}" if prev > start else f"{start}")
        start = prev = r
    spans.append(f"{start}-{prev}" if prev > start else f"{start}")
    return f"ranks {', '.join(spans)} ({len(ranks)} of {world})"


class _StderrRelay:
    """Copies every worker's stderr to ours, live, once per line across ranks ([Note: one line
    per cause])."""

    _NUMBERS = re.compile(r"\d+")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first_rank: dict[str, int] = {}  # line up to its numbers -> rank that printed it
        self._threads: list[threading.Thread] = []

    def follow(self, rank: int, pipe) -> None:
        t = threading.Thread(target=self._copy, args=(rank, pipe), daemon=True,
                             name=f"zbuf-stderr-rank{rank}")
        t.start()
        self._threads.append(t)

    def _copy(self, rank: int, pipe) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", "replace")
                key = self._NUMBERS.sub("#", line.strip())
                with self._lock:
                    if self._first_rank.setdefault(key, rank) != rank:
                        continue
                    sys.stderr.write(line)
                    sys.stderr.flush()

    def join(self, timeout: float) -> None:
        # A worker's own children (compile workers) may hold the pipe a moment longer.
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


def under_torchrun() -> bool:
    """True inside a process started by torchrun (or any launcher that sets the same env)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                         "MASTER_PORT")) and _LAUNCHER_PID not in os.environ


def die_with_parent() -> None:
    """In a worker we launched: get SIGKILLed when the launcher dies, even by SIGKILL (Linux)."""
    parent = os.environ.get(_LAUNCHER_PID)
    if parent is None:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's signal handling still applies
        pass
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os._exit(1)


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def _own_failure(code: Optional[int]) -> bool:
    from zbuf.faults import RANK_FAILURE_EXIT_CODE

    return code not in (None, 0, RANK_FAILURE_EXIT_CODE)


def _failed_rank(procs: list[subprocess.Popen], cause_wait: float) -> Optional[int]:
    """Poll until every rank has exited or one failed; the rank to blame ([Note: which rank
    failed])."""
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    deadline = time.monotonic() + cause_wait
    while True:
        codes = [p.poll() for p in procs]
        own = [r for r, c in enumerate(codes) if _own_failure(c)]
        if own:
            return own[0]
        if all(c is not None for c in codes) or time.monotonic() >= deadline:
            return next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
        time.sleep(0.05)


def launch_group(argv: list[str], nproc: int, *, env: Optional[dict[str, str]] = None,
                 grace: float = 10.0, cause_wait: float = 5.0) -> GroupResult:
    """Run ``python argv...`` as ranks 0..nproc-1 on this host and wait for all of them.

    ``grace``: seconds a stopped worker gets between SIGTERM and SIGKILL. ``cause_wait``: seconds
    to wait, after a peer-failure exit, for the rank that failed on its own ([Note: which rank
    failed]). Raises ``Interrupted`` (after stopping every worker) on SIGINT / SIGTERM.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300),
                          wait_for_workers=False)
    base = dict(os.environ if env is None else env)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True",
                **{_LAUNCHER_PID: str(os.getpid())})
    procs: list[subprocess.Popen] = []
    relay = _StderrRelay()
    stopped_by: Optional[int] = None
    # SIGTERM always stops the group; SIGINT only when this process was not started with it
    # ignored ([Note: an ignored SIGINT stays ignored] in zbuf/faults.py).
    handled = [signal.SIGTERM] + \
        ([signal.SIGINT] if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN else [])
    old = {s: signal.signal(s, _raise_interrupted) for s in handled}
    try:
        for rank in range(nproc):
            child = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen([sys.executable, *argv], env=child,
                                          stderr=subprocess.PIPE))
            relay.follow(rank, procs[-1].stderr)
        failed = _failed_rank(procs, cause_wait)
        return GroupResult([_stop(p, grace) for p in procs], failed)
    except Interrupted as e:
        stopped_by = e.signum
        raise
    finally:
        # Runs on success (no-op: all exited), on failure and on Interrupted alike. A second
        # Ctrl-C must not cut the clean-up short (that is how orphans happen); it is bounded by
        # ``grace`` anyway.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        if stopped_by == signal.SIGINT:  # [Note: a Ctrl-C is the workers' too]
            deadline = time.monotonic() + grace
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            _stop(p, max(0.0, deadline - time.monotonic()))
        relay.join(timeout=2.0)
        for s, handler in old.items():
            signal.signal(s, handler)
        del store


def _stop(p: subprocess.Popen, timeout: float) -> int:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return p.returncode
