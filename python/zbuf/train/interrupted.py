"""The record of a run that stopped: every rank's steps, joined by the launcher.

[Note: every rank's stopped steps]
A stopped run's ranks cannot gather their rows with a collective (their peers are stopping
too), and rank 0's record alone would hold one entry of ``per_rank``, one allocator-retry value
for 2 ranks in the summary. So each rank writes the
steps it finished beside rank 0's partial record (``rank_path``), and the launcher joins them
the way ``loop`` combines the rows of a finished run: a step's time and memory are the largest
over the ranks, its per-rank fields (lists indexed by rank) hold every rank's value, and only
the steps every rank finished are kept (the loss of a step is already the mean over ranks). A
rank that left no file (killed before it could write) is left out, and the per-rank entries say
which ranks the record holds.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

__all__ = ["rank_path", "read_stopped"]

_LARGEST = ("time_s", "device_bytes", "peak_device_bytes", "pool_bytes")
"""Step fields that are the largest over the ranks (``loop._combine``)."""


def rank_path(path: str, rank: int) -> str:
    """Where ``rank`` writes its partial record of a stopped run whose rank 0 writes ``path``."""
    return path if rank == 0 else f"{path}.rank{rank}"


def read_stopped(path: str, world: int) -> Optional[dict[str, Any]]:
    """Rank 0's partial record at ``path`` with the other ranks' steps of its last run joined
    in ([Note: every rank's stopped steps]); None when rank 0 wrote none."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        partial = json.load(f)
    runs = {0: partial["engines"][-1]}
    for rank in range(1, world):
        other = rank_path(path, rank)
        if os.path.exists(other):
            with open(other) as f:
                runs[rank] = json.load(f)["engines"][-1]
    partial["engines"][-1] = _joined(runs)
    return partial


def _joined(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One run's result from each rank's own (rank -> result), as ``loop._combine`` would have
    made it from every rank's rows."""
    ranks = sorted(runs)
    result = dict(runs[0])
    n = min(len(runs[r]["steps"]) for r in ranks)
    steps = []
    for i in range(n):
        col = [runs[r]["steps"][i] for r in ranks]
        step = dict(col[0])
        for key, value in col[0].items():
            if key in _LARGEST:
                step[key] = max(c[key] for c in col)
            elif isinstance(value, list):  # a per-rank field
                step[key] = [v for c in col for v in c[key]]
        steps.append(step)
    result["steps"] = steps
    result["per_rank"] = [dict(entry, rank=r) for r in ranks for entry in runs[r]["per_rank"]]
    return result
