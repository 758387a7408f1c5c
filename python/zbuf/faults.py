"""Failing loudly and promptly: collective timeouts, rank-failure exits, resource release, fault points.

A ZeRO-3 step is a chain of collectives; if one rank dies, its peers block in the next one. What
happens then, on the backends zbuf runs on:

- gloo (CPU): a peer killed outright closes its sockets, and the blocked collective raises
  ``RuntimeError: ... Connection closed by peer`` (or ``reset by peer``) at once. A peer that is
  alive but stuck (deadlock, stopped, swapping) is noticed only when the collective's timeout
  expires: ``RuntimeError: ... Timed out waiting <ms> for ...``.
- NCCL (CUDA): collectives are asynchronous; ProcessGroupNCCL's watchdog notices the timeout and,
  with torch's default ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``, tears the process down (non-zero exit,
  "Watchdog caught collective operation timeout" in the log). zbuf leaves that policy alone.

So the one knob is the collective timeout. ``DEFAULT_COLLECTIVE_TIMEOUT_S`` (600 s, NCCL's own
default; gloo's is 30 min) is what ``configure_timeout`` applies when not told otherwise. It must
exceed the longest legitimate wait of a fast rank for a slow one: a checkpoint save (ranks wait
in a barrier while the slowest one writes) or the first ``torch.compile`` of a step.

[Note: rank-failure exit]
``supervised()`` wraps a rank's main loop. An exception that a dead or stuck peer explains
(``is_peer_failure``) becomes one clear line on stderr naming this rank, the timeout, the cause
and what to do, then resources are released and the process ends with ``RANK_FAILURE_EXIT_CODE``
(75, ``EX_TEMPFAIL``: restarting from the last checkpoint can succeed), through ``os._exit``: a
process group that lost a peer may block in its destructor or in a barrier that interpreter
shutdown triggers, and a surviving rank must not hang where its peer died. Any other exception
releases resources and re-raises (Python prints the traceback, exit status 1); Ctrl-C releases
and exits with 130.

[Note: an ignored SIGINT stays ignored]
A process whose parent ignored SIGINT starts with it ignored, and Python then installs no
``KeyboardInterrupt`` handler: a shell does that for ``cmd &`` in a script (without job control),
so that the terminal's Ctrl-C stops the script and not its background jobs; ``nohup`` under
such a shell inherits it too. zbuf keeps that choice, in the ranks and in ``zbuf train``'s
launcher alike: such a run does not stop on SIGINT. SIGTERM stops it cleanly whatever SIGINT's
disposition (``install_exit_handlers``: the rank releases its pools and process group and exits
with 143; the launcher stops every worker first), so a background run is stopped with
``kill PID``. ``tests/test_faults.py`` starts each rank with the disposition it tests, not the
one the test runner inherited.

[Note: resource release]
``release_resources()`` runs on every exit path (``supervised``'s handlers, ``atexit``, and
SIGTERM, which torchrun sends to the remaining workers when one fails): it drops the idle blocks
of every gather-buffer pool the process created (buffers still checked out are returned by their
tensors' deleters), then destroys the process groups (aborts them on NCCL when a peer failed,
since a graceful destroy waits for collectives that will never finish). It is idempotent.

[Note: fault points]
``fault_point(name)`` is a no-op unless the environment variable ``ZBUF_FAULT`` names it
(``name`` or ``name@<rank>``, with ``RANK`` the global rank); then the process kills itself with
SIGKILL (``ZBUF_FAULT_SIGNAL=STOP`` stops it instead, a hung rank; ``ZBUF_FAULT_SIGNAL=OOM``
raises ``torch.OutOfMemoryError`` there, an allocation that failed). Tests use it to die at exact
places (mid-step, mid-save) without racing a timer. The check is one dict lookup.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import logging
import os
import signal
import sys
import threading
import warnings
from typing import Iterator, Optional

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "RANK_FAILURE_EXIT_CODE",
    "INTERRUPTED_EXIT_CODE",
    "configure_timeout",
    "collective_timeout_s",
    "is_peer_failure",
    "rank_failure_message",
    "supervised",
    "install_exit_handlers",
    "release_resources",
    "end_process",
    "fault_point",
    "raise_swallowed_stop",
    "stop_delivered",
    "unsaid_stop_noise",
]

DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
"""Collective timeout applied by ``configure_timeout`` when none is given: NCCL's default."""

