"""What the passes do about nested compile regions (``invoke_subgraph`` calls of a block body).

[Note: region bodies]
With blocks marked by ``regions.mark_repeated_blocks`` ([Note: compile repeated blocks once]),
AOTAutograd partitions each distinct region body on its own (the partitioner is called with the
body's joint graph and no example inputs) before the outer joint graph, then stitches the
partitioned forward and backward bodies back into it: the forward call returns the body's saved
tensors, which the outer graph hands to the backward call. Step 0 puts a user's checkpoint
around a block into the body; steps 1-3 keep the gathered weights the outer graph's to plan:

0. Dynamo's graph (``checkpoint_bodies``, before AOTAutograd, ``recompute="checkpointed"``
   only): a body every call of which is under a user's plain ``torch.utils.checkpoint``
   (``checkpoint(block, x)`` in the user's loop, around the marked block's call) gets that
   checkpoint's tags (``PREFER_RECOMPUTE``) on its own nodes, as if the block checkpointed its
   own forward. The body's partition then saves only its inputs and its backward recomputes the
   block, freeing each recomputed tensor after its last use; the outer backward re-runs no
   block call. Without it, the body saved its activations (it did not know it was checkpointed)
   and the outer graph re-ran the call in backward (step 3) to get them, and held them as the
   backward call's operands through the whole call, where the whole graph frees each after its
   last use. 6 checkpointed MLP blocks (tests/test_compile_regions.py), backward activation
   peak, bytes: compiled whole 4,988,928 projected (``schedule_report``), 5,263,881 measured
   (CPU allocator, profiler, graphs run freeing each value after its last use as Inductor's
   code does); compiled once 6,103,040 / 6,312,457 before, 5,054,464 / 5,263,881 with it. The
   projection's 65,536 above whole is one weight's gradient: a block call returns its gradients
   when it ends (the body holds no reduce-scatter, step 4), so the one made first in the
   block's backward is live at the body's peak, where the whole graph has reduce-scattered it
   into its shard (the model's state, not counted: [Note: the model's state is not an
   activation] in budget.py). The allocator counts that shard too: measured on one rank the
   two are equal; on N ranks the shard is 1/N of the gradient. Run by aot_eager (which keeps
   every saved tensor to the end of backward), once measures 262,144 (one block output) above
   whole: the last block's output, saved for the head, which the whole graph recomputes with
   the last block (benches/results/region_checkpoint_peak_cpu.md). A body also called outside a
   plain checkpoint (a selective one, whose policy decides per op while AOTAutograd traces, or
   none) is left as it is, so a block the user did not checkpoint is never recomputed; step 3
   then bounds its checkpointed calls.
1. Body joint (``prepare_body_joint``): views and casts of the body's inputs are tagged
   ``MUST_RECOMPUTE``, so the body saves an input itself rather than a view of it (a transposed
   weight). An input saved so is returned unchanged by the forward body.
2. Outer joint (``forward_region_inputs``): a forward call's result that is one of its inputs
   passed through is replaced, in the outer graph, by that input. The backward call then reads
   the outer gather directly; zbuf's recompute tags make backward re-gather it (or keep it, under
   selective persistence), where otherwise every block's gathered weights would be saved from
   forward to backward through the calls' results.
3. Outer joint (``keep_block_boundaries``): a forward call under the user's checkpoint has its
   results that forward reads on (the block's output, the next block's input) saved: read
   through a ``clone`` tagged ``MUST_SAVE`` (the partitioner never bans a ``getitem`` from
   recompute; Inductor removes the copy as a no-op after partitioning, or it costs one block
   output's copy per block). Without it the outer partition sees the calls as one chain of
   recomputable nodes and saves only the embedding's output: backward re-ran every block's
   forward before the first block's backward (a static backward activation peak of 120 GiB for
   qwen3-14b as rank 0 of 8, against 19 GiB compiled whole); with step 0 that chain is still
   re-run (the calls keep the user's tags), each block's forward then twice in backward. A call
   whose body step 0 left alone is re-run by the outer backward; each such recomputed forward
   call moves to just before its first reader (``sink_region_calls``), so one block's
   recomputation is live at a time, as the whole graph's checkpointing does.
4. Post-grad: the partitioned bodies are marked (``mark_body``) and the schedule pass leaves
   them alone (``is_body``); they hold no collective, the outer graphs hold them all.

A body that gathers (a user's own ``nested_compile_region`` around code that reads sharded
parameters) is refused: its gathers would be invisible to the plan of the outer graph.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from .graph_info import backward_nodes, gather_nodes, is_view, weight_tree
from .options import CompileOptions
from .recompute import LEVELS, apply_levels, find_regions

__all__ = ["REGION_OP", "is_region_call", "checkpoint_bodies", "prepare_body_joint",
           "forward_region_inputs", "keep_block_boundaries", "sink_region_calls",
           "mark_body", "is_body", "body_of"]

REGION_OP = torch.ops.higher_order.invoke_subgraph
_CHECKPOINT_OP = torch.ops.higher_order.tag_activation_checkpoint

_BODY = "zbuf_region_body"


def is_region_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is REGION_OP


def body_of(node: torch.fx.Node) -> torch.fx.GraphModule:
    """The subgraph a region call runs (its first argument is a ``get_attr``)."""
    return getattr(node.graph.owning_module, node.args[0].target)


def checkpoint_bodies(gm: torch.fx.GraphModule) -> int:
    """Step 0 of [Note: region bodies], on Dynamo's graph: a body every call of which is under a
    user's plain ``torch.utils.checkpoint`` gets that checkpoint's tags on its own nodes. Returns
    how many bodies were tagged."""
    plain: set[int] = set()  # the graphs plain checkpoints run
    callers: dict[int, tuple[torch.fx.GraphModule, list[int]]] = {}  # body -> calling graphs
    for m in gm.modules():
        if not isinstance(m, torch.fx.GraphModule):
            continue
        for n in m.graph.nodes:
            if n.op != "call_function":
                continue
            if n.target is _CHECKPOINT_OP:
                # A selective checkpoint's policy decides per op while AOTAutograd traces
                # (Dynamo leaves it on the graph's meta): a region call is one op to it.
                if "_checkpoint_context_fn" not in body_of(n).meta:
                    plain.add(id(body_of(n)))
            elif is_region_call(n):
                callers.setdefault(id(body_of(n)), (body_of(n), []))[1].append(id(m))
    tagged = 0
    for body, graphs in callers.values():
        if not all(g in plain for g in graphs):
            continue
        for n in body.graph.nodes:
            if n.op == "call_function" and "recompute" not in n.meta:
                # What a plain checkpoint's nodes get (TagActivationCheckpoint.tag_nodes).
                n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                n.meta["ac_graph_id"] = _BODY
        tagged += 1
    return tagged


def prepare_body_joint(joint: torch.fx.Graph, options: CompileOptions) -> None:
    """Step 1 of [Note: region bodies]; refuses a body that gathers. ``recompute="none"`` keeps
    the activations of the body's checkpointed regions, as it does for a whole graph's
    ([Note: recompute modes] in recompute.py); ``"auto"`` plans over the whole graph and does not
    combine with bodies compiled once (``CompileOptions.compile_blocks_once``)."""
    gathers = gather_nodes(joint)
    if gathers:
        raise RuntimeError(
            f"zbuf: a nested compile region gathers sharded parameters inside its body "
            f"({len(gathers)} zbuf::all_gather, e.g. {gathers[0].format_node()}); zbuf plans "
            "gathers on the outer graph. Let zbuf.compile(..., compile_blocks_once=True) mark "
            "the repeated blocks (it gathers outside the region), or do not wrap code that reads "
            "sharded parameters in torch.compiler.nested_compile_region")
    if options.recompute == "none":
        regions = find_regions(joint)
        apply_levels(joint, regions, (LEVELS.index("keep"),) * len(regions))
    for p in joint.find_nodes(op="placeholder"):
        if p.name.startswith("primals"):
            for v in weight_tree(p):  # a body's primals are the gathered weights
                v.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def forward_region_inputs(joint: torch.fx.Graph) -> int:
    """Step 2 of [Note: region bodies]; returns how many results were replaced.

    Raises if a call still returns a view of one of its inputs (step 1 failed to prevent it):
    the outer graph would then keep that input, a gathered weight, alive to backward unplanned.
    """
    replaced = 0
    for n in list(joint.nodes):
        if not is_region_call(n):
            continue
        body = body_of(n).graph
        inputs = list(body.find_nodes(op="placeholder"))
        results = body.output_node().args[0]
        for u in list(n.users):
            if u.target is not operator.getitem:
                continue
            r = results[u.args[1]]
            if not isinstance(r, torch.fx.Node):
                continue
            if r.op == "placeholder":
                u.replace_all_uses_with(n.args[2 + inputs.index(r)])
                replaced += 1
            elif is_view(r) and _view_root(r).op == "placeholder":
                raise AssertionError(
                    f"zbuf: region body {n.args[1]} returns {r.format_node()}, a view of its "
                    "input, as a saved tensor; this is a zbuf bug")
    return replaced


def keep_block_boundaries(joint: torch.fx.Graph) -> int:
    """Step 3 of [Note: region bodies]; returns how many results were tagged."""
    calls = [n for n in joint.nodes if is_region_call(n) and "ac_graph_id" in n.meta]
    if not calls:
        return 0
    backward = backward_nodes(joint)
    tagged = 0
    for n in calls:
        if n in backward:
            continue
        for u in list(n.users):
            readers = [v for v in u.users if v not in backward]
            if u.target is not operator.getitem or not readers:
                continue
            # The partitioner never bans a getitem from recompute (its MUST_SAVE tag is
            # ignored), so the boundary is a copy that forward reads on and backward saves.
            with joint.inserting_after(u):
                boundary = joint.call_function(torch.ops.aten.clone.default, (u,))
            boundary.meta.update(val=u.meta.get("val"), recompute=CheckpointPolicy.MUST_SAVE)
            # Backward reads the saved copy too (the next block's backward call takes its
            # input): reading the result itself would recompute this block early.
            u.replace_all_uses_with(boundary, delete_user_cb=lambda v: v is not boundary)
            tagged += 1
    return tagged


def sink_region_calls(graph: torch.fx.Graph) -> int:
    """Step 3 of [Note: region bodies], in a backward graph: each region call (a block's
    recomputed forward) moves down to just before the first node that reads its results, so
    backward re-runs one block at a time (the partitioner placed the recomputations of later
    blocks ahead of the backward call of the first). Returns how many moved."""
    moved = 0
    for n in reversed([m for m in graph.nodes if is_region_call(m)]):
        pos = {m: i for i, m in enumerate(graph.nodes)}
        parts = [n, *(u for u in n.users if u.target is operator.getitem)]
        readers = [v for p in parts for v in p.users if v not in parts]
        if not readers:
            continue
        first = min(readers, key=pos.__getitem__)
        if pos[first] == pos[n] + len(parts):
            continue
        for p in sorted(parts, key=pos.__getitem__):
            first.prepend(p)
        moved += 1
    return moved


def _view_root(node: torch.fx.Node) -> torch.fx.Node:
    while is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def mark_body(*modules: torch.fx.GraphModule) -> None:
    for m in modules:
        m.meta[_BODY] = True


def is_body(graph: torch.fx.Graph) -> bool:
    gm = graph.owning_module
    return gm is not None and bool(getattr(gm, "meta", {}).get(_BODY))
