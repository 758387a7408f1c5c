"""What every rank and every relaunch agree on: the extremes of a few byte counts over the
sharding group (one all-reduce), and byte counts rounded to values that repeat.

[Note: stable agreed memory]
An agreed byte count (the free memory ``zbuf.compile`` plans from, the budget the measured step
grows the plans into) is part of the passes' cache key through the options' digest, and memory
differs from launch to launch by a few megabytes (a context, a library, the page cache, the
allocator's rounding): the exact number would miss Inductor's FX-graph and AOT caches on every
launch. So agreed counts are rounded down (``stable_bytes``) to a multiple of a quantum, a
power of two that is a fixed fraction of the count's leading power of two:
- the free memory to 1/64 (``FREE_MEMORY_BITS``), at least 64 MiB: at most 1.6 % of it, or
  64 MiB below 8 GiB, is left unplanned (1 GiB quanta for 80-140 GB free);
- a measured budget to 1/16 (``MEASURED_BITS``), at most 6 % of it: measured peaks move more
  between launches than free memory does.
What stays correct: the plan assumes at most the memory that was really there (rounding is down,
never up), so it remains feasible. A launch whose count lands in another quantum plans and
compiles afresh, as any different budget must; an explicit ``budget_bytes`` is the user's own
stable number.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["agree_extremes", "stable_bytes", "stable_free_memory", "stable_budget",
           "FREE_MEMORY_BITS", "MEASURED_BITS", "FREE_MEMORY_MIN_QUANTUM"]

FREE_MEMORY_BITS = 6
"""Agreed free memory is rounded to 1/2**6 of its leading power of two."""

FREE_MEMORY_MIN_QUANTUM = 64 << 20
"""Smallest quantum of the agreed free memory."""

MEASURED_BITS = 4
"""A measured budget is rounded to 1/2**4 of its leading power of two."""


def stable_bytes(nbytes: int, *, bits: int, min_quantum: int = 1) -> int:
    """``nbytes`` rounded down to a multiple of ``leading power of two / 2**bits`` (and of at
    least ``min_quantum``); counts at or below ``min_quantum`` are kept as they are (never below
    0). [Note: stable agreed memory]"""
    nbytes = max(0, int(nbytes))
    if nbytes <= min_quantum:
        return nbytes
    quantum = max(min_quantum, 1 << max(0, nbytes.bit_length() - 1 - bits))
    return nbytes // quantum * quantum


def stable_free_memory(nbytes: int) -> int:
    """Agreed free memory, rounded ([Note: stable agreed memory])."""
    return stable_bytes(nbytes, bits=FREE_MEMORY_BITS, min_quantum=FREE_MEMORY_MIN_QUANTUM)


def stable_budget(nbytes: int) -> int:
    """A measured budget, rounded ([Note: stable agreed memory]), at least 1 byte."""
    return max(1, stable_bytes(nbytes, bits=MEASURED_BITS))


def agree_extremes(group: Optional[dist.ProcessGroup], device: torch.device, *,
                   smallest: Sequence[int] = (), largest: Sequence[int] = ()
                   ) -> tuple[list[int], list[int]]:
    """``smallest``'s minimum and ``largest``'s maximum over ``group`` (None: the default group),
    element by element, with one all-reduce; the values themselves when no process group is
    initialised. Every rank of ``group`` must call it at the same point of its program."""
    values = [int(v) for v in smallest] + [-int(v) for v in largest]
    if values and dist.is_available() and dist.is_initialized():
        pg = group if group is not None else dist.group.WORLD
        on = device if dist.get_backend(pg) == "nccl" else "cpu"
        t = torch.tensor(values, dtype=torch.int64, device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pg)
        values = [int(v) for v in t.tolist()]
    n = len(smallest)
    return values[:n], [-v for v in values[n:]]
