"""Schedule diagnostics: one record per compiled graph, ``schedule_report``, ``ZBUF_LOG=schedule``.

Records are made when a graph is planned (compile time); a graph served from Inductor's FX-graph
cache is not planned again, so its record, embedded in the graph's ``zbuf::check_schedule`` call,
is registered by the graph's first run instead.

[Note: records live with their model]
A model's records are in its ``ScheduleRecords`` (the graphs that gather or reduce its
parameters, and which of them have run once), and nowhere else: two models in one process never
share one. The two places that file a record reach the model only through parameter ids: the
schedule pass sees fake tensors, and a graph served from the cache files its record at its first
run, inside ``zbuf::check_schedule``, which gets nothing but its arguments (ids, unlike objects,
mean the same in the process that compiled a graph and in the one that runs it). So one table is
process-wide, the only one in compile/: ``_OWNERS``, parameter id -> the ``ScheduleRecords`` of
the model that holds the parameter. The backend fills it (``claim``) from the real shard
parameters of every graph Dynamo hands it, with a finalizer on each parameter: an entry goes when
its parameter is freed, and a model's records with its last parameter.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import uuid
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
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
    "ScheduleRecords",
    "schedule_record",
    "schedule_report",
    "claim",
    "records_of",
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
    """Sequence number of recorded graphs, unique in the process and increasing in the order
    they were recorded (assigned by ``record``)."""
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
    gradient_bytes: int = 0
    """Bytes of the gradient shards this graph makes, counted in its activation profile from
    their reduce-scatters on ([Note: gradients live in backward] in budget.py); 0 in a forward
    graph."""
    gathered_weights: tuple[tuple[int, int, int, int], ...] = ()
    """(param id, pool id, gathered bytes, position of the first reader) of each weight the
    graph gathers, once per weight, in the order the graph first reads them: in a backward
    graph, the order backward needs them, which the run-time keep-set is chosen in ([Note:
    weights kept at run time] in zbuf/kept_weights.py)."""
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
        d["gathered_weights"] = tuple(tuple(w) for w in d.get("gathered_weights", ()))
        if d.get("recompute") is not None:
            d["recompute"] = RecomputeStats(**d["recompute"])
        return cls(**d)


def schedule_record(graph: torch.fx.Graph, *, kind: GraphKind, index: GraphIndex,
                    sched: Schedule | None, options: CompileOptions, persistent_bytes: int,
                    activation_profile: np.ndarray, order: list[str], fingerprint: str,
                    checked: bool, recompute: RecomputeStats | None,
                    gradient_bytes: int = 0) -> ScheduleRecord:
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
        gradient_bytes=gradient_bytes,
        gathered_weights=_gathered_weights(index),
        recompute=recompute,
    )


def _gathered_weights(index: GraphIndex) -> tuple[tuple[int, int, int, int], ...]:
    """``ScheduleRecord.gathered_weights`` of a summarized graph."""
    first: dict[int, tuple[int, int, int, int]] = {}
    for spec in sorted(index.summary.gathers, key=lambda g: (g.uses[0], int(g.key))):
        param_id = int(spec.key)
        if param_id not in first:
            first[param_id] = (param_id, spec.pool, spec.nbytes, spec.uses[0])
    return tuple(first.values())


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


@dataclass(eq=False)
class ScheduleRecords:
    """The schedule records of one model's graphs ([Note: records live with their model])."""

    records: list[ScheduleRecord] = field(default_factory=list)
    """In the order they were recorded."""
    uids: set[str] = field(default_factory=set)
    """``uid`` of every kept record: a graph's compile and its first run file one record."""
    summaries: dict[str, GraphSummary] = field(default_factory=dict)
    """uid -> the planner's input, for graphs planned in this process (not for cache hits)."""
    first_runs: set[tuple[str, str, str]] = field(default_factory=set)
    """(group name, fingerprint, record) of the graphs whose first run is done: their pools are
    sized and their record kept (``zbuf::check_schedule``)."""

    def add(self, rec: ScheduleRecord, summary: GraphSummary | None = None) -> None:
        """Keep ``rec`` unless a record of the same graph is already kept."""
        if summary is not None:
            self.summaries[rec.uid] = summary
        if rec.uid in self.uids:
            return
        rec = dataclasses.replace(rec, graph_id=next(_GRAPH_IDS))
        self.uids.add(rec.uid)
        self.records.append(rec)
        _log(rec)


_GRAPH_IDS = itertools.count()  # a source of ids, as shard's parameter ids: no state to share
_OWNERS: dict[int, ScheduleRecords] = {}  # [Note: records live with their model]


