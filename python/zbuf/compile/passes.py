"""The FX passes of the zbuf backend, as Inductor custom-pass objects (also used by aot_eager).

``ZbufPartitioner`` (joint graph, before partitioning): tags every gather and its view/cast users
``MUST_RECOMPUTE`` so backward re-gathers instead of saving full weights, except the gathers
selective persistence keeps (``MUST_SAVE``), then runs ``min_cut_rematerialization_partition``.
``GatherSchedulePass`` (forward and backward graphs, post-grad): plans (schedule.py) and rewrites
each ``zbuf::all_gather`` into start / wait / release and each ``zbuf::reduce_scatter`` into its
ordered form (collectives.py), threading the schedule token through all of them ([Note: schedule
token]), and adds the first-run rank check ([Note: collective order check]).

[Note: pass uuid]
Inductor's FX-graph cache skips the passes on a hit, so a pass's ``uuid`` must change whenever its
output could: it hashes this package's compile sources (and ops.py, param.py, runtime.py), the options, the
planning input that is not in the graph (the agreed free memory; the world size shows in the shard
shapes), and torch's version.

[Note: selective persistence]
A gathered weight that backward reads (``grad_input = grad_out @ W``) is either re-gathered in
backward (one more collective) or kept from forward (its bytes stay live through the end of
forward and backward). Candidates are kept, while they fit in ``persist_fraction`` of the
budget (never eating into what a single node needs at once), in this order:
1. latency-bound gathers (below ``collective_latency_seconds * link_bytes_per_second`` bytes):
   the communication time saved per byte, ``latency / bytes + 1 / bandwidth``, is highest there;
2. then in the order backward needs them. What backward needs first has no backward compute to
   hide behind: on the qwen3-8b fake trace the old order, smallest first, kept the early layers
   and re-gathered the output head and the last layers' MLP weights, all needed at the very
   start of backward (the likely source of 25 ms per step of exposed backward gathers on 2x
   H200). Weights needed late are re-gathered behind the backward of the layers after them, and
   kept weights that backward needs early are released early, freeing their memory sooner.
Kept bytes are charged to the backward graph's budget as live throughout. Candidates are the
gathers with a backward consumer in the joint graph, or a consumer that activation
checkpointing tags for recompute (backward re-runs it, so it needs the weight again). A gather
that backward re-runs only because the partitioner itself chose to recompute a cheap consumer
(an embedding lookup, say) is not known before partitioning and is re-gathered.
"""

from __future__ import annotations

import hashlib
import operator
import json
import os
import uuid
from typing import Any, Sequence

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn
from torch.profiler import record_function
from torch.utils.checkpoint import CheckpointPolicy

from . import budget as budget_mod
from . import collectives  # noqa: F401  (registers torch.ops.zbuf.all_gather_start & co.)
from . import report
from .fingerprint import collective_order, fingerprint_of
from .graph_info import (
    activation_peak_bytes,
    activation_profile,
    gather_args,
    gather_nodes,
    gathered_nbytes,
    is_view,
    summarize,
)
from .options import CompileOptions
from .schedule import Schedule, buffer_counts, exposed_seconds, plan_schedule
from .tied import merge_reduce_scatters

__all__ = ["ZbufPartitioner", "GatherSchedulePass", "PlanState", "thread_reduce_scatters", "check_token_chain"]

aten = torch.ops.aten
zbuf = torch.ops.zbuf
prims = torch.ops.prims

_CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)


def _source_hash() -> str:
    h = hashlib.sha256()
    here = os.path.dirname(__file__)
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + f.read())
    for extra in ("../ops.py", "../param.py", "../runtime.py"):
        path = os.path.join(here, extra)
        if os.path.exists(path):
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:16]


_SOURCE_HASH = _source_hash()


