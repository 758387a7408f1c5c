"""The host link's speed, measured: what sending activations to host memory costs on this
machine.

[Note: the measured host link]
The offload plan spaces its offloaded blocks by how many block forwards one block's copy takes
([Note: offloaded blocks] in zbuf/compile/block_offload.py). The link's speed is the machine's:
a PCIe 5 x16 link moved 47.6 GB/s each way at once on an H200 (benches/results/offload14.md),
a PCIe 4 link moves about half of that, a GPU behind a shared switch less again. A constant errs
on every machine but one: set too high, the compute stream waits for the copies at every
offloaded block; too low, blocks recompute what the link could have carried (at qwen3-14b a
40 GB/s constant spaced the blocks four apart where the copies were exposed 0.08 ms a step).
So when the plan is first made (or its arenas locked ahead of it: [Note: arenas locked ahead] in
zbuf/compile/block_offload.py), ``measure_host_link`` times, with CUDA events on a stream of its
own, copies of ``PROBE_BYTES`` each way between the device and a page-locked host arena: first
``WARM_COPIES`` untimed each way (the first copy of a range pays for its mapping, and a link
that sat idle through a whole step of compute ramps up), then ``TIMED_COPIES`` timed each way;
a direction's speed is its fastest copy (``LinkSpeed``). One timed copy right after the
measured step read 27.6 GB/s on an H200 whose offloaded blocks' own copies then ran at about 55
GB/s in every step (benches/results/onepath14.md): the plan offloaded 12 blocks where the link
carried 23. The two directions are kept apart because the plan needs them in different places:
the forward's copies go down (device to host) under one block forward each, the uploads come up
under backward, at least twice as long a block ([Note: the copy queue] in
zbuf/compile/recompute_plan.py, ``queue_speed``). With the slower direction taken for both,
the 14B inside placement offloaded 17 blocks instead of 22 on an H100 whose probe read 41.8 GB/s
its slower way (the record did not say which) while the forward's copies then ran at 53.1 GB/s
(0.911x FSDP2's step against 0.892x; benches/results/onepath14.md): the record now gives both.
The re-planner agrees the speed over the ranks (the slowest rank's), so every rank plans the
same blocks. A ``host_link_bytes_per_second`` in the options replaces it. A rank
that cannot hold the probe (the device or the host out of memory) measures 0: every rank then
plans without offload, still through the same agreement (a rank leaving it would hang the
others), and the next plan probes again (the arenas locked ahead probe at the measured step's
output, nearer its peak than the plan after it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .errors import PoolOutOfMemoryError
from .host_arena import HostArena

__all__ = ["LinkSpeed", "PROBE_BYTES", "TIMED_COPIES", "WARM_COPIES", "measure_host_link"]

PROBE_BYTES = 64 << 20
"""Bytes of each timed copy: milliseconds at any PCIe speed, far above a copy's fixed cost."""
WARM_COPIES = 4
"""Untimed copies each way before the timed ones."""
TIMED_COPIES = 4
"""Timed copies each way; the fastest is the direction's speed."""


class LinkSpeed(NamedTuple):
    """``device``'s host link measured each way, bytes per second; 0 both ways where the probe
    did not fit ([Note: the measured host link])."""

    down: float
    """Device to host: the forward's copies of the offloaded blocks."""
    up: float
    """Host to device: backward's uploads of them."""


def measure_host_link(device: torch.device) -> LinkSpeed:
    """``device``'s host link each way ([Note: the measured host link])."""
    stream = torch.cuda.Stream(device)
    try:
        arena = HostArena(PROBE_BYTES, device, (stream,))
        on_device = torch.empty(PROBE_BYTES, dtype=torch.uint8, device=device)
    except (torch.OutOfMemoryError, PoolOutOfMemoryError):
        return LinkSpeed(0.0, 0.0)
    stream.wait_stream(torch.cuda.current_stream(device))
    directions = ((arena.memory, on_device), (on_device, arena.memory))
    timed: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = [[], []]
    with torch.cuda.stream(stream):
        for _ in range(WARM_COPIES):
            for source, target in directions:
                target.copy_(source, non_blocking=True)
        for _ in range(TIMED_COPIES):
            for (source, target), events in zip(directions, timed):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                target.copy_(source, non_blocking=True)
                end.record(stream)
                events.append((start, end))
    stream.synchronize()
    up, down = (PROBE_BYTES / (max(min(s.elapsed_time(e) for s, e in events), 1e-3) / 1e3)
                for events in timed)
    return LinkSpeed(down, up)
