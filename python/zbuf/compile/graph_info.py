"""Reading gathers, their uses, sizes and compute costs out of FX graphs.

Turns an FX graph (joint, forward or backward, after AOTAutograd) into the planner's
``GraphSummary`` (graph_model.py): positions are indices in ``graph.nodes``.

[Note: view chains]
A consumer often reads a gathered weight through views (``t``, ``view``, ``expand``, ...). Views
share the gathered buffer, so the buffer must stay live until the last *consumer* of any view.
Before summarising, ``localize_view_chains`` gives every consumer its own copy of the chain of
views it reads, placed right before it. Views cost nothing, and afterwards a gather's uses split
cleanly into segments (re-gathering for a later use just points that consumer's chain at the new
buffer), and a release after a segment's last consumer cannot free a buffer some later view
still reads.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple

import numpy as np
import torch
import torch.fx

from .. import linear_cross_entropy, runtime
from .graph_model import GatherSpec, GraphSummary
from .options import CompileOptions

__all__ = [
    "GATHER_OP",
    "gradient_shard_bytes",
    "graph_world_size",
    "GatherArgs",
    "gather_args",
    "is_view",
    "gather_nodes",
    "group_and_device",
    "view_tree",
    "localize_view_chains",
    "summarize",
    "GraphIndex",
    "activation_profile",
    "tensor_bytes",
    "gathered_nbytes",
    "backward_nodes",
    "weight_tree",
    "block_of",
    "node_flops",
    "unpacks_results",
]

aten = torch.ops.aten


def _gather_op():
    from .. import ops  # noqa: F401  (registers torch.ops.zbuf.*)

    return torch.ops.zbuf.all_gather.default


GATHER_OP = _gather_op()
REDUCE_SCATTER_OP = torch.ops.zbuf.reduce_scatter.default

class GatherArgs(NamedTuple):
    """The arguments of a ``zbuf::all_gather`` node (ops.py has the op's schema)."""

    shard: torch.fx.Node
    param_id: int
    shape: list
    group_name: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    pool_id: int
    """The pool its buffer comes from ([Note: pool ids] in runtime.py)."""


def gather_args(node: torch.fx.Node) -> GatherArgs:
    """``node``'s gather arguments, the pool id filled in where the call left it to its default."""
    args = list(node.args)
    if len(args) < len(GatherArgs._fields):
        args.append(node.kwargs.get("pool_id", runtime.DEFAULT_POOL))
    return GatherArgs(*args)


# Ops without an alias annotation in their schema that still return (part of) their input.
_ALIAS_FUNCTIONS = (operator.getitem,
                    # A view that autograd does not track as one (matmul decompositions reshape
                    # their outputs with it): its output shares its input's storage.
                    aten._unsafe_view.default)


def is_view(node: torch.fx.Node) -> bool:
    """Does ``node`` return an alias of its first argument (no new memory)?"""
    if node.op != "call_function":
        return False
    t = node.target
    if t in _ALIAS_FUNCTIONS:
        return True
    if isinstance(t, torch._ops.OpOverload):
        rets = t._schema.returns
        return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)
    return False


def gather_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target is GATHER_OP]


def group_and_device(graph: torch.fx.Graph):
    """(group name, device) of the graph's first gather; (None, None) when it gathers nothing."""
    for g in gather_nodes(graph):
        a = gather_args(g)
        return a.group_name, a.shard.meta["val"].device
    return None, None


def graph_world_size(graph: torch.fx.Graph) -> int | None:
    """Ranks of the group the graph's first gather gathers over; None when it gathers nothing."""
    for g in gather_nodes(graph):
        return runtime.process_group(gather_args(g).group_name).size()
    return None


def view_tree(root: torch.fx.Node) -> list[torch.fx.Node]:
    """Every view node reachable from ``root`` through views (graph order not guaranteed)."""
    out, stack = [], [root]
    while stack:
        for user in stack.pop().users:
            if is_view(user) and user.args and user.args[0] is not None:
                out.append(user)
                stack.append(user)
    return out


_CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)


def weight_tree(gather: torch.fx.Node) -> list[torch.fx.Node]:
    """The view and cast users of a gather, transitively: the weight in every form a consumer
    reads it (re-gathered, never saved or recomputed as activations)."""
    out, stack = [], [gather]
    while stack:
        for u in stack.pop().users:
            if is_view(u) or u.target in _CASTS:
                out.append(u)
                stack.append(u)
    return out


def backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes of a joint graph that depend on a tangent: the backward part."""
    bw: set[torch.fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in bw for a in n.all_input_nodes):
            bw.add(n)
    return bw


def localize_view_chains(
    graph: torch.fx.Graph, gather: torch.fx.Node, order: dict[torch.fx.Node, int]
) -> None:
    """See [Note: view chains]. ``order`` ranks the graph's nodes (new nodes need no entry)."""
    tree = view_tree(gather)
    if not tree:
        return
    members = set(tree)
    consumers: dict[torch.fx.Node, None] = {}
    for v in [gather, *tree]:
        for u in v.users:
            if u not in members:
                consumers[u] = None
    for c in sorted(consumers, key=order.__getitem__):
        for a in list(dict.fromkeys(c.all_input_nodes)):
            if a not in members:
                continue
            chain = [a]
            while chain[-1].args[0] is not gather:
                chain.append(chain[-1].args[0])
            mapping: dict[torch.fx.Node, torch.fx.Node] = {}
            with graph.inserting_before(c):
                for v in reversed(chain):
                    mapping[v] = graph.node_copy(v, lambda n: mapping.get(n, n))
            c.replace_input_with(a, mapping[a])
    for v in sorted(tree, key=order.__getitem__, reverse=True):
        if not v.users:
            graph.erase_node(v)


def _hint(x) -> int:
    """A size as a plain int, as the planner counts it. A symbolic size counts at its upper bound
    when it has one (a dimension marked dynamic with ``max=``), so that the plan holds for the
    largest input the graph accepts; else at its example value, the size the graph was compiled
    at ([Note: variable sequence lengths] in fingerprint.py)."""
    if isinstance(x, torch.SymInt):
        node = x.node
        if node.shape_env is not None:
            upper = node.shape_env.bound_sympy(node.expr).upper
            if upper.is_Integer:  # not int_oo (unbounded)
                return int(upper)
        hint = node.hint
        return int(hint) if hint is not None else 1
    return int(x)


def tensor_bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return math.prod(_hint(s) for s in val.shape) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(tensor_bytes(v) for v in val)
    return 0


