"""Which request made torch's caching allocator retry, read off its allocation history.

A retry (``num_alloc_retries``) is a request the allocator could serve only after freeing its
whole cache: under expandable segments it unmaps every free page and maps the request's pages
again. The step rows say in which phase a step retried (``StepPhases.retries``); this says at
which request: the step is recorded with ``torch.cuda.memory._record_memory_history``, and each
run of cache releases (``segment_unmap`` under expandable segments, ``segment_free`` otherwise)
in its trace is followed by the allocation that asked for it. qwen3-32b as rank 0 of 8 retried
once in each backward of steps 1-9 (benches/results/onepath32b.md), and the rows could not say
at which allocation.

``python3 benches/plain_setup.py ... --trace-step N`` records step ``N`` of each variant and puts
``retried_requests`` of it in the record (``allocator_trace``).

[Note: the room at a retry]
Which request retried does not say why it found no room. At qwen3-32b the request was the user's
fp32 logits, 9.27 GiB, with 24.8 GB of torch's cache free in 22 ranges and none of them large
enough (benches/results/onepath32b.md); emptying the cache at the step boundary left the same
retry (15.4 GB free in 12 ranges by the loss), so what splits the room is laid out within the
step. So each retried request also gets the device's layout just before its releases
(``layouts_at_retries``): the step's last snapshot (torch's segments, one per mapped range under
expandable segments, and their live blocks) rewound through the trace's events after that
moment (an allocation undone frees its range, a completed free undone makes it live again with
the frames of the allocation that made it, a mapping undone unmaps). It says how much was
mapped, live and free, the largest free ranges with the live block on each side of them (or
the mapped range's end, beyond which torch may map more pages to grow the range), and the live
blocks that split the free room (free memory on both sides in the same mapped range), by the
site that allocated them (blocks older than the trace have no site), each site with the
largest free range there would be were all its blocks elsewhere (whether moving that site's
allocations would give the request its room) and the most it held at once over the trace (what
memory of its own, a ``torch.cuda.MemPool`` say, would keep from every other allocation all
step).

At qwen3-32b the first reading gave three free ranges of 6.6-7.6 GB with block outputs between
them (benches/results/onepath32b.md), not which ranges they bound nor what stood at the mapped
ends, where a range grows without a retry: so each large range names its two neighbours.

A reading is one question; the next one should not cost a GPU call. So ``recorded`` can also
keep the history itself (``save_history``: the trace and the segments, each frame list cut to
the frames outside torch, gzipped), and ``python3 benches/allocator_retries.py HISTORY`` reads
the retries and their layouts off a kept one on any machine.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import sys
from typing import Any, Iterator, Mapping, Optional, Sequence

RELEASES = ("segment_unmap", "segment_free")
"""Trace actions that give cached memory back to the device."""
TORCH_FRAMES = ("/torch/", "/site-packages/torch", "<frozen", "contextlib.py")
"""Frames left out of a request's stack: torch's own and Python's plumbing."""
FRAMES_KEPT = 8


def _outside_torch(frames: Optional[Sequence[Mapping[str, Any]]]) -> list[Mapping[str, Any]]:
    return [f for f in frames or []
            if not any(part in f.get("filename", "") for part in TORCH_FRAMES)][:FRAMES_KEPT]


def _frames(entry: Mapping[str, Any]) -> list[str]:
    return [f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"
            for f in _outside_torch(entry.get("frames"))]


def _release_runs(trace: Sequence[Mapping[str, Any]]) -> list[tuple[int, Optional[int]]]:
    """Each run of cache releases in ``trace``: the index of its first release and of the
    allocation that ends it (None where none does: a release at the trace's end)."""
    runs: list[tuple[int, Optional[int]]] = []
    start: Optional[int] = None
    for i, entry in enumerate(trace):
        action = entry.get("action")
        if action in RELEASES and start is None:
            start = i
        elif action == "alloc" and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, None))
    return runs