RANK_FAILURE_EXIT_CODE = 75
"""Exit status of a rank that stopped because a peer died or hung (``EX_TEMPFAIL``)."""

INTERRUPTED_EXIT_CODE = 130
"""Exit status after Ctrl-C (128 + SIGINT), as shells report it."""



class _ProcessRelease:
    """Whether this process already released its resources ([Note: resource release]).

    The one piece of process-wide state in this module, kept on purpose: what it guards (the
    pools and process groups of this process, released from ``atexit``, SIGTERM and
    ``supervised``'s handlers, which are per process by nature) belongs to the process, not to
    any object a caller holds. The collective timeout lives on the group itself (torch keeps it in
    the group's options), and the exit handlers are recognised by what is installed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False

    def claim(self) -> bool:
        """True exactly once per process: the caller releases."""
        with self._lock:
            if self._done:
                return False
            self._done = True
            return True


_PROCESS_RELEASE = _ProcessRelease()


class _StopRequest:
    """The stop a signal asked for, until it is raised where it cannot be lost.

    [Note: a stop a finaliser swallowed]
    Python runs a signal handler between two bytecodes of whatever runs then, and that can be a
    weakref callback or a ``__del__`` (the eager path's re-gather bookkeeping is one, run on
    every gathered buffer's death), where an exception is printed as "Exception ignored" and
    dropped. A Ctrl-C or SIGTERM landing there was lost: the rank trained on, its peers stopped,
    and no record of the steps done was written (``test_interrupt_leaves_no_orphans_and_a_record``
    failed about one run in four). So the handlers note the signal before they
    raise, and the training loop raises it again at the next step boundary
    (``raise_swallowed_stop``) if it never arrived. Process-wide like ``_ProcessRelease``: a
    signal is delivered to the process.

    [Note: a stop a peer's failure overtook]
    The next step boundary may never come: a Ctrl-C reaches every rank (torchrun's agent sends
    SIGINT to each rank in turn), a peer stops on it at once, and this rank's next collective
    fails with "Connection reset by peer" first. That is no rank failure but the same stop, so
    ``supervised`` ends such a rank as the stop (130 or 143, "interrupted"), not with the "a
    peer died" paragraph and status 75. Under torchrun it mattered most: rank 0 writes the
    record of an interrupted run itself, only when it stops with 130 or 143, so it left none
    (``test_interrupt_leaves_no_orphans_and_a_record[ctrl-c-under-torchrun]``, once in a
    clean-clone run on two pytest workers and once in 13 runs of that test alone;
    ``tests/swallowed_stop_job.py`` replays the order every time). A rank that was sent no
    stop and sees a peer fail is still a rank failure."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.stopping = False
        """A stop was noted at some time, delivered or not ([Note: what a stop leaves unsaid])."""

    def raise_for(self, signum: int) -> None:
        self.signum = signum
        self.stopping = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)


_STOP_REQUEST = _StopRequest()


def raise_swallowed_stop() -> None:
    """Raise the Ctrl-C or SIGTERM that a finaliser swallowed, if one did ([Note: a stop a
    finaliser swallowed]); call where an interruption is safe (between steps)."""
    if _STOP_REQUEST.signum is not None:
        _STOP_REQUEST.raise_for(_STOP_REQUEST.signum)


def stop_delivered() -> None:
    """The stop reached the code that handles it: a later step boundary must not raise it
    again (a caller may catch a Ctrl-C and go on)."""
    _STOP_REQUEST.signum = None


_TORCH_STOP_NOISE = ("ChromiumEventLogger: ", "Error detected in ")
"""How the messages of [Note: what a stop leaves unsaid] begin: torch's compile-event logger
(``torch._dynamo.utils``), and anomaly detection's "Error detected in <op>Backward" warning."""


class _StopNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (_STOP_REQUEST.stopping and str(record.msg).startswith(_TORCH_STOP_NOISE[0]))


@contextlib.contextmanager
def unsaid_stop_noise() -> Iterator[None]:
    """Within: what torch says about the unwinding a Ctrl-C or SIGTERM causes is dropped, once
    the stop is noted ([Note: what a stop leaves unsaid]). For a process that ends when it is
    stopped (a ``zbuf train`` rank): one that catches the stop and goes on still has it noted.

    [Note: what a stop leaves unsaid]
    A Ctrl-C during the first step's compile unwinds through torch's tracing, and torch then
    complained after zbuf's own "interrupted" line: its compile-event logger warns
    "ChromiumEventLogger: Start event not in stack, ignoring" (or "Detected overlapping events,
    fixing stack": the events ended out of order), and AOT's trace of the joint graph, which
    runs under anomaly detection, prints "Error detected in InvokeSubgraphAutogradOpBackward.
    Traceback of forward call that caused the error" with a stack (issue 37, item 16). Neither is
    about the run, and some come late (a compile event ended when the stopped frames are freed,
    after the stop was handled). Nor is Python's "Exception ignored in: <function ...>" with the
    traceback of a ``KeyboardInterrupt`` (or the ``SystemExit`` of a SIGTERM) that landed in a
    finaliser: the stop is noted and raised again at the next step boundary ([Note: a stop a
    finaliser swallowed]). So within this context (a ``zbuf train`` rank's life), and only once a
    stop was noted (``_StopRequest.stopping``), those messages and no others are dropped: a
    filter on ``torch._dynamo.utils``' logger, a ``warnings.showwarning`` and a
    ``sys.unraisablehook`` that pass everything else on. All are gone when the context ends;
    the same messages in any other case show."""
    logger = logging.getLogger("torch._dynamo.utils")
    noise = _StopNoise()
    logger.addFilter(noise)
    hook = sys.unraisablehook

    def unraisable(what) -> None:  # the stop itself, swallowed by a finaliser: raised again
        if not (_STOP_REQUEST.stopping and isinstance(what.exc_value, (KeyboardInterrupt,
                                                                       SystemExit))):
            hook(what)

    sys.unraisablehook = unraisable
    try:
        with warnings.catch_warnings():  # restores showwarning on the way out
            shown = warnings.showwarning

            def show(message, category, *args, **kwargs):
                if _STOP_REQUEST.stopping and str(message).startswith(_TORCH_STOP_NOISE[1]):
                    return
                shown(message, category, *args, **kwargs)

            warnings.showwarning = show
            yield
    finally:
        logger.removeFilter(noise)
        sys.unraisablehook = hook

# Substrings of the errors gloo, NCCL and the c10d store raise when a peer is gone or too slow.
_PEER_FAILURE_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "nccl communicator was aborted",
    "ncclremoteerror",
    "socket closed",
    "connection refused",
)


