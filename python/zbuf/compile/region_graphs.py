"""What the passes do about nested compile regions: a model's own ``invoke_subgraph`` calls.

[Note: region bodies]
A model may wrap code in ``torch.compiler.nested_compile_region`` itself (a block body it
compiles once). AOTAutograd partitions each distinct region body on its own (the partitioner is
called with the body's joint graph and no example inputs) before the outer joint graph, then
stitches the partitioned forward and backward bodies back into it: the forward call returns the
body's saved tensors, which the outer graph hands to the backward call. zbuf plans the gathers of
the outer graph; steps 1-3 keep the gathered weights the outer graph's to plan, and step 0
refuses what torch cannot recompute:

0. Dynamo's graph (``refuse_checkpointed_calls``, ``recompute="checkpointed"``): a region
   call under the caller's checkpoint is refused with one line. torch 2.11 partitions the body
   before it sees the checkpoint around the call, so the body saves every activation as a result
   of its forward call and the outer backward re-runs the call to get them back (the body's
   forward twice in backward). With an attention op in the body the re-run crashes: the
   partitioner replays the RNG state of a recomputed ``nondeterministic_seeded`` op (every
   ``scaled_dot_product_attention``) through ``run_and_save_rng_state``, whose fake
   implementation returns a real tensor, and Inductor's fake propagation of the backward stops
   on it ("Please convert all Tensors to FakeTensors").
1. Body joint (``prepare_body_joint``): a body that gathers (code that reads sharded parameters)
   is refused: its gathers would be invisible to the plan. Views and casts of the body's inputs
   are tagged ``MUST_RECOMPUTE``, so the body saves an input itself rather than a view of it (a
   transposed weight). An input saved so is returned unchanged by the forward body.
2. Outer joint (``forward_region_inputs``): a forward call's result that is one of its inputs
   passed through is replaced, in the outer graph, by that input. The backward call then reads
   the outer gather directly; zbuf's recompute tags make backward re-gather it (or keep it, under
   selective persistence), where otherwise a weight handed to the body would be saved from
   forward to backward through the call's results, unplanned.
3. Post-grad: the partitioned bodies are marked (``mark_body``) and the schedule pass leaves
   them alone (``is_body``); they hold no collective, the outer graphs hold them all.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from .graph_info import gather_nodes, is_view, weight_tree
from .options import CompileOptions
from .recompute import LEVELS, apply_levels, find_regions

__all__ = ["REGION_OP", "is_region_call", "refuse_checkpointed_calls", "prepare_body_joint",
           "forward_region_inputs", "mark_body", "is_body", "body_of"]

REGION_OP = torch.ops.higher_order.invoke_subgraph
_CHECKPOINT_OP = torch.ops.higher_order.tag_activation_checkpoint

_BODY = "zbuf_region_body"


def is_region_call(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is REGION_OP


def body_of(node: torch.fx.Node) -> torch.fx.GraphModule:
    """The subgraph a region call runs (its first argument is a ``get_attr``)."""
    return getattr(node.graph.owning_module, node.args[0].target)


def refuse_checkpointed_calls(gm: torch.fx.GraphModule) -> None:
    """Step 0 of [Note: region bodies], on Dynamo's graph: raise if a region call runs inside a
    checkpoint's graph."""
    inside = set()  # the graphs checkpoints run
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule):
            inside.update(id(body_of(n)) for n in m.graph.nodes
                          if n.op == "call_function" and n.target is _CHECKPOINT_OP)
    for m in gm.modules():
        if isinstance(m, torch.fx.GraphModule) and id(m) in inside:
            call = next((n for n in m.graph.nodes if is_region_call(n)), None)
            if call is not None:
                raise ValueError(
                    "zbuf: a torch.compiler.nested_compile_region is called under "
                    "torch.utils.checkpoint, which torch 2.11 cannot recompute ([Note: region "
                    "bodies] in zbuf/compile/region_graphs.py); checkpoint inside the region's "
                    "function, or call it without nested_compile_region")


def prepare_body_joint(joint: torch.fx.Graph, options: CompileOptions) -> None:
    """Step 1 of [Note: region bodies]; refuses a body that gathers. ``recompute="none"`` keeps
    the activations of the body's checkpointed regions, as it does for a whole graph's
    ([Note: recompute modes] in recompute.py)."""
    gathers = gather_nodes(joint)
    if gathers:
        raise RuntimeError(
            f"zbuf: a nested compile region gathers sharded parameters inside its body "
            f"({len(gathers)} zbuf::all_gather, e.g. {gathers[0].format_node()}); zbuf plans "
            "gathers on the outer graph. Read the weights outside the region and pass them in as "
            "arguments, or do not wrap code that reads sharded parameters in "
            "torch.compiler.nested_compile_region (zbuf.compile's default structure compiles "
            "each repeated block once)")
    if options.recompute == "none":
        regions = find_regions(joint)
        apply_levels(joint, regions, (LEVELS.index("keep"),) * len(regions))
    for p in joint.find_nodes(op="placeholder"):
        if p.name.startswith("primals"):
            for v in weight_tree(p):  # a body's primals may be gathered weights
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
