"""Compiled mode: one reduce-scatter per parameter per backward graph (tied weights).

[Note: merging reduce-scatters]
AOTAutograd traces one ``zbuf::all_gather`` per use site, so a parameter used twice in a forward
(a tied embedding and output head) has two ``zbuf::reduce_scatter`` nodes with the same
``param_id`` in the backward graph, whose shard-sized results autograd adds
(``add(reduce_scatter, reduce_scatter_9)`` feeding the shard's gradient output). That is exact but
costs one collective per use. ``merge_reduce_scatters`` rewrites each such group, before the
schedule pass plans the graph, to:
* a running sum of the full-size gradients in the reduce dtype, each ``add`` placed where that
  contribution's reduce-scatter was (so each contribution dies there, and only the running sum
  stays live: the same trade as the eager path, [Note: reduce once] in ``zbuf/reduce_once.py``);
* one reduce-scatter of the sum, at the position of the last one (its place in the collective
  order, which the schedule token then pins);
* the earlier reduce-scatters' results replaced by nothing: an ``add`` of one of them and
  another tensor becomes that other tensor; any other consumer gets zeros of the shard's shape
  (not seen in practice; kept so the rewrite is correct for any graph).
The sum is what the unsharded reference computes (autograd sums the full gradient); in fp32 it
is the same additions as the eager path, which accumulates in the same order for two uses.

Only nodes whose arguments other than the gradient agree (``param_id`` fixes them) and whose
gradients have one shape and dtype are merged; anything else is left as separate collectives,
which is still exact. Runs on every graph (a forward graph has no reduce-scatters), on every
rank alike: the rewrite depends only on the graph, so the collective order stays rank-invariant.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx

__all__ = ["merge_reduce_scatters"]

aten = torch.ops.aten


def _reduce_scatter_op():
    from .. import ops  # noqa: F401  (registers torch.ops.zbuf.*)

    return torch.ops.zbuf.reduce_scatter.default


_RS = _reduce_scatter_op()


def _fake_mode(val: torch.Tensor):
    mode = getattr(val, "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()


def _cast(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    val = node.meta["val"]
    if val.dtype == dtype:
        return node
    out = graph.call_function(torch.ops.prims.convert_element_type.default, (node, dtype))
    with _fake_mode(val):
        out.meta["val"] = val.to(dtype)
    return out


def _sum_tree(nodes: list[torch.fx.Node]) -> list[torch.fx.Node] | None:
    """The binary ``add`` nodes that sum exactly ``nodes`` (each once) into one value, in graph
    order (the root last); None if their results are used any other way, where merging could
    change what the graph computes."""
    inside = set(nodes)
    tree: list[torch.fx.Node] = []
    for n in nodes[0].graph.nodes:  # graph order is topological: one pass finds the whole tree
        if (n.op == "call_function" and n.target is aten.add.Tensor and len(n.args) == 2
                and not n.kwargs and n.args[0] is not n.args[1]
                and all(a in inside for a in n.args)):
            inside.add(n)
            tree.append(n)
    if len(tree) != len(nodes) - 1:
        return None
    root = tree[-1]
    for n in [*nodes, *tree[:-1]]:
        if len(n.users) != 1 or next(iter(n.users)) not in inside:
            return None
    if any(u in inside for u in root.users):
        return None
    return tree


def merge_reduce_scatters(graph: torch.fx.Graph) -> int:
    """[Note: merging reduce-scatters]. Returns how many reduce-scatters were removed."""
    groups: dict[tuple, list[torch.fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _RS and not n.kwargs:
            groups.setdefault(tuple(n.args[1:]), []).append(n)
    removed = 0
    for key, nodes in groups.items():
        if len(nodes) < 2:
            continue
        vals = [n.args[0].meta.get("val") for n in nodes]
        if not all(isinstance(v, torch.Tensor) for v in vals):
            continue
        if len({(tuple(v.shape), v.dtype) for v in vals}) != 1:
            continue
        tree = _sum_tree(nodes)
        if tree is None:
            continue
        reduce_dtype = key[3]
        rdtype = reduce_dtype if reduce_dtype is not None else vals[0].dtype
        first, last = nodes[0], nodes[-1]
        with graph.inserting_before(first):
            acc = _cast(graph, first.args[0], rdtype)
        for n in nodes[1:]:
            with graph.inserting_before(n):
                grad = _cast(graph, n.args[0], rdtype)
                total = graph.call_function(aten.add.Tensor, (acc, grad))
            with _fake_mode(acc.meta["val"]):
                total.meta["val"] = acc.meta["val"] + grad.meta["val"]
            acc = total
        last.update_arg(0, acc)
        root = tree[-1]
        root.replace_all_uses_with(last)
        for n in reversed(tree):
            graph.erase_node(n)
        for n in nodes[:-1]:
            graph.erase_node(n)
            removed += 1
    if removed:
        graph.lint()
    return removed