def configure_timeout(timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, group: Optional[dist.ProcessGroup] = None) -> None:
    """Make collectives on ``group`` (None: the default group) fail after ``timeout_s`` seconds.

    Call it after ``init_process_group``: rendezvous keeps its own (longer) timeout, so slow
    process start-up is not mistaken for a dead rank. Applies to every later collective of the
    group (``ProcessGroup.set_timeout``), gloo and NCCL alike.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if not dist.is_initialized():
        raise RuntimeError(
            "configure_timeout needs an initialised process group: call "
            "torch.distributed.init_process_group(...) first"
        )
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    pg.set_timeout(datetime.timedelta(seconds=float(timeout_s)))


def collective_timeout_s(group: Optional[dist.ProcessGroup] = None) -> Optional[float]:
    """The collective timeout of ``group`` (None: the default group) in seconds, as the group
    holds it (``configure_timeout``'s, else torch's default); None without a process group."""
    try:
        if not dist.is_initialized():
            return None
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        device = "cuda" if "nccl" in str(dist.get_backend(pg)).lower() else "cpu"
        return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - a group torch is tearing down: say nothing, not raise
        return None


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is what a collective raises when another rank died or stopped responding."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (dist.DistNetworkError, dist.DistStoreError)):
            return True
        if isinstance(exc, (RuntimeError, dist.DistError)):
            text = str(exc).lower()
            if any(m in text for m in _PEER_FAILURE_MARKERS):
                return True
        exc = exc.__cause__ or exc.__context__
    return False


def _rank_words() -> str:
    if dist.is_initialized():
        return f"rank {dist.get_rank()} of {dist.get_world_size()}"
    rank = os.environ.get("RANK")
    return f"rank {rank}" if rank is not None else "this rank"


def rank_failure_message(exc: BaseException, *, cli: bool = False) -> str:
    """The one-paragraph explanation a surviving rank prints ([Note: rank-failure exit]). Its
    advice is in the words of what the user runs: ``cli``, a rank of the ``zbuf`` command (its
    options); else the user's own Python loop (zbuf's functions)."""
    cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if len(cause) > 300:
        cause = cause[:300] + "..."
    applied = collective_timeout_s()
    timeout = f"{applied:g} s" if applied is not None else "torch's default (NCCL 10 min, gloo 30 min)"
    if cli:
        resume, longer = "the same command with --resume", "--collective-timeout SECONDS"
    else:
        resume, longer = "zbuf.load_checkpoint", "zbuf.faults.configure_timeout(timeout_s=...)"
    return (
        f"zbuf: {_rank_words()} stopped: a collective failed because another rank died or stopped "
        f"responding (collective timeout: {timeout}). Cause: {type(exc).__name__}: {cause}. "
        f"Look for the first failing rank in the other ranks' logs, then restart from the last "
        f"checkpoint ({resume}). If a rank was only slow (a long checkpoint save, a first "
        f"compile), raise the timeout ({longer}). Exiting with status {RANK_FAILURE_EXIT_CODE}."
    )


def release_resources(*, peer_failed: bool = False) -> None:
    """[Note: resource release]. Safe to call several times and from any exit path.

    With ``ZBUF_LOG_EXIT=1`` in the environment it reports what it released on stderr.
    """
    if not _PROCESS_RELEASE.claim():
        return
    pools, freed = _trim_pools()
    pg = "none"
    if dist.is_available() and dist.is_initialized():
        try:
            if peer_failed and _uses_nccl():
                dist.distributed_c10d._abort_process_group()
                pg = "aborted"
            else:
                dist.destroy_process_group()
                pg = "destroyed"
        except Exception as e:  # noqa: BLE001 - an exit path must not raise over the real error
            pg = "failed"
            print(f"zbuf: releasing the process group failed ({type(e).__name__}: {e})", file=sys.stderr)
    if os.environ.get("ZBUF_LOG_EXIT") == "1":
        left = _gloo_threads()
        threads = "no gloo worker thread left" if not left else \
            f"{left} gloo worker thread(s) still running"
        print(f"zbuf: released resources: {pools} pool(s) trimmed ({freed} idle bytes freed), "
              f"process group {pg}, {threads}", file=sys.stderr, flush=True)


def end_process(code: int) -> None:
    """End a rank's process with ``code``, as its last statement, after ``release_resources``.

    Normally through ``sys.exit``. But while gloo worker threads are still alive, interpreter
    finalisation can kill the process with SIGABRT after all its work succeeded ([Note: a model
    does not keep its group alive] in shard_state.py). zbuf keeps no group alive, but torch's own
    state can: DTensor's sharding-propagation caches keep FSDP2's DeviceMesh, and with it the
    group, for the life of the process. Then this flushes stdout and stderr and ends the process
    with ``os._exit(code)``, skipping finalisation (``release_resources`` already ran).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    left = _gloo_threads()
    if left:
        if os.environ.get("ZBUF_LOG_EXIT") == "1":
            print(f"zbuf: {left} gloo worker thread(s) outlived destroy_process_group (held by "
                  f"torch); exiting without interpreter finalisation", file=sys.stderr, flush=True)
        os._exit(code)
    sys.exit(code)