class PlanState:
    """What the partitioner hands to the post-grad pass of the same compile.

    One instance per Dynamo graph (the backend creates it), shared by the partitioner (producer
    of the ``persistent*`` fields, see [Note: selective persistence]) and the schedule pass of
    the forward and backward graphs (consumer).
    """

    def __init__(self, options: CompileOptions) -> None:
        self.options = options
        self.persistent_bytes = 0
        self.persistent = 0
        self.persistent_buffers: list[tuple[int, int]] = []
        """(pool id, bytes) of every kept gather: they come back to their pools in backward."""

    def uuid(self) -> str:
        agreed = json.dumps(sorted(budget_mod._AGREED.items()))
        return f"{_SOURCE_HASH}:{self.options.digest()}:{agreed}:{torch.__version__}"


def _group_and_device(graph: torch.fx.Graph):
    for g in gather_nodes(graph):
        a = gather_args(g)
        return a.group_name, a.shard.meta["val"].device
    return None, None


def _is_backward_node_set(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes of a joint graph that depend on a tangent: the backward part."""
    bw: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in bw for a in n.all_input_nodes):
            bw.add(n)
    return bw


def _backward_need(joint: torch.fx.Graph, bw: set[torch.fx.Node], recomputed,
                   order: dict[torch.fx.Node, int]):
    """``need_at(n)``: the joint-graph position of the first backward node that needs ``n``'s
    value, directly or through forward nodes of the same checkpointed region that backward
    recomputes (the recomputation runs just before that node); the graph's length when backward
    never needs it. Propagation stops at region boundaries: the partitioner saves a region's
    outputs (``cleanup_recompute_tags``), so the next region's recomputation does not need them.
    One reverse pass."""
    never = len(order)
    reach: dict[torch.fx.Node, int] = {}

    def need_at(n: torch.fx.Node) -> int:
        if n in bw:
            return order[n]
        if n.meta.get("recompute") in recomputed:
            return reach.get(n, never)
        return never

    for n in reversed(joint.nodes):
        region = n.meta.get("ac_graph_id")
        reach[n] = min((need_at(u) for u in n.users
                        if u in bw or (region is not None and u.meta.get("ac_graph_id") == region)),
                       default=never)
    return need_at


def _view_and_cast_tree(g: torch.fx.Node) -> list[torch.fx.Node]:
    out, stack = [], [g]
    while stack:
        for u in stack.pop().users:
            if is_view(u) or u.target in _CASTS:
                out.append(u)
                stack.append(u)
    return out


def tag_for_regather(joint: torch.fx.Graph, state: PlanState) -> None:
    """Recompute tags on the joint graph; picks the persistent gathers ([Note: selective
    persistence])."""
    bw = _is_backward_node_set(joint)
    gathers = gather_nodes(joint)
    trees = {g: _view_and_cast_tree(g) for g in gathers}
    persist: set[torch.fx.Node] = set()
    state.persistent_bytes = state.persistent = 0
    state.persistent_buffers = []
    opts = state.options
    if opts.persist and gathers:
        group_name, device = _group_and_device(joint)
        peak = activation_peak_bytes(joint)
        budget = budget_mod.graph_budget(opts, group_name, device, peak)
        # What one node needs at once is off limits; persistence may use a share of the rest.
        need: dict[torch.fx.Node, int] = {}
        for g in gathers:
            nbytes = gathered_nbytes(g)
            for c in {u for v in [g, *trees[g]] for u in v.users}:
                need[c] = need.get(c, 0) + nbytes
        need = max(need.values(), default=0)
        cap = min(int(opts.persist_fraction * budget), budget - need)
        order = {n: i for i, n in enumerate(joint.nodes)}
        recomputed = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
        candidates = [
            g for g in gathers
            if any(u in bw or (u not in trees[g] and u.meta.get("recompute") in recomputed)
                   for v in [g, *trees[g]] for u in v.users)
        ]
        # [Note: selective persistence]: latency-bound gathers first, then in the order backward
        # needs them.
        need_at = _backward_need(joint, bw, recomputed, order)
        first_need = {g: min((need_at(u) for v in [g, *trees[g]] for u in v.users
                              if u not in trees[g]), default=len(order)) for g in candidates}
        latency_bound = opts.collective_latency_seconds * opts.link_bytes_per_second
        candidates.sort(key=lambda g: (gathered_nbytes(g) >= latency_bound, first_need[g],
                                       gathered_nbytes(g), order[g]))
        for g in candidates:
            nbytes = gathered_nbytes(g)
            if state.persistent_bytes + nbytes > cap:
                continue
            persist.add(g)
            state.persistent_bytes += nbytes
            state.persistent_buffers.append((gather_args(g).pool_id, nbytes))
        state.persistent = len(persist)
    for g in gathers:
        g.meta["recompute"] = CheckpointPolicy.MUST_SAVE if g in persist else CheckpointPolicy.MUST_RECOMPUTE
        for v in trees[g]:
            v.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


class ZbufPartitioner(CustomPartitionerFn):
    def __init__(self, state: PlanState) -> None:
        self.state = state

    def __call__(self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        with record_function("zbuf::tag_for_regather"):
            tag_for_regather(gm.graph, self.state)
        kwargs.setdefault("compiler", "inductor")
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def uuid(self) -> str:
        return "partitioner:" + self.state.uuid()


def _is_backward_graph(graph: torch.fx.Graph) -> bool:
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


def _fake_empty(like: torch.Tensor, device) -> torch.Tensor:
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return torch.empty(1, dtype=torch.uint8, device="meta")
    with mode:
        return torch.empty(1, dtype=torch.uint8, device=device)


def _new_token(graph: torch.fx.Graph, like: torch.Tensor, device) -> torch.fx.Node:
    """The schedule token ([Note: schedule token]), the graph's first non-placeholder node."""
    first_real = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first_real):
        token = graph.create_node(
            "call_function", aten.empty.memory_format, ([1],), {"dtype": torch.uint8, "device": device},
            name="zbuf_token",
        )
    token.meta["val"] = _fake_empty(like, device)
    return token


