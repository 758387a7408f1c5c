"""The ``zbuf`` torch.compile backend: Inductor (or aot_eager) with the zbuf passes.

``torch.compile(model, backend="zbuf", options={...})`` finds this through the
``torch_dynamo_backends`` entry point; ``zbuf.compile(model, ...)`` (compiled_model.py) is the
same with keyword options, the one-time rank agreement on free memory ([Note: rank-agreed
budget] in budget.py) and the step's measured memory.

Only public hooks are used (``compile_inner``, which block frames compile with too):
``compile_fx(..., config_patches=...)`` (applied to the forward and to the lazily compiled
backward alike) with ``custom_partitioner_fn`` and ``post_grad_custom_post_pass``; for aot_eager,
``aot_autograd`` with the same partitioner and the schedule pass as forward/backward compilers.
Before either, Dynamo's graph is only checked: a nested compile region may not be called under
the caller's checkpoint ([Note: region bodies] step 0 in region_graphs.py).

[Note: cacheable recompute of seeded ops]
When activation checkpointing recomputes an op tagged ``nondeterministic_seeded`` (on CUDA,
every flash or cuDNN attention, whatever its dropout), AOTAutograd's partitioner threads the
RNG state from forward to backward. On CUDA it does so by default with the
``graphsafe_run_with_rng_state`` higher-order op, made for CUDA-graph capture, which Inductor's
FX-graph cache refuses: on the H200 every zbuf first step with ``--ac`` bypassed the cache
("Can't cache HigherOrderOperator: graphsafe_run_with_rng_state"), so no relaunch could start
warm. zbuf's graphs are never captured as CUDA graphs (their collectives and pool calls run on
the host), so the backend partitions with ``graphsafe_rng_functionalization`` off: the same
replay of the RNG state through ``run_and_save_rng_state`` / ``run_with_rng_state``, which the
cache accepts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn

from . import report
from .options import CompileOptions
from .passes import GatherSchedulePass, PlanState, ZbufPartitioner
from .region_graphs import refuse_checkpointed_calls

__all__ = ["zbuf_backend", "compile_inner"]


def zbuf_backend(
    gm: torch.fx.GraphModule,
    example_inputs: list[Any],
    options: Mapping[str, Any] | CompileOptions | None = None,
    mode: str | None = None,
):
    if mode is not None:
        raise ValueError(
            f"backend 'zbuf' takes no mode (got mode={mode!r}); pass options={{...}} instead, "
            f"valid keys: {[f.name for f in dataclasses.fields(CompileOptions)]}"
        )
    opts = CompileOptions.from_mapping(options)
    report.claim(_gathered_shards(gm, example_inputs))  # [Note: records live with their model]
    if opts.recompute == "checkpointed":
        refuse_checkpointed_calls(gm)  # [Note: region bodies], step 0
    state = PlanState(opts)
    return compile_inner(gm, example_inputs, opts.inner, ZbufPartitioner(state),
                         GatherSchedulePass(state))


def compile_inner(gm: torch.fx.GraphModule, example_inputs: list[Any], inner: str,
                  partitioner: CustomPartitionerFn, graph_pass: Optional[CustomGraphPass] = None):
    """What compiles a graph for both structures (the whole graph's, a block frame's): Inductor,
    with ``partitioner`` splitting the joint graph and ``graph_pass`` run on the forward and the
    backward graphs after Inductor's post-grad passes; or ``aot_eager``, AOTAutograd with the same
    partitioner and the pass run on the graphs it hands on, which then run as they are. With a
    graph pass, ``reorder_for_peak_memory`` is off, because it sinks hoisted gather starts back to
    their waits, undoing prefetch. Either way seeded ops replay cacheably ([Note: cacheable
    recompute of seeded ops])."""
    with torch._functorch.config.patch(graphsafe_rng_functionalization=False):
        if inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            patches: dict[str, Any] = {"custom_partitioner_fn": partitioner}
            if graph_pass is not None:
                patches |= {"post_grad_custom_post_pass": graph_pass,
                            "reorder_for_peak_memory": False}
            return compile_fx(gm, example_inputs, config_patches=patches)

        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        def run_as_is(fx: torch.fx.GraphModule, _inputs):
            if graph_pass is not None:
                graph_pass(fx.graph)
                fx.recompile()
            return make_boxed_func(fx.forward)

        return aot_autograd(fw_compiler=run_as_is, bw_compiler=run_as_is,
                            partition_fn=partitioner,
                            keep_inference_input_mutations=True)(gm, example_inputs)


def _gathered_shards(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> dict[int, Any]:
    """param id -> shard parameter of every ``zbuf::all_gather`` in Dynamo's graph: on a graph
    input, an attribute of ``gm`` (when Dynamo does not lift parameters), or an operand of a
    nested graph (a checkpointed region's body, whose placeholders are the operands that follow
    it among the call's arguments)."""
    found: dict[int, Any] = {}
    gather = torch.ops.zbuf.all_gather

    def walk(graph_module: torch.fx.GraphModule, values: dict) -> None:
        for n in graph_module.graph.nodes:
            if n.op == "get_attr" and n not in values:
                attr = graph_module
                for part in n.target.split("."):
                    attr = getattr(attr, part)
                values[n] = attr
            if n.op != "call_function":
                continue
            if n.target in (gather, gather.default):
                tensor, param_id = values.get(n.args[0]), n.args[1]
                if isinstance(tensor, torch.Tensor) and isinstance(param_id, int):
                    found[param_id] = tensor
                continue
            for i, arg in enumerate(n.args):
                body = values.get(arg) if isinstance(arg, torch.fx.Node) else None
                if isinstance(body, torch.fx.GraphModule):
                    operands = [a for a in n.args[i + 1:] if isinstance(a, torch.fx.Node)]
                    inner = [p for p in body.graph.nodes if p.op == "placeholder"]
                    walk(body, {p: values.get(a) for p, a in zip(inner, operands)})

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    walk(gm, dict(zip(placeholders, example_inputs)))
    return found