def _shape(node) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(_hint(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


_REGION_OP = torch.ops.higher_order.invoke_subgraph


def node_flops(node: torch.fx.Node) -> float:
    """Matmul and attention FLOPs of a node (0 for everything else); a region call
    ([Note: region bodies] in region_graphs.py) counts what its body's nodes do, as
    ``node_seconds`` does (counted as 0, a step of region calls showed only its output
    head's FLOPs)."""
    t = node.target
    if t is _REGION_OP:
        body = getattr(node.graph.owning_module, node.args[0].target)
        return sum(node_flops(n) for n in body.graph.nodes)
    try:
        if t is aten.mm.default:
            (m, k), (_, n) = _shape(node.args[0]), _shape(node.args[1])
            return 2.0 * m * k * n
        if t is aten.addmm.default:
            (m, k), (_, n) = _shape(node.args[1]), _shape(node.args[2])
            return 2.0 * m * k * n
        if t in (aten.bmm.default, aten.baddbmm.default):
            a, b = (node.args[0], node.args[1]) if t is aten.bmm.default else (node.args[1], node.args[2])
            (bs, m, k), (_, _, n) = _shape(a), _shape(b)
            return 2.0 * bs * m * k * n
        fused = linear_cross_entropy.matmul_flops(node)
        if fused:
            return fused
        name = getattr(t, "__name__", "")
        if "scaled_dot_product" in name:
            q, k = _shape(node.args[0]), _shape(node.args[1])
            mult = 2.5 if "backward" in name else 1.0
            return mult * 4.0 * math.prod(q[:-1]) * k[-2] * q[-1]
    except (TypeError, ValueError):
        return 0.0
    return 0.0


def node_seconds(node: torch.fx.Node, options: CompileOptions) -> float:
    """Static cost model: matmul flops at ``flops_per_second`` plus bytes moved at memory speed;
    a region call ([Note: region bodies] in region_graphs.py) costs what its body's nodes do."""
    if node.op != "call_function" or is_view(node):
        return 0.0
    if node.target is _REGION_OP:
        body = getattr(node.graph.owning_module, node.args[0].target)
        return sum(node_seconds(n, options) for n in body.graph.nodes)
    moved = tensor_bytes(node.meta.get("val")) + sum(
        tensor_bytes(a.meta.get("val")) for a in node.all_input_nodes
    )
    return node_flops(node) / options.flops_per_second + moved / options.memory_bytes_per_second


class GraphIndex(NamedTuple):
    """A summary plus the FX nodes its positions and gathers refer to."""

    summary: GraphSummary
    nodes: list[torch.fx.Node]
    gathers: list[torch.fx.Node]
    """``gathers[i]`` is the FX node of ``summary.gathers[i]``."""


def block_of(node: torch.fx.Node) -> str:
    """The coalescing key: group, dtype, and the owning block ("layers.3") of the parameter.

    The block comes from ``nn_module_stack``: the module path up to its first numeric component
    (a ModuleList index), so every parameter of one decoder layer shares it. Parameters outside
    any indexed block get their own module path.
    """
    stack = node.meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        path = str(list(stack.values())[-1][0])
    parts = [p for p in path.replace("[", ".").replace("]", "").replace("'", "").split(".") if p]
    for i, p in enumerate(parts):
        if p.isdigit():
            parts = parts[: i + 1]
            break
    if not parts:
        return ""
    a = gather_args(node)
    return f"{a.group_name}|{a.param_dtype}|{'.'.join(parts)}"


def _outputs_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The ``getitem`` nodes that unpack a multi-output, non-view node (a region call's results,
    ``native_layer_norm``'s): in the graph they are the tensors that node makes, so a buffer it
    reads is released after them ([Note: release after the readers] in collectives.py)."""
    if is_view(node) or not isinstance(node.meta.get("val"), (tuple, list)):
        return []
    return [u for u in node.users if u.target is operator.getitem]


def unpacks_results(node: torch.fx.Node) -> bool:
    """Is ``node`` a ``getitem`` of a multi-output op that is no view: one of the tensors that op
    made (not an alias of its input, although ``getitem`` is an alias function)?"""
    src = node.args[0] if node.target is operator.getitem and node.args else None
    return isinstance(src, torch.fx.Node) and bool(_outputs_of(src))


def gathered_nbytes(gather: torch.fx.Node) -> int:
    """Bytes of the pool block a gather fills: ``world * shard_numel`` elements (padded).

    The world size is the live group's (``runtime.process_group``). A graph whose group does not
    exist here raises that lookup's error instead of assuming one rank: such a gather can never
    run (the op raises the same error at its first call), and sizing its buffer for one rank
    would plan every gathered byte ``world`` times too small.
    """
    a = gather_args(gather)
    sval = a.shard.meta["val"]
    dtype = a.param_dtype if a.param_dtype is not None else sval.dtype
    padded = _hint(sval.numel()) * runtime.process_group(a.group_name).size()
    return max(padded * dtype.itemsize, tensor_bytes(gather.meta["val"]))


def summarize(graph: torch.fx.Graph, options: CompileOptions) -> GraphIndex:
    """Localize view chains of every gather, then read the planner's summary off the graph."""
    gathers = gather_nodes(graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for g in gathers:
        localize_view_chains(graph, g, order)
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    first_real = next(i for i, n in enumerate(nodes) if n.op != "placeholder")
    specs = []
    for g in gathers:
        tree = view_tree(g)
        members = {g, *tree}
        uses = {pos[v] for v in tree}
        escapes = False
        for v in members:
            for u in v.users:
                if u not in members:
                    uses.add(pos[u])
                    uses.update(pos[o] for o in _outputs_of(u))
                    escapes |= u.op == "output"
        nbytes = gathered_nbytes(g)
        # Inserted ops go after the placeholders (the schedule token is the first real node).
        earliest = max([first_real, *(pos[a] + 1 for a in g.all_input_nodes)])
        if not uses:
            continue
        specs.append(
            (g, GatherSpec(
                key=str(gather_args(g).param_id),
                nbytes=nbytes,
                uses=tuple(sorted(uses)),
                earliest=min(earliest, min(uses)),
                escapes=escapes,
                block=block_of(g),
                pool=gather_args(g).pool_id,
            ))
        )
    summary = GraphSummary(
        num_nodes=len(nodes),
        compute_seconds=tuple(node_seconds(n, options) for n in nodes),
        gathers=tuple(s for _, s in specs),
        world_size=graph_world_size(graph),
    )
    return GraphIndex(summary, nodes, [g for g, _ in specs])


def activation_profile(graph: torch.fx.Graph, *, inputs: bool = True,
                       shards: bool = True, stepped_gradients: bool = False) -> np.ndarray:
    """Bytes of non-gathered tensors alive at each node (int64, one entry per node of ``graph``).

    Static liveness: a tensor is alive from the node that makes it to its last reader, its own or
    a view's (a view shares its base's storage). Placeholders count from the start (in a backward
    graph they are the saved activations; ``inputs=False`` leaves them out), graph outputs (or
    views of them) to the end; views and the gathered buffers
    (and views of them) count nothing, nor do the gathered weights a backward graph receives from
    its forward (marked ``zbuf_persistent`` by selective persistence: their bytes come off the
    gather budget, see [Note: selective persistence] in persist.py). A multi-output op's tensors
    count from their ``getitem`` nodes on; a region call counts, while it runs, the peak of what
    its body makes ([Note: region bodies] in region_graphs.py); an opaque operator's workspace
    counts at its node ([Note: the logits are never whole] in zbuf/linear_cross_entropy.py). ``shards=False`` leaves out the
    shards the gathers read (resident before the step: [Note: the model's state is not an
    activation] in budget.py); the gradient shards the reduce-scatters return always count, from
    the reduce-scatter on ([Note: gradients live in backward] in budget.py), to the graph's end,
    or with ``stepped_gradients`` at their own node only (the optimizer consumes them there:
    [Note: optimizer in backward] in zbuf/optimizer_in_backward.py).
    """
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    gathered: set[torch.fx.Node] = set()
    for g in gather_nodes(graph):
        gathered.add(g)
        gathered.update(view_tree(g))
    resident = set() if shards else {gather_args(g).shard for g in gather_nodes(graph)}
    delta = [0] * (len(nodes) + 1)
    for n in nodes:
        if n.op in ("output", "get_attr") or n in gathered or n.meta.get("zbuf_persistent"):
            continue
        if n.target is _REGION_OP:
            body = getattr(graph.owning_module, n.args[0].target)
            inner = activation_profile(body.graph, inputs=False, shards=shards,
                                       stepped_gradients=stepped_gradients)
            peak = int(inner.max()) if len(inner) else 0
            delta[pos[n]] += peak
            delta[pos[n] + 1] -= peak
            continue
        workspace = linear_cross_entropy.workspace_bytes(n)
        delta[pos[n]] += workspace
        delta[pos[n] + 1] -= workspace
        if _outputs_of(n) or (is_view(n) and not unpacks_results(n)):
            continue  # a multi-output op's tensors count at its getitems; a view counts nothing
        if n.op == "placeholder" and not inputs:
            continue
        if n in resident:
            continue
        nbytes = tensor_bytes(n.meta.get("val"))
        if not nbytes:
            continue
        if stepped_gradients and n.target is REDUCE_SCATTER_OP:
            delta[pos[n]] += nbytes
            delta[pos[n] + 1] -= nbytes
            continue
        last, readers = pos[n], [n]
        while readers:
            for u in readers.pop().users:
                last = len(nodes) - 1 if u.op == "output" else max(last, pos[u])
                if is_view(u) and not unpacks_results(u):
                    readers.append(u)
        delta[0 if n.op == "placeholder" else pos[n]] += nbytes
        delta[last + 1] -= nbytes
    return np.cumsum(np.asarray(delta[:-1], dtype=np.int64))


def gradient_shard_bytes(graph: torch.fx.Graph) -> int:
    """Bytes of the gradient shards ``graph``'s reduce-scatters return, once per parameter (the
    tied weights' reduce-scatters are merged later, [Note: merging reduce-scatters] in tied.py;
    before that a tied weight has one per use). Taken before the schedule pass's rewrite, when
    every gradient shard comes out of a functional ``zbuf::reduce_scatter``."""
    per_param: dict[int, int] = {}

    def visit(g: torch.fx.Graph) -> None:
        for n in g.nodes:
            if n.target is REDUCE_SCATTER_OP:
                per_param[n.args[1]] = tensor_bytes(n.meta.get("val"))
            elif n.target is _REGION_OP:
                visit(getattr(g.owning_module, n.args[0].target).graph)

    visit(graph)
    return sum(per_param.values())