def retried_requests(trace: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each run of cache releases in ``trace`` (one device's entries of
    ``torch.cuda.memory._snapshot()["device_traces"]``, oldest first) with the allocation after
    it: the request's bytes and stream, what the run released, the bytes allocated beyond the
    trace's start just before the request (allocations less completed frees), and the request's
    own frames (torch's left out). A run that no allocation follows (a release at the trace's
    end: ``empty_cache``) is reported with ``request_bytes`` None."""
    net_before = []  # bytes allocated beyond the trace's start before each entry
    net = 0
    for entry in trace:
        net_before.append(net)
        action = entry.get("action")
        if action == "alloc":
            net += int(entry.get("size", 0))
        elif action == "free_completed":
            net -= int(entry.get("size", 0))
    found: list[dict[str, Any]] = []
    for start, end in _release_runs(trace):
        released = [int(e.get("size", 0)) for e in trace[start:end]
                    if e.get("action") in RELEASES]
        request = trace[end] if end is not None else None
        found.append({"released_bytes": sum(released), "releases": len(released),
                      "allocated_before_bytes": net_before[start],
                      "time_us": trace[start].get("time_us"),
                      "request_bytes": None if request is None else int(request.get("size", 0)),
                      "stream": None if request is None else request.get("stream"),
                      "frames": [] if request is None else _frames(request)})
    return found


MAPS = {"segment_map": True, "segment_alloc": True, "segment_unmap": False, "segment_free": False}
"""Trace actions that map device memory into torch's cache (True) or give it back (False)."""
LARGEST_KEPT = 5
"""Free ranges reported per layout, largest first, each with the live block below and above it
(None: the end of its mapped range)."""
SITES_KEPT = 8
"""Sites of the live blocks that split the free room reported per layout, most bytes first."""
BEFORE_THE_TRACE = "before the trace"


def _site(frames: Optional[list]) -> str:
    """The allocating site of a block: its first frame outside torch, or ``BEFORE_THE_TRACE``."""
    if frames is None:
        return BEFORE_THE_TRACE
    kept = _frames({"frames": frames})
    return kept[0] if kept else "torch"


def _without(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """``ranges`` (disjoint ``(start, end)``) less ``[start, end)``."""
    out = []
    for a, b in ranges:
        if b <= start or a >= end:
            out.append((a, b))
            continue
        if a < start:
            out.append((a, start))
        if b > end:
            out.append((end, b))
    return out


def _layout(mapped: list[tuple[int, int]], live: Mapping[int, tuple[int, Optional[list]]],
            held: Optional[Mapping[str, int]] = None) -> dict[str, Any]:
    """Mapped, live and free bytes, the largest free ranges and the sites of the live blocks that
    split the free room ([Note: the room at a retry]); ``held``: the most each site held at
    once over the trace, for those sites."""
    blocks = sorted((addr, addr + size, frames) for addr, (size, frames) in live.items())
    merged: list[list[int]] = []  # mapped ranges, touching ones joined (one segment's pages)
    for start, end in sorted(mapped):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    free: list[tuple[int, Optional[dict], Optional[dict]]] = []  # bytes, below, above
    islands: dict[str, list[int]] = {}
    ranges: list[tuple[list[int], list[tuple[str, int]]]] = []  # each range's gaps and blocks
    i = 0
    for start, end in merged:
        while i < len(blocks) and blocks[i][0] < start:
            i += 1
        inside = []
        while i < len(blocks) and blocks[i][1] <= end:
            inside.append(blocks[i])
            i += 1
        cursor, gaps = start, []
        for a, b, _ in inside:
            gaps.append(a - cursor)
            cursor = b
        gaps.append(end - cursor)
        owners = [(_site(frames), b - a) for a, b, frames in inside]
        ranges.append((gaps, owners))
        # A neighbour of gap k: the block below it and the one above, None at the mapped ends.
        sides = [None] + [{"site": site, "bytes": size} for site, size in owners] + [None]
        free += [(g, sides[k], sides[k + 1]) for k, g in enumerate(gaps) if g > 0]
        for k, (site, size) in enumerate(owners):
            if gaps[k] > 0 and gaps[k + 1] > 0:
                island = islands.setdefault(site, [0, 0])
                island[0] += size
                island[1] += 1
    mapped_bytes = sum(b - a for a, b in mapped)
    live_bytes = sum(size for size, _ in live.values())
    largest = sorted(free, key=lambda gap: -gap[0])[:LARGEST_KEPT]
    return {"mapped_bytes": mapped_bytes, "live_bytes": live_bytes,
            "free_bytes": sum(g for g, _, _ in free), "free_ranges": len(free),
            "largest_free": [{"bytes": g, "below": below, "above": above}
                             for g, below, above in largest],
            "islands": [{"site": site, "bytes": n, "blocks": count,
                         "largest_free_without": _largest_without(ranges, site),
                         "held_at_most_bytes": (held or {}).get(site)}
                        for site, (n, count)
                        in sorted(islands.items(), key=lambda kv: -kv[1][0])[:SITES_KEPT]]}


def _largest_without(ranges: Sequence[tuple[list[int], list[tuple[str, int]]]],
                     site: str) -> int:
    """The largest free range were every live block of ``site`` free too: what moving that
    site's allocations out of the way would give the request ([Note: the room at a retry])."""
    largest = 0
    for gaps, inside in ranges:
        run = gaps[0]
        for k, (owner, size) in enumerate(inside):
            if owner == site:
                run += size + gaps[k + 1]
            else:
                largest, run = max(largest, run), gaps[k + 1]
        largest = max(largest, run)
    return largest


def layouts_at_retries(trace: Sequence[Mapping[str, Any]],
                       segments: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The layout just before each run of releases that ``retried_requests`` reports, in its
    order: ``segments`` (``torch.cuda.memory._snapshot()["segments"]`` of the trace's device,
    taken after the trace's last entry) rewound through ``trace`` ([Note: the room at a
    retry])."""
    # Which allocation made the block each completed free gives back (its frames), by a pass
    # forward: None where the block is older than the trace.
    # On the way, the most each site held at once: what memory of its own would have to hold.
    made_by: dict[int, Optional[list]] = {}
    open_allocs: dict[int, list] = {}
    holding: dict[str, int] = {}
    held: dict[str, int] = {}
    for i, entry in enumerate(trace):
        action, addr, size = entry.get("action"), entry.get("addr"), int(entry.get("size", 0))
        if action == "alloc":
            open_allocs[addr] = entry.get("frames") or []
            site = _site(open_allocs[addr])
            holding[site] = holding.get(site, 0) + size
            held[site] = max(held.get(site, 0), holding[site])
        elif action == "free_completed":
            made_by[i] = open_allocs.pop(addr, None)
            if made_by[i] is not None:
                site = _site(made_by[i])
                holding[site] -= size
    mapped = [(int(seg["address"]), int(seg["address"]) + int(seg["total_size"]))
              for seg in segments]
    live = {int(blk["address"]): (int(blk["size"]), blk.get("frames") or None)
            for seg in segments for blk in seg.get("blocks") or []
            if blk.get("state") in ("active_allocated", "active_pending_free")}
    # Blocks alive at the end whose allocation is in the trace carry its frames.
    for addr, frames in open_allocs.items():
        if addr in live:
            live[addr] = (live[addr][0], frames)
    layouts: list[dict[str, Any]] = []
    i = len(trace)
    for start, _ in reversed(_release_runs(trace)):
        while i > start:
            i -= 1
            entry = trace[i]
            action, addr, size = entry.get("action"), entry.get("addr"), int(entry.get("size", 0))
            if action == "alloc":
                live.pop(addr, None)
            elif action == "free_completed":
                live[addr] = (size, made_by.get(i))
            elif action in MAPS:
                mapped = _without(mapped, addr, addr + size)
                if not MAPS[action]:
                    mapped.append((addr, addr + size))
        layouts.append(_layout(mapped, live, held))
    return layouts[::-1]


TRACE_KEYS = ("action", "addr", "size", "stream", "time_us")
BLOCK_KEYS = ("address", "size", "state")


def save_history(path: str, trace: Sequence[Mapping[str, Any]],
                 segments: Sequence[Mapping[str, Any]]) -> None:
    """Keep ``trace`` and ``segments`` (as ``layouts_at_retries`` takes them) in ``path``, gzipped
    JSON: what the readings here use of them, frames cut to those outside torch."""
    def cut(item: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
        kept = {k: item[k] for k in keys if k in item}
        if item.get("frames") is not None:
            kept["frames"] = [{k: f.get(k) for k in ("filename", "line", "name")}
                              for f in _outside_torch(item["frames"])]
        return kept

    history = {"trace": [cut(e, TRACE_KEYS) for e in trace],
               "segments": [{"address": seg["address"], "total_size": seg["total_size"],
                             "blocks": [cut(b, BLOCK_KEYS) for b in seg.get("blocks") or []]}
                            for seg in segments]}
    with gzip.open(path, "wt") as f:
        json.dump(history, f)


def load_history(path: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trace and segments ``save_history`` kept in ``path``."""
    with gzip.open(path, "rt") as f:
        history = json.load(f)
    return history["trace"], history["segments"]


def retries_and_layouts(trace: Sequence[Mapping[str, Any]],
         segments: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each retried request of ``trace`` with the layout just before it."""
    return [{**found, "layout": layout}
            for found, layout in zip(retried_requests(trace), layouts_at_retries(trace, segments))]


@contextlib.contextmanager
def recorded(device, max_entries: int = 1_000_000,
             history: Optional[str] = None) -> Iterator[dict[str, Any]]:
    """Record the allocation history of the ``with`` body on CUDA ``device``; afterwards the
    yielded dict holds ``entries`` (the trace's length) and ``retried_requests`` of it, each with
    its layout; ``history``: a path to keep the history in as well (``save_history``)."""
    import torch

    out: dict[str, Any] = {}
    torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python",
                                             max_entries=max_entries, clear_history=True)
    try:
        yield out
    finally:
        snapshot = torch.cuda.memory._snapshot(device)
        torch.cuda.memory._record_memory_history(None)
        traces = snapshot.get("device_traces") or []
        trace = traces[device.index] if device.index is not None and device.index < len(traces) \
            else []
        segments = [seg for seg in snapshot.get("segments") or []
                    if seg.get("device") == device.index]
        out["entries"] = len(trace)
        out["retried_requests"] = retries_and_layouts(trace, segments)
        if history is not None:
            save_history(history, trace, segments)
            out["history"] = history


if __name__ == "__main__":  # python3 benches/allocator_retries.py HISTORY.json.gz
    json.dump(retries_and_layouts(*load_history(sys.argv[1])), sys.stdout, indent=1)
    print()
