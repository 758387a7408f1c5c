"""``--profile-dir``: a torch.profiler trace of extra steps and a summary of where the GPU waits.

[Note: profiled steps]
Profiling slows the host and the device, so it never touches the measured steps: after the last
measured step every rank runs ``PROFILED_STEPS`` more steps under ``torch.profiler`` (their
times and losses are not recorded). Each rank writes its gzipped Chrome trace and a JSON summary
to the profile directory.

[Note: exposed communication]
Overlap is judged from the device timeline alone. Over the profiled steps' span: ``busy`` is the
union of every kernel and copy interval; ``compute`` the union of the non-NCCL ones; ``comm``
the union of NCCL kernels; ``exposed_comm`` the time an NCCL kernel runs while no compute kernel
does (the part of communication that the step waits for, assuming the compute would have run
back to back); ``idle`` the span minus ``busy`` (host-bound or waiting on a host sync).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["PROFILED_STEPS", "StepProfiler", "summarize_trace", "kernel_family",
           "DEVICE_CATEGORIES"]

PROFILED_STEPS = 2
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""A Chrome trace's categories of work that runs on the device."""
NAME_CHARS = 200
"""How much of a kernel's name the summary's named list keeps: a family (``kernel_family``) can
hide which copy or elementwise functor took the time, and the template arguments say it."""


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union ``a`` outside the union ``b`` (both sorted, disjoint)."""
    total, j = 0.0, 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < end:
            total += end - cur
    return total


def kernel_family(name: str) -> str:
    """A short, stable label for a kernel (Triton names carry per-graph suffixes)."""
    low = name.lower()
    if "nccl" in low:
        for op in ("AllGather", "ReduceScatter", "AllReduce", "Broadcast", "SendRecv"):
            if op.lower() in low:
                return f"nccl:{op}"
        return "nccl:other"
    if low.startswith("triton"):
        return "triton:" + ("red" if "red" in low.split("_")[1:2] else "fused")
    if "gemm" in low or "sm90" in low or "cutlass" in low or "nvjet" in low:
        return "gemm"
    if "flash" in low or "fmha" in low or "attention" in low:
        return "attention"
    if "memcpy" in low or "memset" in low:
        return "copy"
    return name.split("<")[0].split("(")[0][:60]


def summarize_trace(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Device-time summary of a Chrome trace's events (see [Note: exposed communication])."""
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
              and "dur" in e]
    if not device:
        return {"error": "no device events in the trace (CPU run, or the profiler saw no CUDA)"}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device]
    is_comm = ["nccl" in e.get("name", "").lower() for e in device]
    busy = _union(spans)
    compute = _union(s for s, c in zip(spans, is_comm) if not c)
    comm = _union(s for s, c in zip(spans, is_comm) if c)
    first, last = busy[0][0], busy[-1][1]
    span = last - first
    ms = 1e-3 / steps
    return {
        "profiled_steps": steps,
        "span_ms_per_step": span * ms,
        "busy_ms_per_step": _length(busy) * ms,
        "compute_ms_per_step": _length(compute) * ms,
        "comm_ms_per_step": _length(comm) * ms,
        "exposed_comm_ms_per_step": _minus(comm, compute) * ms,
        "idle_ms_per_step": (span - _length(busy)) * ms,
        "kernels_per_step": len(device) / steps,
        "top_kernels_ms_per_step": _top(device, kernel_family, 20, steps),
        "top_named_kernels_ms_per_step": _top(device, lambda name: name[:NAME_CHARS], 30, steps),
    }


def _top(device: list[dict[str, Any]], label: Callable[[str], str], n: int,
         steps: int) -> list[dict[str, Any]]:
    """The ``n`` labels whose kernels took the most device time, per step."""
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for e in device:
        key = label(e.get("name", ""))
        seconds[key] += float(e["dur"])
        calls[key] += 1
    top = sorted(seconds.items(), key=lambda kv: -kv[1])[:n]
    return [{"kernel": k, "ms": v * 1e-3 / steps, "calls": calls[k] / steps} for k, v in top]


class StepProfiler:
    """Profiles ``PROFILED_STEPS`` extra steps on every rank (see [Note: profiled steps])."""

    def __init__(self, out_dir: str, engine: str, rank: int):
        self.out_dir = out_dir
        self.engine = engine
        self.rank = rank
        self._prof: Optional[torch.profiler.profile] = None

    def __enter__(self) -> "StepProfiler":
        os.makedirs(self.out_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=False)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        assert self._prof is not None
        self._prof.__exit__(*exc)
        if exc[0] is not None:
            return
        stem = os.path.join(self.out_dir, f"{self.engine}_rank{self.rank}")
        raw = stem + ".trace.json"
        self._prof.export_chrome_trace(raw)
        with open(raw) as f:
            events = json.load(f).get("traceEvents", [])
        summary = summarize_trace(events, PROFILED_STEPS)
        summary.update(engine=self.engine, rank=self.rank)
        with open(stem + ".summary.json", "w") as f:
            json.dump(summary, f, indent=1)
        with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(raw)
