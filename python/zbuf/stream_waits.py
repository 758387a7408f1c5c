"""The compute stream's waits for copies on other streams, timed: how long a copy held the
step up (its exposed time); and the copies themselves, timed: how fast they ran. Both read off
CUDA events without stopping the host."""

from __future__ import annotations

import torch

__all__ = ["TimedCopies", "TimedWaits"]


class TimedWaits:
    """Waits of a compute stream, each between two timing events: the time it stood still."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        """(before, after) of each wait not yet read (producer: ``wait``; consumer:
        ``read_ms``)."""

    def __len__(self) -> int:
        return len(self._pending)

    def wait(self, compute: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        """``compute`` waits for ``event``, timed."""
        before = torch.cuda.Event(enable_timing=True)
        after = torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(event)
        after.record(compute)
        self._pending.append((before, after))

    def read_ms(self, *, done_only: bool = False) -> float:
        """Milliseconds the compute stream stood still in the waits read now: every pending one
        (waiting for the last to be reached), or with ``done_only`` those the device has passed
        already (never holding the host up)."""
        ms = 0.0
        kept = []
        for before, after in self._pending:
            if done_only and not after.query():
                kept.append((before, after))
                continue
            after.synchronize()
            ms += before.elapsed_time(after)
        self._pending = kept
        return ms


class TimedCopies:
    """Copies on a side stream, each between two timing events on that stream: how fast they
    ran, read off CUDA events without stopping the host."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        """(began, ended, bytes) of each copy not yet read (producer: ``add``; consumer:
        ``read``)."""

    def add(self, began: torch.cuda.Event, ended: torch.cuda.Event, nbytes: int) -> None:
        """A copy of ``nbytes`` that ran from ``began`` to ``ended``, both timing events
        recorded on its stream."""
        self._pending.append((began, ended, nbytes))

    def read(self, *, done_only: bool = False) -> tuple[float, int, int]:
        """Milliseconds, bytes and copies of those read now: every pending one (waiting for
        the last to end), or with ``done_only`` those the device has run already."""
        ms, nbytes, copies = 0.0, 0, 0
        kept = []
        for began, ended, size in self._pending:
            if done_only and not ended.query():
                kept.append((began, ended, size))
                continue
            ended.synchronize()
            ms += began.elapsed_time(ended)
            nbytes += size
            copies += 1
        self._pending = kept
        return ms, nbytes, copies
