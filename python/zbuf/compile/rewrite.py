"""The graph rewrite of the schedule pass: the token, gathers split into start / wait / release,
reduce-scatters into start / wait, and the check that every zbuf op is on the token chain.

``rewrite`` puts a planned ``Schedule`` (schedule.py) into the graph; ``thread_reduce_scatters``
replaces the functional ``zbuf::reduce_scatter`` ([Note: reduce-scatter overlap]);
``check_token_chain`` refuses a graph with a zbuf op off the chain ([Note: schedule token]). The
ops and these Notes are in collectives.py; ``passes.GatherSchedulePass`` runs the steps in order.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..kept_weights import NEITHER
from . import collectives  # noqa: F401  (registers torch.ops.zbuf.all_gather_start & co.)
from .graph_info import (GraphIndex, gather_args, group_and_device, is_view, tensor_bytes,
                         unpacks_results)
from .schedule import Schedule

__all__ = ["RS_IN_FLIGHT_BYTES", "new_token", "rewrite", "thread_reduce_scatters",
           "step_gradients_in_backward", "hold_released_buffers", "check_token_chain"]

aten = torch.ops.aten
zbuf = torch.ops.zbuf
prims = torch.ops.prims


def _fake_empty(like: torch.Tensor, device) -> torch.Tensor:
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return torch.empty(1, dtype=torch.uint8, device="meta")
    with mode:
        return torch.empty(1, dtype=torch.uint8, device=device)


def new_token(graph: torch.fx.Graph, like: torch.Tensor, device) -> torch.fx.Node:
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
        token = new_token(graph, val, val.device)
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


def step_gradients_in_backward(graph: torch.fx.Graph, token: torch.fx.Node | None,
                               batch_bytes: int) -> None:
    """End every gradient shard the graph returns in ``zbuf::step_in_backward``, in batches of
    about ``batch_bytes`` in the order their reduce-scatters are waited for, and return no
    gradient for it ([Note: optimizer in backward] in zbuf/optimizer_in_backward.py). Call after
    ``thread_reduce_scatters``."""
    if token is None:
        return
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    waited = {n.args[1]: n for n in nodes if n.target is zbuf.reduce_scatter_wait.default}

    def started_of(n) -> torch.fx.Node | None:
        if isinstance(n, torch.fx.Node) and n.target is prims.convert_element_type.default:
            n = n.args[0]
        ok = isinstance(n, torch.fx.Node) and n.target is zbuf.reduce_scatter_start.default
        return n if ok and n in waited else None

    output = graph.output_node()
    results = list(output.args[0])
    ready = []  # (after which node the gradient is complete, output index, param_id)
    for i, r in enumerate(results):
        started = started_of(r)
        if started is not None and set(r.users) <= {output, waited[started]}:  # no other reader
            after = max(waited[started], r, key=pos.__getitem__)
            ready.append((after, i, started.args[2]))
    ready.sort(key=lambda x: pos[x[0]])
    batch: list[tuple[torch.fx.Node, int, int]] = []

    def flush() -> None:
        with graph.inserting_after(batch[-1][0]):
            op = graph.call_function(zbuf.step_in_backward.default,
                                     (token, [results[i] for _, i, _ in batch],
                                      [param_id for _, _, param_id in batch]))
            op.meta["val"] = None
        batch.clear()

    pending = 0
    for entry in ready:
        batch.append(entry)
        pending += tensor_bytes(results[entry[1]].meta.get("val"))
        if pending >= batch_bytes:
            flush()
            pending = 0
    if batch:
        flush()
    for _, i, _ in ready:
        results[i] = None
    output.args = (type(output.args[0])(results),)
    # Inductor keeps the strides of the outputs the user sees: not of those no longer returned.
    visible = output.meta.get("user_visible_output_idxs")
    if visible is not None:
        output.meta["user_visible_output_idxs"] = type(visible)(
            i for i in visible if results[i] is not None)


def hold_released_buffers(graph: torch.fx.Graph, token: torch.fx.Node | None) -> None:
    """End the graph with ``zbuf::hold_released`` over every buffer it releases, so that
    Inductor never reuses a block the pool took back ([Note: the pool's memory is not
    Inductor's] in collectives.py)."""
    released = [t for n in graph.nodes if n.target is zbuf.all_gather_release.default
                for t in n.args[1]]
    if not released:
        return
    with graph.inserting_before(graph.output_node()):
        graph.call_function(zbuf.hold_released.default, (token, released)).meta["val"] = None


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
        if is_view(n) and not unpacks_results(n):  # a tensor a reader made is a reader itself
            todo.extend(n.users)
        elif isinstance(val, torch.Tensor):
            readers.append(n)
        elif isinstance(val, (tuple, list)):
            todo.extend(u for u in n.users if u.target is operator.getitem)
    return readers


def rewrite(graph: torch.fx.Graph, index: GraphIndex, sched: Schedule,
            keep_role: int = NEITHER) -> torch.fx.Node:
    """Split every planned gather into start / wait / release at the planned slots.

    ``keep_role``: what the graph's gathers do with the weights its pools keep for backward
    (``HOLDS`` in a training forward, ``TAKES`` in a backward: [Note: weights kept at run time]
    in zbuf/kept_weights.py). Every buffer of a graph gets the same role: the first gather of a
    weight in a backward is the one that finds the held buffer, the later ones find none.

    [Note: one release per slot]
    The buffers released at one slot are released by one ``zbuf::all_gather_release``, in plan
    order, after the readers of all of them. The order of the pool's releases and every
    buffer's last reader are as with one op per buffer; what changes is the number of ops
    Inductor lowers, each its own fallback kernel (issue 21: on CPU the release was the
    costliest zbuf op to lower, 4.4 ms, two per parameter per step)."""
    nodes, gathers = index.nodes, index.gathers
    by_slot: dict[int, list] = {}
    for f in sched.fetches:
        by_slot.setdefault(f.start, []).append(("start", f))
        by_slot.setdefault(f.wait, []).append(("wait", f))
        for m in f.members:
            if m.release_after is not None:
                by_slot.setdefault(m.release_after + 1, []).append(("release", (f, m)))
    rank = {"release": 0, "start": 1, "wait": 2}
    _, device = group_and_device(graph)
    token = new_token(graph, gathers[0].meta["val"], device)

    position = {n: i for i, n in enumerate(nodes)}
    buffers: dict[tuple[int, int], torch.fx.Node] = {}  # (fetch index, member index) -> buffer
    fetch_index = {id(f): i for i, f in enumerate(sched.fetches)}
    for slot in sorted(by_slot):
        events = sorted(by_slot[slot], key=lambda e: rank[e[0]])  # stable: keeps fetch order
        anchor = nodes[slot]
        releases = [payload for kind, payload in events if kind == "release"]
        if releases:
            released, pool_ids, after = [], [], {}
            for f, m in releases:
                buf = buffers[(fetch_index[id(f)], f.members.index(m))]
                readers = _readers(buf)
                if any(position[r] >= slot for r in readers):
                    raise AssertionError(
                        f"zbuf plan releases {buf} at node {slot} before its reader(s) "
                        f"{[r for r in readers if position[r] >= slot]}; this is a zbuf bug")
                released.append(buf)
                pool_ids.append(gather_args(gathers[m.gather]).pool_id)
                after.update(dict.fromkeys(readers))
            with graph.inserting_before(anchor):
                n = graph.call_function(zbuf.all_gather_release.default,
                                        (token, released, pool_ids, list(after)))
            n.meta["val"] = None
        for kind, payload in events:
            if kind == "release":
                continue
            with graph.inserting_before(anchor):
                if kind == "start":
                    f = payload
                    gs = [gathers[m.gather] for m in f.members]
                    fi = fetch_index[id(f)]
                    for i, (g, m) in enumerate(zip(gs, f.members)):
                        a = gather_args(g)
                        buf = graph.call_function(
                            zbuf.gather_buffer.default,
                            (token, a.shard, a.param_id, list(a.shape), a.group_name, a.param_dtype,
                             a.pool_id, keep_role),
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
