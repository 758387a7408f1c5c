"""Activation recompute within the memory budget (``recompute="auto"``), and what every mode kept.

``ZbufPartitioner`` (passes.py) hands its joint graph to ``partition``, which applies the
recompute mode to the candidate regions, tags the gathers (the persistence rules, unchanged),
runs the min-cut partitioner and records what the forward kept for backward and what backward
re-runs (``RecomputeStats``, shown by ``schedule_report`` and ``zbuf report``).

[Note: recompute modes]
``CompileOptions.recompute`` decides what happens to the candidate regions, the model's
``torch.utils.checkpoint`` regions (the built-in decoder checkpoints every block under
``--ac``, ``--ac selective`` and ``--ac auto``):
- ``"checkpointed"`` (default): as the user wrote them; a region is recomputed in backward (or,
  under a selective checkpoint policy, what the policy says). Nothing is planned.
- ``"auto"``: zbuf chooses per region, within the activation budget ([Note: budgeted
  recompute]): recompute it as written, keep its matmul and attention outputs (recompute the
  rest), or keep it all.
- ``"none"``: every region keeps its activations (checkpointing is ignored), and the min-cut
  partitioner decides alone: what ``"auto"`` does when everything fits.
Gathered weights follow the re-gather and persistence rules in every mode ([Note: selective
persistence] in persist.py). A model without candidate regions has nothing to choose: every mode
partitions it as ``"checkpointed"`` does, and the record says 0 regions.

[Note: budgeted recompute]
The budget: the activation peak of the partitioned forward and backward graphs (static liveness,
``budget.planning_profile``, the projection the gather budget is derived from) must stay
within ``A = M - G``. M is the memory every rank agreed on for the graph (``budget.graph_memory``);
G is kept for gathered weights (``budget.gather_reserve``): what one node reads at once plus
``PREFETCH_BLOCKS`` blocks'
weights (the block that runs and the one being prefetched), or ``budget_bytes`` when the user
set it. The gather planner then plans each graph in ``M - activation peak >= G``
([Note: rank-agreed budget]), so activations and gathered weights together stay within M at
every node. ``activation_budget_bytes`` sets A directly.
The plan: partition once with every region at level 0 (the base), estimate each region's levels
from the joint graph (``level_specs``), plan them (recompute_plan.py), partition with the plan and
measure it. A plan is accepted only when its measured peak is within A. The estimate of a
region's "selective" level was within 1 % of the measured peak on qwen3-8b layers; keeping a
whole region is overestimated (the min-cut partitioner saves less than every tensor backward
reads, and kept tensors overlap what is live at the peak anyway: keeping all 4 layers raised the
peak by 9.3 GiB where the estimate said 13.4). So the planner's budget is searched: first A, then
by the measured error of the plans tried (a straight line between the best plan that fit and the
smallest that did not, or A scaled by the model's overestimate while nothing failed, and the
plan keeping everything when the model offers nothing more), up to
``MAX_PARTITIONS`` partitions with the base; the accepted plan that recomputes least wins, and the base (the user's checkpointing) is the fallback. A base above A cannot be helped: A is raised to it and
the record says so, as the gather planner raises its budget to its floor. Every input (graph,
sizes, options, the agreed memory) is the same on every rank and every step is deterministic, so
every rank partitions alike ([Note: rank-invariant schedule]).

[Note: per-region recompute]
Why zbuf plans per region, with levels, rather than through the min-cut partitioner's own budget
(``torch._functorch.config.activation_memory_budget``: a 0-1 knapsack over single ops, then a
min cut; its solver may be a callable). Measured on CPU with fake tensors, qwen3-8b layers (4),
micro-batch 4, seq 4096, 2 ranks (benches/recompute_cpu.py; benches/results/recompute_cpu.md):
- what the knapsack bounds is the bytes of the ops it keeps, as a fraction between "save only the
  inputs" and the runtime-optimal cut. A zbuf solver (``CustomKnapsackSolver``) can take an exact
  byte budget (its items are the nodes, their sizes known) and the min cut then kept no more than
  it (7 of 7 budgets). But the peak is not those bytes, and it is not monotonic in them: at
  fraction 0 the backward peak was 20.8 GiB, at 0.5 12.3 GiB (pytorch#197838). So a byte budget on
  the knapsack bounds nothing zbuf must keep within; a plan must be measured either way;
- at fraction 0 the knapsack saves only the graph inputs, ignoring ``MUST_SAVE``: the tags
  selective persistence puts on gathered weights kept for backward;
- at the same measured peak (the larger of forward and backward), the per-region levels
  recompute less: 11.5 TFLOP at 10.2 GiB (the knapsack with zbuf's byte solver: 14.3 at 10.1),
  5.8 at 11.4 GiB (9.4 at 11.2), none at 12.6 GiB (4.4 at 12.4; the knapsack reaches none at
  14.0 GiB, at fraction 0.8); recomputing every block costs 24.7 TFLOP at 7.7 GiB. The
  "selective" level (matmul and attention outputs kept) removes every block's matmul recompute
  for 56 % of what keeping the blocks costs;
- a region decision is a tag change whose cost is read off the joint graph, identical blocks get
  identical decisions (which compiling a block once, issue 14, needs), and the user's own
  checkpointing is level 0: the fallback is exactly what ``"checkpointed"`` does.
The cost is compile time: an ``"auto"`` plan runs 2 to ``MAX_PARTITIONS`` min-cut partitions
(4.3-10.1 s against 2.4 s for one, for these 4 layers on a loaded 2-core machine).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from . import budget as budget_mod
from .graph_info import (
    backward_nodes,
    gather_nodes,
    gradient_shard_bytes,
    group_and_device,
    is_view,
    node_flops,
    node_seconds,
    tensor_bytes,
    unpacks_results,
    weight_tree,
)
from .options import CompileOptions
from .recompute_plan import RecomputePlan, RegionLevel, RegionSpec, plan_recompute

__all__ = ["LEVELS", "RecomputeStats", "Region", "find_regions", "level_specs", "apply_levels",
           "partition", "copy_joint", "forward_nodes", "forward_names", "measure_partition",
           "MAX_PARTITIONS"]

aten = torch.ops.aten

MAX_PARTITIONS = 4
"""Most min-cut partitions one ``"auto"`` plan may run (the base included)."""

_MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default)

LEVELS = ("recompute", "selective", "keep")


@dataclass(frozen=True)
class RecomputeStats:
    """What one compiled forward/backward pair kept and recomputed (both graphs' records carry
    it)."""

    mode: str
    """``CompileOptions.recompute``."""
    regions: int = 0
    """Candidate regions (checkpointed blocks) in the graph."""
    regions_recomputed: int = 0
    """Regions left at level 0 (recomputed as the user checkpointed them)."""
    regions_selective: int = 0
    """Regions keeping their matmul and attention outputs, recomputing the rest."""
    regions_kept: int = 0
    """Regions recomputing nothing."""
    regions_offloaded: int = 0
    """Of those, blocks whose kept activations wait in host memory ([Note: offloaded blocks] in
    block_offload.py)."""
    activation_budget_bytes: int = 0
    """``"auto"``: the budget of the activation peak (A of [Note: budgeted recompute], after any
    raise to the base); 0 in other modes."""
    requested_activation_budget_bytes: int = 0
    """``"auto"``: A as derived or set, before a raise to the base."""
    activation_peak_bytes: int = 0
    """Measured activation peak of the partitioned forward and backward graphs."""
    kept_bytes: int = 0
    """Activation bytes the forward saves for backward (not parameters, inputs or gathered
    weights)."""
    recomputed_bytes: int = 0
    """Bytes of the tensors backward recomputes (not re-gathered weights)."""
    forward_flops: float = 0.0
    """Matmul and attention FLOPs of the forward graph."""
    recomputed_flops: float = 0.0
    """Matmul and attention FLOPs that backward re-runs from the forward."""
    partitions: int = 0
    """Min-cut partitions this compile ran."""

    def to_dict(self) -> dict:
        import dataclasses

        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Region:
    key: str
    position: int
    names: tuple[str, ...]
    """Forward nodes of the region, by name (names survive the graph copies of the plan)."""


def forward_nodes(graph: torch.fx.Graph, num_fwd_outputs: int) -> set[torch.fx.Node]:
    """The forward of a joint graph: what its forward outputs (the first ``num_fwd_outputs``)
    need, every node of a checkpointed region (a region's values that only backward reads,
    attention's log-sum-exp say, are computed in the forward too), and every item of a forward
    op with several results (an item that only backward reads is computed with the op, in the
    forward: attention's log-sum-exp outside a region). Everything else runs in backward,
    tangent or not (a backward may start from values of the forward alone: the zeros a loss's
    gradient is scattered into)."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    tangent_dependent = backward_nodes(graph)
    stack = [a for a in out.args[0][:num_fwd_outputs] if isinstance(a, torch.fx.Node)]
    stack += [n for n in graph.nodes if "ac_graph_id" in n.meta]
    seen: set[torch.fx.Node] = set()
    while stack:
        n = stack.pop()
        if n not in seen and n not in tangent_dependent:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen | {u for n in seen for u in n.users
                   if unpacks_results(u) and u not in tangent_dependent}


def find_regions(graph: torch.fx.Graph,
                 forward: Optional[set[torch.fx.Node]] = None) -> list[Region]:
    """The candidate regions of a joint graph: ``forward`` nodes (``forward_nodes``; None: the
    nodes that read no tangent) grouped by checkpoint region (``ac_graph_id``), in forward
    order."""
    if forward is None:
        forward = set(graph.nodes) - backward_nodes(graph)
    members: dict[object, list[torch.fx.Node]] = {}
    first: dict[object, int] = {}
    for i, n in enumerate(graph.nodes):
        rid = n.meta.get("ac_graph_id")
        if rid is None or n not in forward or n.op != "call_function":
            continue
        members.setdefault(rid, []).append(n)
        first.setdefault(rid, i)
    return [Region(str(rid), first[rid], tuple(n.name for n in members[rid]))
            for rid in sorted(members, key=first.__getitem__)]


def _is_saved_op(n: torch.fx.Node) -> bool:
    """Is ``n`` (or the multi-output op it takes an item of) one whose output the
    ``"selective"`` level keeps: a matmul or attention (any ``scaled_dot_product`` forward
    kernel, as graph_info's FLOP count names them), what costs FLOPs to recompute? The op list of
    torchtitan's selective checkpointing, without its every-second-matmul rule: recomputing a
    matmul is what a kept byte should save."""
    if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node):
        n = n.args[0]
    if n.target in _MATMULS:
        return True
    name = getattr(n.target, "__name__", "")
    return "scaled_dot_product" in name and "backward" not in name


def _gather_trees(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Gathers and their view/cast users: weights, re-gathered rather than recomputed."""
    return {n for g in gather_nodes(graph) for n in (g, *weight_tree(g))}


def _value_bytes(n: torch.fx.Node) -> int:
    """Bytes a node's output occupies: none for views (their base holds them) and for
    multi-output nodes (the getitems that unpack their results hold them: attention's output
    and log-sum-exp)."""
    val = n.meta.get("val")
    if (is_view(n) and not unpacks_results(n)) or not isinstance(val, torch.Tensor):
        return 0
    return tensor_bytes(val)


def level_specs(graph: torch.fx.Graph, forward: set[torch.fx.Node], regions: list[Region],
                options: CompileOptions) -> list[RegionSpec]:
    """Estimate every region's levels from the joint graph ([Note: budgeted recompute]).

    A level's recompute is the closure of the region's nodes that backward reads, through their
    inputs inside the region, stopping at what the level saves; its extra bytes are what it saves
    beyond level 0 (the user's own ``MUST_SAVE`` tags are saved at every level)."""
    # The output node is no reader: it returns the forward's outputs beside the gradients, and
    # what backward keeps of the forward its own nodes read.
    bw = {n for n in graph.nodes if n not in forward and n.op not in ("placeholder", "output")}
    weights = _gather_trees(graph)
    by_name = {n.name: n for n in graph.nodes}
    order = {n: i for i, n in enumerate(graph.nodes)}
    specs = []
    for region in regions:
        nodes = [by_name[name] for name in region.names]
        inside = set(nodes)
        user_saved = {n for n in nodes if n.meta.get("recompute") is CheckpointPolicy.MUST_SAVE}

        def read_by_backward(n: torch.fx.Node) -> bool:
            stack, seen = [n], set()
            while stack:
                for u in stack.pop().users:
                    if u in bw:
                        return True
                    if is_view(u) and u in inside and u not in seen:
                        seen.add(u)
                        stack.append(u)
            return False

        direct = [n for n in nodes if n not in weights and read_by_backward(n)]

        def closure(saved: set[torch.fx.Node]) -> set[torch.fx.Node]:
            need, stack = set(), list(direct)
            while stack:
                n = stack.pop()
                if n in need or n in weights:
                    continue
                need.add(n)
                if n not in saved:
                    stack.extend(a for a in n.all_input_nodes if a in inside)
            return need

        def cost(recomputed: set[torch.fx.Node]) -> tuple[float, float]:
            # Summed in graph order, not set order (which follows node addresses): float sums
            # in another order differ in the last bit, and identical blocks would then tie
            # differently on each rank, and the ranks compile different graphs.
            ordered = sorted(recomputed, key=order.__getitem__)
            return (sum(node_seconds(n, options) for n in ordered),
                    sum(node_flops(n) for n in ordered))

        need0 = closure(user_saved)
        sec0, flops0 = cost(need0 - user_saved)
        sel_saved = user_saved | {n for n in nodes if _is_saved_op(n)}
        need1 = closure(sel_saved)
        sec1, flops1 = cost(need1 - sel_saved)
        sel_bytes = sum(_value_bytes(n) for n in need1 & (sel_saved - user_saved))
        keep_bytes = sum(_value_bytes(n) for n in direct if n not in user_saved)
        specs.append(RegionSpec(region.key, region.position, (
            RegionLevel("recompute", 0, sec0, flops0),
            RegionLevel("selective", sel_bytes, sec1, flops1),
            RegionLevel("keep", keep_bytes, 0.0, 0.0),
        )))
    return specs


def apply_levels(graph: torch.fx.Graph, regions: list[Region], levels: tuple[int, ...]) -> None:
    """Retag the regions' nodes for their levels (level 0 leaves the user's tags)."""
    by_name = {n.name: n for n in graph.nodes}
    for region, level in zip(regions, levels):
        name = LEVELS[level]
        if name == "recompute":
            continue
        for node_name in region.names:
            n = by_name.get(node_name)
            if n is None:
                continue
            if name == "keep":
                n.meta.pop("recompute", None)
            elif _is_saved_op(n):
                n.meta["recompute"] = CheckpointPolicy.MUST_SAVE


def forward_names(graph: torch.fx.Graph, num_fwd_outputs: int) -> set[str]:
    """Names of a joint graph's forward compute nodes (a backward node with one of them is a
    recomputation)."""
    return {n.name for n in forward_nodes(graph, num_fwd_outputs) if n.op == "call_function"}


def copy_joint(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A module over a copy of the graph: new nodes and meta dicts (tags stay apart), shared
    example values."""
    return torch.fx.GraphModule(gm, gm.graph.__deepcopy__())


def _activation_peak(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule,
                     options: CompileOptions) -> int:
    return max(int(budget_mod.planning_profile(g.graph, options).max(initial=0))
               for g in (fw, bw))


def measure_partition(mode: str, forward_names: set[str], fw: torch.fx.GraphModule,
                      bw: torch.fx.GraphModule, options: CompileOptions, **fields) -> RecomputeStats:
    """What a partition kept and recomputes; ``forward_names``: the joint graph's forward nodes."""
    fw_inputs = {n.name for n in fw.graph.nodes if n.op == "placeholder"}
    weights = {n.name for n in _gather_trees(fw.graph)}
    kept = sum(tensor_bytes(n.meta.get("val")) for n in bw.graph.nodes
               if n.op == "placeholder" and not n.name.startswith("tangents")
               and n.name not in fw_inputs and n.name not in weights
               and not n.meta.get("zbuf_persistent"))
    bw_weights = _gather_trees(bw.graph)
    recomputed = [n for n in bw.graph.nodes
                  if n.op == "call_function" and n.name in forward_names and n not in bw_weights]
    return RecomputeStats(
        mode=mode,
        activation_peak_bytes=_activation_peak(fw, bw, options),
        kept_bytes=kept,
        recomputed_bytes=sum(_value_bytes(n) for n in recomputed),
        forward_flops=sum(node_flops(n) for n in fw.graph.nodes if n.op == "call_function"),
        recomputed_flops=sum(node_flops(n) for n in recomputed),
        **fields)


T = TypeVar("T")
Partitioner = Callable[[torch.fx.GraphModule], tuple[torch.fx.GraphModule, torch.fx.GraphModule]]
TagGathers = Callable[[torch.fx.Graph, Optional[int]], T]


def partition(gm: torch.fx.GraphModule, num_fwd_outputs: int, options: CompileOptions,
              min_cut: Partitioner, tag_gathers: TagGathers
              ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, T, RecomputeStats]:
    """Partition the joint graph ``gm`` under ``options.recompute`` ([Note: recompute modes]).

    ``num_fwd_outputs``: the joint graph's forward outputs come first (the partitioner's
    argument of that name); ``min_cut`` partitions a joint module; ``tag_gathers(graph, activation_peak)`` puts the
    gathers' re-gather / persistence tags on it, budgeting persistence against that activation
    peak (None: the joint graph's own), and returns what it decided, which comes back with the
    partition that was chosen."""
    mode = options.recompute
    forward = forward_nodes(gm.graph, num_fwd_outputs)
    fwd = {n.name for n in forward if n.op == "call_function"}
    regions = find_regions(gm.graph, forward)
    counts = dict(regions=len(regions))

    def run(levels: tuple[int, ...], activation_peak: Optional[int]):
        trial = copy_joint(gm)
        apply_levels(trial.graph, regions, levels)
        token = tag_gathers(trial.graph, activation_peak)
        return (*min_cut(trial), token)

    def by_level(levels: tuple[int, ...]) -> dict:
        return dict(regions_recomputed=levels.count(0), regions_selective=levels.count(1),
                    regions_kept=levels.count(2))

    if mode != "auto" or not regions or options.measuring:
        # The measured step's plan keeps no activations beyond the user's checkpointing
        # ([Note: measure first, then spend] in zbuf/memory/step.py): auto's levels come after.
        levels = (2 if mode == "none" else 0,) * len(regions)
        apply_levels(gm.graph, regions, levels)
        token = tag_gathers(gm.graph, None)
        fw, bw = min_cut(gm)
        return fw, bw, token, measure_partition(mode, fwd, fw, bw, options, partitions=1, **counts,
                                                **by_level(levels))

    group_name, device = group_and_device(gm.graph)
    if options.activation_budget_bytes is not None:
        requested = options.activation_budget_bytes
    else:
        memory = budget_mod.graph_memory(
            options, device or torch.device("cpu"),
            budget_mod.gradient_reserve(options, gradient_shard_bytes(gm.graph), backward=True))
        requested = max(1, memory - budget_mod.gather_reserve(gm.graph, options))
    specs = level_specs(gm.graph, forward, regions, options)
    base_levels = (0,) * len(regions)
    fw, bw, token = run(base_levels, None)
    base = _activation_peak(fw, bw, options)
    budget = max(requested, base)
    best = (base_levels, fw, bw, token)
    best_seconds = sum(s.levels[0].recompute_seconds for s in specs)
    # Search the planner's budget for the plan that recomputes least and measures within A
    # ([Note: budgeted recompute]): first the plan at A itself; then, between the largest plan
    # that fit (lo) and the smallest that did not (hi), the budget where a straight line through
    # their (modelled, measured) peaks meets A; while nothing failed, A scaled by how far the
    # model overestimated the last plan, and the plan keeping everything when that adds nothing.
    lo = (base, base)  # (modelled, measured) peak of the best accepted plan
    hi = None
    model_budget = budget
    tried = {base_levels}
    partitions = 1
    everything = plan_recompute(specs, base, base + sum(
        max(lv.extra_bytes for lv in s.levels) for s in specs) + 1)
    while partitions < MAX_PARTITIONS:
        plan: RecomputePlan = plan_recompute(specs, base, max(1, model_budget))
        if plan.levels in tried or (hi is not None and plan.modelled_peak_bytes >= hi[0]):
            if hi is not None or everything.levels in tried:
                break
            # Nothing failed yet and the model has nothing more to offer: it may overestimate
            # (keeping whole regions); measuring the plan that keeps everything calibrates it.
            plan = everything
        tried.add(plan.levels)
        fw, bw, token = run(plan.levels, min(plan.modelled_peak_bytes, budget))
        partitions += 1
        peak = _activation_peak(fw, bw, options)
        point = (plan.modelled_peak_bytes, peak)
        if peak <= budget:
            if plan.recompute_seconds < best_seconds:
                best, best_seconds = (plan.levels, fw, bw, token), plan.recompute_seconds
            lo = max(lo, point)
        else:
            hi = point if hi is None else min(hi, point)
        if hi is None:
            modelled, measured = lo[0] - base, lo[1] - base
            model_budget = (base + (budget - base) * modelled // measured if measured > 0
                            else budget)
        else:
            slope = (hi[0] - lo[0]) / max(hi[1] - lo[1], 1)
            model_budget = min(lo[0] + int((budget - lo[1]) * slope), hi[0] - 1)
    levels, fw, bw, token = best
    return fw, bw, token, measure_partition(mode, fwd, fw, bw, options, partitions=partitions,
                          activation_budget_bytes=budget, requested_activation_budget_bytes=requested,
                          **counts, **by_level(levels))
