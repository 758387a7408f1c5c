"""Schedule diagnostics: one record per compiled graph, ``schedule_report``, ``ZBUF_LOG=schedule``.

Records are made when a graph is planned (compile time); a graph served from Inductor's FX-graph
cache is not planned again, so its record, embedded in the graph's ``zbuf::check_schedule`` call,
is registered by the graph's first run instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.fx

from ..shard import roots
from .graph_info import GraphIndex
from .graph_model import GraphSummary
from .options import CompileOptions
from .recompute import RecomputeStats
from .schedule import Schedule, exposed_seconds

__all__ = [
    "ScheduleRecord",
    "schedule_record",
    "schedule_report",
    "record",
    "clear_records",
    "graph_summary",
    "downsample_peaks",
    "PROFILE_POINTS",
]

GraphKind = Literal["forward", "backward", "inference"]


@dataclass(frozen=True)
class ScheduleRecord:
    graph_id: int
    """Process-wide sequence number of recorded graphs (assigned by ``record``)."""
    uid: str
    """Identity of the compiled graph: the record made at compile time and the one its first
    run registers (for graphs served from Inductor's cache) are the same record."""
    kind: GraphKind
    budget_bytes: int
    """The budget planned against (the request raised to the feasible floor if needed)."""
    requested_budget_bytes: int
    floor_bytes: int
    peak_live_gathered_bytes: int
    persistent_bytes: int
    """Gathered bytes kept from forward to backward (counted against this graph's budget)."""
    activation_peak_bytes: int
    gathers: int
    collectives: int
    coalesced_groups: int
    prefetched: int
    regathers: int
    persistent: int
    fingerprint: str
    planning_seconds: float
    num_nodes: int
    param_ids: tuple[int, ...]
    gather_calls: int
    """Gathered buffers filled per run of this graph (coalesced members and re-gathers count)."""
    op_order: tuple[str, ...] = dataclasses.field(repr=False)
    """The zbuf ops of the rewritten graph in planned order (``gather_buffer``, ``all_gather_start``,
    ``all_gather_wait``, ``all_gather_release``, ``reduce_scatter_start``, ...), for checking that the
    compiled code kept it."""
    live_gathered_profile: tuple[int, ...] = dataclasses.field(default=(), repr=False)
    """Planned live gathered bytes per graph node, in graph order before the rewrite (the
    planner's profile, [Note: live gathered bytes]; never above ``budget_bytes``; gathers kept
    from forward are not in a backward profile, they come off its budget). Down-sampled by
    ``downsample_peaks`` to at most ``PROFILE_POINTS`` entries (all zero when nothing is gathered;
    empty only in records written before the field existed)."""
    activation_profile: tuple[int, ...] = dataclasses.field(default=(), repr=False)
    """Projected bytes of non-gathered tensors alive at each node of the same graph (static
    liveness, ``graph_info.activation_profile``; its peak is ``activation_peak_bytes``),
    down-sampled like ``live_gathered_profile`` (the two always have the same length)."""
    modelled_compute_seconds: float = 0.0
    """The graph's compute time under the planner's cost model (``CompileOptions`` rates)."""
    modelled_exposed_seconds: float = 0.0
    """Gather time the compute stream would wait for under the same model
    (``schedule.exposed_seconds``, [Note: modelled exposure]); 0 when every gather is hidden."""
    recompute: RecomputeStats | None = None
    """What the forward/backward pair of this graph kept for backward and what backward
    recomputes, in bytes and FLOPs, and the recompute mode's decisions (the same in both graphs'
    records; None in records written before the field existed)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ScheduleRecord":
        d = json.loads(text)
        d["param_ids"] = tuple(d["param_ids"])
        d["op_order"] = tuple(d["op_order"])
        for name in ("live_gathered_profile", "activation_profile"):
            d[name] = tuple(d.get(name, ()))
        if d.get("recompute") is not None:
            d["recompute"] = RecomputeStats(**d["recompute"])
        return cls(**d)


def schedule_record(graph: torch.fx.Graph, *, kind: GraphKind, index: GraphIndex,
                    sched: Schedule | None, options: CompileOptions, persistent_bytes: int,
                    activation_profile: np.ndarray, order: list[str], fingerprint: str,
                    checked: bool, recompute: RecomputeStats | None) -> ScheduleRecord:
    """The record of a graph the schedule pass just rewrote (``sched``: None when it gathers
    nothing; ``checked``: the graph starts with ``zbuf::check_schedule``)."""
    zbuf = torch.ops.zbuf
    zbuf_ops = tuple(
        n.target._schema.name.split("::")[-1]
        for n in graph.nodes
        if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "zbuf"
    )
    return ScheduleRecord(
        graph_id=-1,
        uid=uuid.uuid4().hex,
        kind=kind,
        budget_bytes=sched.budget_bytes if sched else 0,
        requested_budget_bytes=sched.requested_budget_bytes if sched else 0,
        floor_bytes=sched.floor_bytes if sched else 0,
        peak_live_gathered_bytes=sched.peak_live_bytes if sched else 0,
        persistent_bytes=persistent_bytes,
        activation_peak_bytes=int(activation_profile.max()) if len(activation_profile) else 0,
        gathers=len(index.gathers),
        collectives=len(order),
        coalesced_groups=sched.coalesced_groups if sched else 0,
        prefetched=sched.prefetched if sched else 0,
        regathers=sched.regathers if sched else 0,
        persistent=sum(g.escapes for g in index.summary.gathers),
        fingerprint=fingerprint,
        planning_seconds=sched.planning_seconds if sched else 0.0,
        num_nodes=index.summary.num_nodes,
        # Gathered or reduced: a backward whose weights were all kept from forward gathers
        # nothing, and is still the model's graph.
        param_ids=tuple(sorted({int(g.args[1]) for g in index.gathers} | {
            int(n.args[2]) for n in graph.nodes if n.target is zbuf.reduce_scatter_start.default})),
        gather_calls=sum(len(f.members) for f in sched.fetches) if sched else 0,
        op_order=(("check_schedule",) if checked else ()) + zbuf_ops,
        live_gathered_profile=downsample_peaks(sched.profile if sched else [0] * len(activation_profile)),
        activation_profile=downsample_peaks(activation_profile),
        modelled_compute_seconds=float(sum(index.summary.compute_seconds)),
        modelled_exposed_seconds=exposed_seconds(index.summary, sched, options) if sched else 0.0,
        recompute=recompute,
    )


PROFILE_POINTS = 2000
"""Most entries a record's per-node profile keeps (large graphs have 10^4-10^5 nodes)."""


def downsample_peaks(values, points: int = PROFILE_POINTS) -> tuple[int, ...]:
    """``values`` as plain ints, cut into at most ``points`` consecutive equal-as-possible runs,
    each kept as its maximum: peaks survive, so a down-sampled profile still shows whether the
    budget held. Shorter inputs come back unchanged."""
    arr = np.asarray(values, dtype=np.int64).reshape(-1)
    if arr.size > points:
        # Run i covers [bounds[i], bounds[i + 1]); every run is non-empty since size > points.
        bounds = (np.arange(points) * arr.size) // points
        arr = np.maximum.reduceat(arr, bounds)
    return tuple(int(v) for v in arr)


_RECORDS: list[ScheduleRecord] = []
_UIDS: set[str] = set()
# uid -> the planner's input for graphs planned in this process (not for cache hits).
_SUMMARIES: dict[str, GraphSummary] = {}


def graph_summary(rec: ScheduleRecord) -> GraphSummary | None:
    """The planner's input of a recorded graph, to re-plan it under other budgets with
    ``plan_schedule``; None for graphs this process did not plan (served from the cache)."""
    return _SUMMARIES.get(rec.uid)


def record(rec: ScheduleRecord | str, summary: GraphSummary | None = None) -> None:
    """Keep ``rec`` (or its JSON) unless a record of the same graph is already kept."""
    if isinstance(rec, str):
        rec = ScheduleRecord.from_json(rec)
    if summary is not None:
        _SUMMARIES[rec.uid] = summary
    if rec.uid in _UIDS:
        return
    rec = dataclasses.replace(rec, graph_id=len(_RECORDS))
    _UIDS.add(rec.uid)
    _RECORDS.append(rec)
    if "schedule" in os.environ.get("ZBUF_LOG", "").split(","):
        path = os.environ.get("ZBUF_LOG_FILE")
        line = rec.to_json() + "\n"
        if path:
            with open(path, "a") as f:
                f.write(line)
        else:
            sys.stderr.write(line)


def clear_records() -> None:
    _RECORDS.clear()
    _UIDS.clear()
    _SUMMARIES.clear()


def _param_ids_of(model: torch.nn.Module) -> set[int]:
    return {int(i) for root in roots(model) for i in root.specs}


def schedule_report(model: torch.nn.Module | None = None) -> list[ScheduleRecord]:
    """Records of the graphs planned for ``model`` (all records when ``model`` is None).

    A graph belongs to a model when it gathers one of the model's parameters; graphs that gather
    nothing (e.g. a graph-break fragment with no parameter access) are not attributed.
    """
    if model is None:
        return list(_RECORDS)
    ids = _param_ids_of(getattr(model, "_orig_mod", model))
    return [r for r in _RECORDS if ids.intersection(r.param_ids)]
