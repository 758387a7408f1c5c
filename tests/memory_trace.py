"""zbuf's device memory at each moment of a CUDA run: torch's allocations (its allocation history,
``torch.cuda.memory._record_memory_history``) and the gather pool's buffers (its event log), laid
on one clock.

The sum of the two peaks counts both at once whether or not they coincide; at the user's SDPA
decoder in tests/gpu/test_user_checkpointing_gpu.py that sum came out 20 KB above FSDP2's peak
(0.03 %) where torch's own peak alone was 46 KB below it (benches/results/gpu_tests.md). Both
logs stamp their entries in microseconds since the Unix epoch, from two clocks (torch's an
approximate one): ``Recording`` brackets torch allocations between a pool acquire and its release,
several times, each bracket bounding the offset between the clocks (``clock_offset``), and
``both_peak`` widens each of the pool's buffers by what the brackets leave uncertain, so that
what the clocks cannot order counts as live at once.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple, Sequence

ACQUIRES = ("hit", "allocate", "allocate_outside")
BRACKETS = 16
"""Torch allocations ``Recording`` makes between a pool acquire and its release, one each."""
TICK_US = 2
"""Each clock's resolution: whole microseconds, torch's through a conversion that rounds."""


class ClockOffset(NamedTuple):
    """Where the pool's clock stands against torch's: add ``offset_us`` to a pool time, and
    torch's time of the same moment is within ``uncertainty_us`` of it."""

    offset_us: int
    uncertainty_us: int


def clock_offset(brackets: Sequence[tuple[int, int, int]]) -> ClockOffset:
    """The offset from brackets of (pool acquire, torch allocation, pool release) times, each
    on its own clock, made in that order: each bounds the offset to between the allocation less
    the release and the allocation less the acquire, and all of them to the bounds' overlap."""
    low = max(alloc - release for _, alloc, release in brackets) - TICK_US
    high = min(alloc - acquire for acquire, alloc, _ in brackets) + TICK_US
    assert low <= high, f"the brackets disagree on the clocks' offset: {brackets}"
    return ClockOffset((low + high) // 2, (high - low + 1) // 2)


def both_peak(trace: Sequence[Mapping], pool_events: Iterable[Mapping], offset_us: int = 0,
              slack_us: int = 0, pool_start_bytes: int = 0) -> int:
    """The highest torch-allocated bytes (from the history's first entry, relative) plus the
    pool's checked-out bytes at the same moment. ``trace``: torch's device trace entries
    (``action``, ``size``, ``time_us``; an allocation counts from ``alloc`` to
    ``free_requested``, as ``torch.cuda.memory_allocated`` does); ``pool_events``: the pool's
    events (``kind``, ``nbytes``, ``time_us``), on torch's clock after adding ``offset_us``;
    ``pool_start_bytes``: the pool's checked-out bytes before its first event. Each acquire
    counts ``slack_us`` early and each release ``slack_us`` late (``Recording``: the clocks'
    uncertainty, ``ClockOffset``)."""
    # (time, order, torch delta, pool delta): at one time, what rises comes first.
    changes = []
    for e in trace:
        if e["action"] == "alloc":
            changes.append((e["time_us"], 0, e["size"], 0))
        elif e["action"] == "free_requested":
            changes.append((e["time_us"], 1, -e["size"], 0))
    for e in pool_events:
        t = e["time_us"] + offset_us
        if e["kind"] in ACQUIRES:
            changes.append((t - slack_us, 0, 0, e["nbytes"]))
        elif e["kind"] == "release":
            changes.append((t + slack_us, 1, 0, -e["nbytes"]))
    changes.sort(key=lambda c: (c[0], c[1]))
    torch_bytes, pool_bytes = 0, pool_start_bytes
    peak = pool_start_bytes
    for _, _, dt, dp in changes:
        torch_bytes += dt
        pool_bytes += dp
        peak = max(peak, torch_bytes + pool_bytes)
    return peak


class Recording:
    """torch's allocation history and ``pool``'s events over a ``with`` block on ``device``, and
    their combined peak (``peak``, after the block)."""

    def __init__(self, device, pool) -> None:
        self.device, self.pool = device, pool
        self.peak: int | None = None
        self.clocks: ClockOffset | None = None

    def __enter__(self) -> "Recording":
        import torch

        torch.cuda.synchronize(self.device)
        # No stacks: torch 2.11's Python stack capture made an autograd Function's ``apply``
        # return NULL in the parent placement's recompute.
        torch.cuda.memory._record_memory_history(max_entries=1 << 20, context=None,
                                                 clear_history=True)
        self.pool.time_events(True)
        self.first_seq = self._next_seq()
        self.start_bytes = self.pool.stats().checked_out_bytes
        for _ in range(BRACKETS):  # the clocks' brackets (``clock_offset``)
            marker = self.pool.acquire((1,), torch.float32)
            torch.empty(1, dtype=torch.uint8, device=self.device)
            self.pool.release(marker)
        return self

    def _next_seq(self) -> int:
        events = self.pool.events()
        return events[-1]["seq"] + 1 if events else 0

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.synchronize(self.device)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.pool.time_events(False)
        if exc[0] is not None:
            return
        trace = snapshot["device_traces"][self.device.index]
        events = [e for e in self.pool.events() if e["seq"] >= self.first_seq]
        assert events and events[0]["seq"] == self.first_seq, "the pool's log dropped events"
        allocs = [e["time_us"] for e in trace if e["action"] == "alloc"][:BRACKETS]
        acquires = [e["time_us"] for e in events if e["kind"] in ACQUIRES][:BRACKETS]
        releases = [e["time_us"] for e in events if e["kind"] == "release"][:BRACKETS]
        self.clocks = clock_offset(list(zip(acquires, allocs, releases)))
        # The brackets' own bytes stay in, for a moment at the start: the peak is no lower.
        self.peak = both_peak(trace, events, self.clocks.offset_us, self.clocks.uncertainty_us,
                              pool_start_bytes=self.start_bytes)