def _gloo_threads() -> int:
    """Live ``pt_gloo_runloop`` threads of this process (Linux; 0 elsewhere). After destroy there
    should be none: [Note: a model does not keep its group alive] in shard_state.py."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except OSError:  # the thread ended while we looked
            pass
    return count


def _uses_nccl() -> bool:
    try:
        return "nccl" in str(dist.get_backend()).lower()
    except Exception:  # noqa: BLE001
        return False


def _trim_pools() -> tuple[int, int]:
    """Trim every gather-buffer pool this process created; (pools, bytes freed)."""
    pools = []
    mods = sys.modules
    if "zbuf.pool" in mods:
        pools.extend(getattr(mods["zbuf.pool"], "_default_pools", {}).values())
    if "zbuf.runtime" in mods:
        pools.extend(mods["zbuf.runtime"].known_pools())
    seen = set()
    freed = 0
    for pool in pools:
        if id(pool) in seen:
            continue
        seen.add(id(pool))
        try:
            freed += int(pool.trim() or 0)
        except Exception as e:  # noqa: BLE001
            print(f"zbuf: trimming a gather-buffer pool failed ({type(e).__name__}: {e})", file=sys.stderr)
    return len(seen), freed


def _on_stop_signal(signum, frame):
    # Unwind like an exception so ``finally`` blocks and atexit run; torchrun sends SIGTERM to
    # the other workers when one fails. Noted first: [Note: a stop a finaliser swallowed].
    _STOP_REQUEST.raise_for(signum)


def install_exit_handlers() -> None:
    """Register ``release_resources`` with ``atexit``, turn SIGTERM into ``SystemExit(143)`` and
    keep Ctrl-C a ``KeyboardInterrupt``, both noted ([Note: a stop a finaliser swallowed]).

    Idempotent: ``release_resources`` is registered once however often this runs, and the SIGTERM
    handler is installed only from the main thread and only if SIGTERM still has its default
    disposition (an application's own handler wins, and so does ours once installed).
    """
    atexit.unregister(release_resources)  # at most one registration
    atexit.register(release_resources)
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_stop_signal)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_stop_signal)


@contextlib.contextmanager
def supervised(*, cli: bool = False) -> Iterator[None]:
    """Run a rank's main loop so that every way out releases resources ([Note: rank-failure exit]).

    ::

        dist.init_process_group(...)
        zbuf.faults.configure_timeout(30)
        with zbuf.faults.supervised():
            train()

    ``cli``: the rank is the ``zbuf`` command's, so a peer's failure is explained with its
    options (``rank_failure_message``); a user's own loop leaves it False.
    """
    install_exit_handlers()
    if not faulthandler.is_enabled():
        # A crash in native code (SIGSEGV, SIGABRT) otherwise ends the rank without a word, and
        # its peers' "a peer died" is all anyone sees; this prints the Python stack it died in.
        faulthandler.enable()
    try:
        yield
    except KeyboardInterrupt:
        print(f"zbuf: {_rank_words()} interrupted; releasing resources", file=sys.stderr, flush=True)
        release_resources()
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
    except SystemExit:
        release_resources()
        raise
    except BaseException as e:
        if is_peer_failure(e) and _STOP_REQUEST.signum is not None:
            # [Note: a stop a peer's failure overtook]: this rank's own Ctrl-C or SIGTERM
            signum, _STOP_REQUEST.signum = _STOP_REQUEST.signum, None
            if signum == signal.SIGINT:
                print(f"zbuf: {_rank_words()} interrupted; releasing resources", file=sys.stderr,
                      flush=True)
            release_resources(peer_failed=True)  # the peer has gone: no graceful NCCL destroy
            raise SystemExit(128 + signum) from None
        if is_peer_failure(e):
            print(rank_failure_message(e, cli=cli), file=sys.stderr, flush=True)
            release_resources(peer_failed=True)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(RANK_FAILURE_EXIT_CODE)
        release_resources()
        raise
    else:
        release_resources()


def fault_point(name: str) -> None:
    """[Note: fault points]: die here if ``ZBUF_FAULT`` names this point (tests only)."""
    want = os.environ.get("ZBUF_FAULT")
    if not want:
        return
    point, _, rank = want.partition("@")
    if point != name:
        return
    if rank and rank != os.environ.get("RANK", str(dist.get_rank()) if dist.is_initialized() else ""):
        return
    how = os.environ.get("ZBUF_FAULT_SIGNAL", "").upper()
    if how == "OOM":
        raise torch.OutOfMemoryError(f"injected at fault point {name} (ZBUF_FAULT)")
    sig = signal.SIGSTOP if how == "STOP" else signal.SIGKILL
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), sig)