RS_IN_FLIGHT_BYTES = 1 << 30
"""Padded reduce-scatter inputs allowed in flight at once ([Note: reduce-scatter overlap]); a
single larger one is still issued alone."""


RS_IN_FLIGHT_BYTES = 1 << 30
"""Padded reduce-scatter inputs allowed in flight at once ([Note: reduce-scatter overlap] in
collectives.py); a single larger one is still issued, alone."""


def thread_reduce_scatters(graph: torch.fx.Graph, token: torch.fx.Node | None) -> torch.fx.Node | None:
    """Split every reduce-scatter into start / wait on the token chain, where the graph order puts it.

    Autograd traces the functional ``zbuf::reduce_scatter``, which Inductor may move anywhere its
    data dependencies allow (it did, on CUDA); the start and wait mutate the token, so their order
    is the graph's. The start stays where the reduce-scatter was; waits follow start order and go
    as late as the first reader of a result and the in-flight limit allow ([Note: reduce-scatter
    overlap] in collectives.py). Creates the token if the graph has none yet (no gathers: all
    persisted, or a graph that only reduces). Returns the token (None when the graph has no
    collective).
    """
    nodes = [n for n in graph.nodes if n.target is zbuf.reduce_scatter.default]
    if not nodes:
        return token
    if token is None:
        val = nodes[0].args[0].meta["val"]
        token = _new_token(graph, val, val.device)
    # Started, not yet waited for, in start order: reduce-scatter -> (start node, input bytes).
    in_flight: dict[torch.fx.Node, tuple[torch.fx.Node, int]] = {}
    in_flight_bytes = 0

    def wait_oldest(before: torch.fx.Node) -> None:
        nonlocal in_flight_bytes
        rs = next(iter(in_flight))
        started, nbytes = in_flight.pop(rs)
        in_flight_bytes -= nbytes
        out_dtype = rs.args[5]
        with graph.inserting_before(before):
            graph.call_function(zbuf.reduce_scatter_wait.default, (token, started)).meta["val"] = None
            result = started
            if started.meta["val"].dtype != out_dtype:
                result = graph.call_function(prims.convert_element_type.default, (started, out_dtype))
                result.meta["val"] = rs.meta["val"]
        rs.replace_all_uses_with(result)
        graph.erase_node(rs)

    for n in list(graph.nodes):
        read = [a for a in n.all_input_nodes if a in in_flight]
        if read:
            # n reads a result: wait for it and, in order, for those started before it.
            order = list(in_flight)
            for _ in range(max(order.index(a) for a in read) + 1):
                wait_oldest(n)
        if n.target is not zbuf.reduce_scatter.default:
            continue
        grad, param_id, shard_numel, group_name, reduce_dtype, _out_dtype = n.args
        gval = grad.meta["val"]
        rdtype = reduce_dtype if reduce_dtype is not None else gval.dtype
        nbytes = gval.numel() * rdtype.itemsize
        while in_flight and in_flight_bytes + nbytes > RS_IN_FLIGHT_BYTES:
            wait_oldest(n)
        with graph.inserting_before(n):
            started = graph.call_function(
                zbuf.reduce_scatter_start.default, (token, grad, param_id, shard_numel, group_name, reduce_dtype)
            )
        started.meta["val"] = n.meta["val"].new_empty(n.meta["val"].shape, dtype=rdtype)
        if "eager_input_vals" in n.meta:
            # Inductor constrains a custom op's inputs to these example strides; keep the
            # reduce-scatter's and add the token's.
            args, kwargs = n.meta["eager_input_vals"]
            started.meta["eager_input_vals"] = ((token.meta["val"], *args[:5]), kwargs)
        in_flight[n] = (started, nbytes)
        in_flight_bytes += nbytes
    if in_flight:
        raise AssertionError("zbuf: a reduce-scatter result has no reader (not even the graph "
                             "output); this is a zbuf bug")
    return token


