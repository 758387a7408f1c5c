"""zbuf's device memory at each moment of a CUDA run: torch's allocations (its allocation history,
``torch.cuda.memory._record_memory_history``) and the gather pool's buffers (its event log), laid
on one clock.

The sum of the two peaks counts both at once whether or not they coincide; at the user's SDPA
decoder in tests/gpu/test_user_checkpointing_gpu.py that sum came out 20 KB above FSDP2's peak
(0.03 %) where torch's own peak alone was 46 KB below it (benches/results/gpu_tests.md). Both
logs stamp their entries in microseconds since the Unix epoch (torch from an approximate clock):
``Recording`` calibrates the offset between them with a pool acquire and a torch allocation made
back to back, and ``both_peak`` widens each of the pool's buffers by ``slack_us`` on either side,
so that what the clocks cannot order counts as live at once.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

ACQUIRES = ("hit", "allocate", "allocate_outside")
SLACK_US = 50
"""How far apart on the two clocks an acquire or a release and a torch allocation may be taken
to be at once: the calibration's own gap (one acquire, one allocation) and torch's clock's."""


def both_peak(trace: Sequence[Mapping], pool_events: Iterable[Mapping], offset_us: int = 0,
              slack_us: int = SLACK_US, pool_start_bytes: int = 0) -> int:
    """The highest torch-allocated bytes (from the history's first entry, relative) plus the
    pool's checked-out bytes at the same moment. ``trace``: torch's device trace entries
    (``action``, ``size``, ``time_us``; an allocation counts from ``alloc`` to
    ``free_requested``, as ``torch.cuda.memory_allocated`` does); ``pool_events``: the pool's
    events (``kind``, ``nbytes``, ``time_us``), on torch's clock after adding ``offset_us``;
    ``pool_start_bytes``: the pool's checked-out bytes before its first event. Each acquire
    counts ``slack_us`` early and each release ``slack_us`` late."""
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

    def __enter__(self) -> "Recording":
        import torch

        torch.cuda.synchronize(self.device)
        torch.cuda.memory._record_memory_history(max_entries=1 << 20, context=None,
                                                 clear_history=True)
        self.pool.time_events(True)
        self.first_seq = self._next_seq()
        self.start_bytes = self.pool.stats().checked_out_bytes
        # The clocks' calibration: an acquire of the pool's, then a torch allocation.
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
        marker = next(e for e in trace if e["action"] == "alloc")
        # The markers' own bytes stay in, for a moment at the start: the peak is no lower.
        self.peak = both_peak(trace, events, marker["time_us"] - events[0]["time_us"],
                              pool_start_bytes=self.start_bytes)
