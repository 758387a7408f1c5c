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
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Mapping, Optional

RELEASES = ("segment_unmap", "segment_free")
"""Trace actions that give cached memory back to the device."""
TORCH_FRAMES = ("/torch/", "/site-packages/torch", "<frozen", "contextlib.py")
"""Frames left out of a request's stack: torch's own and Python's plumbing."""
FRAMES_KEPT = 8


def _frames(entry: Mapping[str, Any]) -> list[str]:
    frames = [f for f in entry.get("frames") or []
              if not any(part in f.get("filename", "") for part in TORCH_FRAMES)]
    return [f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"
            for f in frames[:FRAMES_KEPT]]


def retried_requests(trace: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each run of cache releases in ``trace`` (one device's entries of
    ``torch.cuda.memory._snapshot()["device_traces"]``, oldest first) with the allocation after
    it: the request's bytes and stream, what the run released, the bytes allocated beyond the
    trace's start just before the request (allocations less completed frees), and the request's
    own frames (torch's left out). A run that no allocation follows (a release at the trace's
    end: ``empty_cache``) is reported with ``request_bytes`` None."""
    found: list[dict[str, Any]] = []
    net = 0
    released: Optional[dict[str, Any]] = None
    for entry in trace:
        action = entry.get("action")
        size = int(entry.get("size", 0))
        if action in RELEASES:
            if released is None:
                released = {"released_bytes": 0, "releases": 0, "allocated_before_bytes": net,
                            "time_us": entry.get("time_us")}
            released["released_bytes"] += size
            released["releases"] += 1
        elif action == "alloc":
            if released is not None:
                found.append({**released, "request_bytes": size, "stream": entry.get("stream"),
                              "frames": _frames(entry)})
                released = None
            net += size
        elif action == "free_completed":
            net -= size
    if released is not None:
        found.append({**released, "request_bytes": None, "stream": None, "frames": []})
    return found


@contextlib.contextmanager
def recorded(device, max_entries: int = 1_000_000) -> Iterator[dict[str, Any]]:
    """Record the allocation history of the ``with`` body on CUDA ``device``; afterwards the
    yielded dict holds ``entries`` (the trace's length) and ``retried_requests`` of it."""
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
        out["entries"] = len(trace)
        out["retried_requests"] = retried_requests(trace)