def check_token_chain(graph: torch.fx.Graph, token: torch.fx.Node | None) -> list[torch.fx.Node]:
    """Refuse a graph in which a zbuf op or a zbuf collective is off the token chain.

    On the chain means: the token is the op's first argument and its schema declares that
    argument written, which is what makes Inductor keep the graph order between such ops
    ([Note: schedule token]). Returns the chain (graph order = issue order). Collectives of
    ``_c10d_functional`` (user code) are fingerprinted but not chained: they are not zbuf's to
    rewrite, and stay ordered by their data dependencies only.
    """
    chain = []
    for n in graph.nodes:
        t = n.target
        if not (isinstance(t, torch._ops.OpOverload) and t.namespace == "zbuf"):
            continue
        first = t._schema.arguments[0] if t._schema.arguments else None
        writes = first is not None and first.alias_info is not None and first.alias_info.is_write
        if token is None or not n.args or n.args[0] is not token or not writes:
            raise AssertionError(
                f"zbuf: {n.format_node()} is not on the schedule token chain, so the compiled code "
                "may issue it out of the planned order; this is a zbuf bug"
            )
        chain.append(n)
    return chain


def _readers(buf: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensor-valued nodes that read ``buf``, through views ([Note: release after the
    readers] in collectives.py): a view only aliases, so its own readers are the ones that count;
    a reader returning several tensors counts by its ``getitem`` outputs."""
    readers, seen, todo = [], set(), list(buf.users)
    while todo:
        n = todo.pop()
        if n in seen or (isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "zbuf"):
            continue
        seen.add(n)
        val = n.meta.get("val")
        if is_view(n):
            todo.extend(n.users)
        elif isinstance(val, torch.Tensor):
            readers.append(n)
        elif isinstance(val, (tuple, list)):
            todo.extend(u for u in n.users if u.target is operator.getitem)
    return readers


def rewrite(graph: torch.fx.Graph, index, sched: Schedule) -> torch.fx.Node:
    """Split every planned gather into start / wait / release at the planned slots."""
    nodes, gathers = index.nodes, index.gathers
    by_slot: dict[int, list] = {}
    for f in sched.fetches:
        by_slot.setdefault(f.start, []).append(("start", f))
        by_slot.setdefault(f.wait, []).append(("wait", f))
        for m in f.members:
            if m.release_after is not None:
                by_slot.setdefault(m.release_after + 1, []).append(("release", (f, m)))
    rank = {"release": 0, "start": 1, "wait": 2}
    group_name, device = _group_and_device(graph)
    token = _new_token(graph, gathers[0].meta["val"], device)

    position = {n: i for i, n in enumerate(nodes)}
    buffers: dict[tuple[int, int], torch.fx.Node] = {}  # (fetch index, member index) -> buffer
    fetch_index = {id(f): i for i, f in enumerate(sched.fetches)}
    for slot in sorted(by_slot):
        events = sorted(by_slot[slot], key=lambda e: rank[e[0]])  # stable: keeps fetch order
        anchor = nodes[slot]
        for kind, payload in events:
            with graph.inserting_before(anchor):
                if kind == "release":
                    f, m = payload
                    buf = buffers[(fetch_index[id(f)], f.members.index(m))]
                    after = _readers(buf)
                    if any(position[r] >= slot for r in after):
                        raise AssertionError(
                            f"zbuf plan releases {buf} at node {slot} before its reader(s) "
                            f"{[r for r in after if position[r] >= slot]}; this is a zbuf bug")
                    pool_id = gather_args(gathers[m.gather]).pool_id
                    n = graph.call_function(zbuf.all_gather_release.default, (token, buf, pool_id, after))
                    n.meta["val"] = None
                elif kind == "start":
                    f = payload
                    gs = [gathers[m.gather] for m in f.members]
                    fi = fetch_index[id(f)]
                    for i, (g, m) in enumerate(zip(gs, f.members)):
                        a = gather_args(g)
                        buf = graph.call_function(
                            zbuf.gather_buffer.default,
                            (token, a.shard, a.param_id, list(a.shape), a.group_name, a.param_dtype,
                             a.pool_id),
                        )
                        buf.meta["val"] = g.meta["val"]
                        buffers[(fi, i)] = buf
                        for p in m.uses:
                            nodes[p].replace_input_with(g, buf)
                    start = graph.call_function(
                        zbuf.all_gather_start.default,
                        (token, [buffers[(fi, i)] for i in range(len(gs))],
                         [gather_args(g).shard for g in gs], gather_args(gs[0]).group_name),
                    )
                    start.meta["val"] = None
                else:
                    f = payload
                    bufs = [buffers[(fetch_index[id(f)], i)] for i in range(len(f.members))]
                    n = graph.call_function(zbuf.all_gather_wait.default, (token, bufs))
                    n.meta["val"] = None
    for g in gathers:
        if g.users:
            raise AssertionError(f"zbuf rewrite left users on {g}: {list(g.users)}; this is a zbuf bug")
        graph.erase_node(g)
    return token


class GatherSchedulePass(CustomGraphPass):
    def __init__(self, state: PlanState) -> None:
        self.state = state

    def uuid(self) -> str:
        return "schedule:" + self.state.uuid()

    def __call__(self, graph: torch.fx.Graph) -> None:
        with record_function("zbuf::plan_and_rewrite"):
            self.plan_and_rewrite(graph)

    def plan_and_rewrite(self, graph: torch.fx.Graph) -> None:
        opts = self.state.options
        kind = "backward" if _is_backward_graph(graph) else "forward"
        merge_reduce_scatters(graph)  # tied weights: [Note: merging reduce-scatters] in tied.py
        gathers = gather_nodes(graph)
        # Dead gathers (unused outputs) cost a collective for nothing; drop them first.
        for g in gathers:
            if not g.users:
                graph.erase_node(g)
        index = summarize(graph, opts)
        group_name, device = _group_and_device(graph)
        act_profile = activation_profile(graph)
        peak_act = int(act_profile.max()) if len(act_profile) else 0
        token = None
        sched = None
        persistent_bytes = self.state.persistent_bytes if kind == "backward" else 0
        if index.gathers:
            requested = budget_mod.graph_budget(opts, group_name, device, peak_act)
            # Persisted weights are live through backward: they come off its budget.
            requested = max(1, requested - persistent_bytes)
            sched = plan_schedule(index.summary, requested, opts)
            token = rewrite(graph, index, sched)
        token = thread_reduce_scatters(graph, token)
        order = collective_order(graph)
        fp = fingerprint_of(order)
        zbuf_ops = tuple(
            n.target._schema.name.split("::")[-1]
            for n in graph.nodes
            if isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "zbuf"
        )
        rec = report.ScheduleRecord(
            graph_id=-1,
            uid=uuid.uuid4().hex,
            kind=kind,
            budget_bytes=sched.budget_bytes if sched else 0,
            requested_budget_bytes=sched.requested_budget_bytes if sched else 0,
            floor_bytes=sched.floor_bytes if sched else 0,
            peak_live_gathered_bytes=sched.peak_live_bytes if sched else 0,
            persistent_bytes=self.state.persistent_bytes,
            activation_peak_bytes=peak_act,
            gathers=len(index.gathers),
            collectives=len(order),
            coalesced_groups=sched.coalesced_groups if sched else 0,
            prefetched=sched.prefetched if sched else 0,
            regathers=sched.regathers if sched else 0,
            persistent=sum(g.escapes for g in index.summary.gathers),
            fingerprint=fp,
            planning_seconds=sched.planning_seconds if sched else 0.0,
            num_nodes=index.summary.num_nodes,
            # Gathered or reduced: a backward whose weights were all kept from forward gathers
            # nothing, and is still the model's graph.
            param_ids=tuple(sorted({int(g.args[1]) for g in index.gathers} | {
                int(n.args[2]) for n in graph.nodes if n.target is zbuf.reduce_scatter_start.default})),
            gather_calls=sum(len(f.members) for f in sched.fetches) if sched else 0,
            op_order=(("check_schedule",) if order and token is not None else ()) + zbuf_ops,
            live_gathered_profile=report.downsample_peaks(sched.profile if sched else [0] * len(act_profile)),
            activation_profile=report.downsample_peaks(act_profile),
            modelled_compute_seconds=float(sum(index.summary.compute_seconds)),
            modelled_exposed_seconds=exposed_seconds(index.summary, sched, opts) if sched else 0.0,
        )
        if order and token is not None:
            check_group = group_name if group_name is not None else self._group_of_collectives(graph)
            counts = buffer_counts(index.summary, sched) if sched else {}
            if kind == "backward":
                # Persisted weights come back to their pools during backward ([Note: pool sizing]).
                for pool, nbytes in self.state.persistent_buffers:
                    per_size = counts.setdefault(pool, {})
                    per_size[nbytes] = per_size.get(nbytes, 0) + 1
            entries = [(pool, size, n) for pool, per_size in counts.items() for size, n in per_size.items()]
            with graph.inserting_after(token):
                chk = graph.call_function(
                    zbuf.check_schedule.default,
                    (token, check_group, fp, json.dumps(order), [e[0] for e in entries],
                     [e[1] for e in entries], [e[2] for e in entries], rec.to_json()),
                )
                chk.meta["val"] = None
        check_token_chain(graph, token)
        graph.lint()
        report.record(rec, index.summary)

    @staticmethod
    def _group_of_collectives(graph: torch.fx.Graph) -> str:
        for n in graph.nodes:
            if n.target is zbuf.reduce_scatter_start.default:
                return n.args[4]
        raise AssertionError("collectives without a zbuf group; this is a zbuf bug")
