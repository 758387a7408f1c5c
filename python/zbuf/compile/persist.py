"""Selective persistence: which gathered weights forward keeps for backward.

Two ways to keep them, one order (``choose_kept``):
* at run time, the plans of ``zbuf.compile`` ([Note: weights kept at run time] in
  zbuf/kept_weights.py): the graphs always re-gather in backward, and after the measured step
  the re-planner picks the keep-set from the measured room ([Note: the run-time keep-set]);
* in the graph, for plans compiled with a fixed budget (``torch.compile(m, backend="zbuf")``,
  ``zbuf.compile(..., budget_bytes=...)``): the partitioner pass (``passes.ZbufPartitioner``)
  runs ``tag_for_regather`` on the joint graph before ``min_cut_rematerialization_partition``:
  every gather and its view/cast users are tagged ``MUST_RECOMPUTE`` (backward re-gathers
  instead of saving full weights), except the gathers kept here (``MUST_SAVE``).

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
At world 1 nothing is kept (unless ``persist=True`` asks for it): a gather there moves no bytes over a link (the cost model gives it
no time), so persistence would spend memory to save nothing (qwen3-1.7b on one H200 would keep
all 3.2 GiB of its bf16 weights). Kept bytes are charged to the backward graph's budget
as live throughout. Candidates are the
gathers with a backward consumer in the joint graph, or a consumer that activation
checkpointing tags for recompute (backward re-runs it, so it needs the weight again). A gather
that backward re-runs only because the partitioner itself chose to recompute a cheap consumer
(an embedding lookup, say) is not known before partitioning and is re-gathered.

[Note: the run-time keep-set]
After the measured step ([Note: measure first, then spend] in zbuf/memory/step.py) the
re-planner (replan.py) chooses the weights forward keeps for backward with ``choose_kept``, a
pure function of what every rank has alike: the schedule records of the current graphs (each
weight's gathered bytes, and the position at which the backward graphs first read it, in the
order they run) and the rank-agreed measured budget. Candidates are the weights that a forward
graph and a backward graph both gather (forward fills the buffer that backward then skips). The
cap is ``min(persist_fraction * budget, budget - need)``, where ``need`` is the most gathered
bytes any current graph holds at once by its compiled plan (prefetch stays as compiled: kept
bytes are charged as live through every graph, on top of its plan). The order is [Note:
selective persistence]'s: latency-bound gathers first, then in the order backward needs them, then smaller first,
then by parameter id (a total order: the same set on every rank, whatever order the candidates
come in); each candidate that still fits is kept, one that does not is skipped and later
smaller ones may still fit. Same rules as in the graph: nothing at world 1 unless
``persist=True``, nothing with ``persist=False``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from . import budget as budget_mod
from .graph_info import (
    backward_nodes,
    gather_args,
    gather_nodes,
    gathered_nbytes,
    gradient_shard_bytes,
    graph_world_size,
    group_and_device,
    weight_tree,
)
from .options import CompileOptions

__all__ = ["Persisted", "KeepCandidate", "keep_order", "choose_kept", "tag_for_regather"]


class KeepCandidate(NamedTuple):
    """A gathered weight that forward could keep for backward."""

    key: int
    """Rank-invariant identity, the last tie-break (a parameter id; a node position in the
    joint graph)."""
    nbytes: int
    """Gathered (padded) bytes it would keep live."""
    need: int
    """Where backward first needs it, in execution order (smaller: earlier)."""
    pool_id: int = -1
    """The pool its buffer comes from."""


def keep_order(c: KeepCandidate, latency_bound_bytes: float) -> tuple:
    """[Note: selective persistence]'s order: latency-bound first, then by backward need."""
    return (c.nbytes >= latency_bound_bytes, c.need, c.nbytes, c.key)


def choose_kept(candidates: Iterable[KeepCandidate], cap_bytes: int,
                latency_bound_bytes: float) -> tuple[KeepCandidate, ...]:
    """The candidates kept within ``cap_bytes``, in ``keep_order`` ([Note: the run-time
    keep-set]): each that still fits. Pure and deterministic: equal inputs in any order give
    the same tuple."""
    kept: list[KeepCandidate] = []
    total = 0
    for c in sorted(candidates, key=lambda c: keep_order(c, latency_bound_bytes)):
        if total + c.nbytes <= cap_bytes:
            kept.append(c)
            total += c.nbytes
    return tuple(kept)



class Persisted(NamedTuple):
    """The gathers selective persistence keeps from forward for backward."""

    nbytes: int = 0
    """Their gathered bytes, live from forward through backward (off the backward's budget)."""
    count: int = 0
    """How many gathers are kept."""
    buffers: tuple[tuple[int, int], ...] = ()
    """(pool id, bytes) of each: they come back to their pools during backward ([Note: pool
    sizing] in schedule.py)."""


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


def tag_for_regather(joint: torch.fx.Graph, opts: CompileOptions,
                     activation_peak: int | None = None) -> Persisted:
    """Recompute tags on the joint graph; picks the persistent gathers ([Note: selective
    persistence]) within the budget left by ``activation_peak`` (None: the joint graph's static
    peak, every activation kept; recompute.py passes its plan's) and returns them."""
    bw = backward_nodes(joint)
    gathers = gather_nodes(joint)
    trees = {g: weight_tree(g) for g in gathers}
    persist: set[torch.fx.Node] = set()
    kept_bytes = 0
    buffers: list[tuple[int, int]] = []
    # At world 1 a gather moves nothing: keeping its weight would cost memory and save nothing
    # ([Note: selective persistence]).
    # The measured step's plan keeps nothing ([Note: measure first, then spend] in
    # zbuf/memory/step.py): persistence grows into the measured room afterwards.
    if (opts.persist is not False and not opts.measuring and gathers
            and (opts.persist or graph_world_size(joint) != 1)):
        _, device = group_and_device(joint)
        if activation_peak is None:
            activation_peak = int(budget_mod.planning_profile(joint, opts).max(initial=0))
        reserve = budget_mod.gradient_reserve(opts, gradient_shard_bytes(joint), backward=True)
        budget = budget_mod.graph_budget(opts, device, activation_peak, reserve_bytes=reserve)
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
        by_position = {order[g]: g for g in candidates}
        for c in choose_kept((KeepCandidate(order[g], gathered_nbytes(g), first_need[g],
                                            gather_args(g).pool_id) for g in candidates),
                             cap, latency_bound):
            persist.add(by_position[c.key])
            kept_bytes += c.nbytes
            buffers.append((c.pool_id, c.nbytes))
    for g in gathers:
        g.meta["recompute"] = CheckpointPolicy.MUST_SAVE if g in persist else CheckpointPolicy.MUST_RECOMPUTE
        # The backward graph's placeholder of a kept weight shares this meta dict: there it is
        # gathered bytes, not an activation (graph_info.activation_profile).
        g.meta["zbuf_persistent"] = g in persist
        for v in trees[g]:
            v.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return Persisted(kept_bytes, len(persist), tuple(buffers))