def claim(params: Mapping[int, torch.Tensor]) -> ScheduleRecords:
    """The records of the model that holds ``params`` (param id -> shard parameter, those of one
    graph); files the ids not yet known, each until its parameter is freed."""
    known = _owners(params)
    owner = known[0] if known else ScheduleRecords()
    for other in known[1:]:  # graphs of one model seen apart until now (split by graph breaks)
        _absorb(owner, other)
    for param_id, shard in params.items():
        if param_id not in _OWNERS:
            _OWNERS[param_id] = owner
            weakref.finalize(shard, _OWNERS.pop, param_id, None)
    return owner


def records_of(param_id: int) -> ScheduleRecords | None:
    """The records of the model that holds parameter ``param_id`` (None: no graph named it)."""
    return _OWNERS.get(param_id)


def _any_owner(param_ids: Iterable[int]) -> ScheduleRecords | None:
    for param_id in param_ids:
        owner = _OWNERS.get(param_id)
        if owner is not None:
            return owner
    return None


def _owners(param_ids: Iterable[int]) -> list[ScheduleRecords]:
    found: dict[int, ScheduleRecords] = {}
    for param_id in param_ids:
        owner = _OWNERS.get(param_id)
        if owner is not None:
            found.setdefault(id(owner), owner)
    return list(found.values())


def _absorb(owner: ScheduleRecords, other: ScheduleRecords) -> None:
    owner.records = sorted(owner.records + other.records, key=lambda r: r.graph_id)
    owner.uids |= other.uids
    owner.summaries.update(other.summaries)
    owner.first_runs |= other.first_runs
    for param_id, known in list(_OWNERS.items()):
        if known is other:
            _OWNERS[param_id] = owner


def _log(rec: ScheduleRecord) -> None:
    if "schedule" in os.environ.get("ZBUF_LOG", "").split(","):
        path = os.environ.get("ZBUF_LOG_FILE")
        line = rec.to_json() + "\n"
        if path:
            with open(path, "a") as f:
                f.write(line)
        else:
            sys.stderr.write(line)


def graph_summary(rec: ScheduleRecord) -> GraphSummary | None:
    """The planner's input of a recorded graph, to re-plan it under other budgets with
    ``plan_schedule``; None for graphs this process did not plan (served from the cache)."""
    owner = _any_owner(rec.param_ids)
    return owner.summaries.get(rec.uid) if owner is not None else None


def record(rec: ScheduleRecord | str, summary: GraphSummary | None = None) -> ScheduleRecords | None:
    """Keep ``rec`` (or its JSON) with the records of the model whose parameters its graph
    gathers or reduces, unless a record of the same graph is already kept; returns those records.
    A graph that touches no zbuf parameter belongs to no model: its record is only logged
    (``ZBUF_LOG=schedule``), and None is returned."""
    if isinstance(rec, str):
        rec = ScheduleRecord.from_json(rec)
    owner = _any_owner(rec.param_ids)
    if owner is None and rec.param_ids:
        # Parameters no graph handed to the backend named (a pass driven by hand): kept for
        # the process, with no parameter to outlive.
        owner = ScheduleRecords()
        for param_id in rec.param_ids:
            _OWNERS[param_id] = owner
    if owner is None:
        _log(dataclasses.replace(rec, graph_id=next(_GRAPH_IDS)))
        return None
    owner.add(rec, summary)
    return owner


def clear_records() -> None:
    """Forget every model's records (tests); the graphs' first runs stay done."""
    for owner in _owners(_OWNERS):
        owner.records.clear()
        owner.uids.clear()
        owner.summaries.clear()


def _param_ids_of(model: torch.nn.Module) -> set[int]:
    return {int(i) for root in roots(model) for i in root.specs}


def schedule_report(model: torch.nn.Module | None = None) -> list[ScheduleRecord]:
    """Records of the graphs planned for ``model`` (every model's when ``model`` is None), in
    the order they were recorded.

    A graph belongs to a model when it gathers or reduces one of the model's parameters; graphs
    that touch none (e.g. a graph-break fragment with no parameter access) are not kept.
    """
    if model is None:
        owners = _owners(_OWNERS)
        return sorted((r for o in owners for r in o.records), key=lambda r: r.graph_id)
    ids = _param_ids_of(getattr(model, "_orig_mod", model))
    return sorted((r for o in _owners(ids) for r in o.records if ids.intersection(r.param_ids)),
                  key=lambda r: r.graph_id)
