"""The compute stream's waits for copies on other streams, timed: how long a copy held the
step up (its exposed time); or the copies themselves, timed where they ran. Read off CUDA events
without stopping the host."""

from __future__ import annotations

import torch

__all__ = ["TimedWaits"]


class TimedWaits:
    """Spans of a stream, each between two timing events: the waits of a compute stream, the
    time it stood still (``wait``), or work another stream ran, timed by its caller (``add``)."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        """(before, after) of each span not yet read (producers: ``wait``, ``add``; consumer:
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

    def add(self, before: torch.cuda.Event, after: torch.cuda.Event) -> None:
        """A span the caller recorded: two timing events on one stream."""
        self._pending.append((before, after))

    def read_ms(self, *, done_only: bool = False) -> float:
        """Milliseconds of the spans read now: every pending one (waiting for the last to be
        reached), or with ``done_only`` those the device has passed already (never holding the
        host up)."""
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
