"""The ``zbuf`` torch.compile backend: Inductor (or aot_eager) with the zbuf passes.

``torch.compile(model, backend="zbuf", options={...})`` finds this through the
``torch_dynamo_backends`` entry point; ``zbuf.compile(model, ...)`` is the same with keyword
options and the one-time rank agreement on free memory ([Note: rank-agreed budget]).

Only public hooks are used: ``compile_fx(..., config_patches=...)`` (applied to the forward and to
the lazily compiled backward alike) with ``custom_partitioner_fn`` and
``post_grad_custom_post_pass``; for aot_eager, ``aot_autograd`` with the same partitioner and the
schedule pass as forward/backward compilers. ``reorder_for_peak_memory`` is off because it sinks
hoisted gather starts back to their waits, undoing prefetch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from ..optimizer_policy import OptimizerPolicy
from ..shard import roots
from . import report
from .options import CompileOptions
from .passes import GatherSchedulePass, PlanState, ZbufPartitioner
from .region_schema import SchemaMemo
from .regions import mark_repeated_blocks

__all__ = ["zbuf_backend", "compile_model", "step_memory_of"]


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
    state = PlanState(opts)
    partitioner = ZbufPartitioner(state)
    schedule_pass = GatherSchedulePass(state)
    if opts.inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        with state.schemas.active():  # [Note: one schema per region] in region_schema.py
            return compile_fx(
                gm,
                example_inputs,
                config_patches={
                    "custom_partitioner_fn": partitioner,
                    "post_grad_custom_post_pass": schedule_pass,
                    "reorder_for_peak_memory": False,
                },
            )

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def run_as_is(fx: torch.fx.GraphModule, _inputs):
        schedule_pass(fx.graph)
        fx.recompile()
        return make_boxed_func(fx.forward)

    with state.schemas.active():
        return aot_autograd(fw_compiler=run_as_is, bw_compiler=run_as_is,
                            partition_fn=partitioner)(gm, example_inputs)


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


def _shard_group(model: torch.nn.Module):
    found = roots(model)
    return found[0].group if found else None


def _gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of the gradients of ``model``'s trainable parameters (shards, once each)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def compile_model(
    model: torch.nn.Module,
    *,
    budget_bytes: int | None = None,
    prefetch: bool = True,
    persist: bool | None = None,
    recompute: str = "checkpointed",
    fullgraph: bool = False,
    dynamic: bool | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    **options: Any,
) -> torch.nn.Module:
    """``torch.compile(model, backend="zbuf")`` with typed options (see ``CompileOptions``), and
    the whole training step under one measured memory budget.

    ``recompute``: ``"checkpointed"`` (backward recomputes the model's checkpointed regions as
    written), ``"auto"`` (zbuf decides per checkpointed region what to keep and what to recompute
    within the rank-agreed budget) or ``"none"`` (keep every region's activations); see
    [Note: recompute modes] in recompute.py. Unless ``compile_blocks_once=False`` (or
    ``recompute="auto"``), the model's repeated blocks are marked to compile once, in place
    ([Note: compile repeated blocks once] in regions.py).

    Every rank must call this at the same point: without an explicit ``budget_bytes`` (or
    ``free_memory_bytes``) it agrees on the rank-minimum free memory with one all-reduce over the
    model's sharding group ([Note: rank-agreed budget] in budget.py).

    For a model sharded with ``zbuf.shard``, the first step is measured and, if the step does not
    fit the plans, the model is re-planned once, at the first forward of the second step, on
    every rank ([Note: whole-step budget] in zbuf/step_memory.py; ``zbuf.step_memory_of``).
    ``optimizer``: the model's optimizer. zbuf then measures its step separately and lends it the
    pool's idle blocks when it needs them; without it the optimizer step is measured as part of
    backward and the budget leaves room for it beside the pool. An explicit ``budget_bytes`` is
    never re-planned.
    """
    opts = CompileOptions(budget_bytes=budget_bytes, prefetch=prefetch, persist=persist,
                          recompute=recompute, **options)
    if opts.blocks_once:
        mark_repeated_blocks(model)  # [Note: compile repeated blocks once] in regions.py
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer= takes the model's torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    host_free = None
    sharded = _shard_group(model) is not None
    if budget_bytes is None and sharded:
        # Step 0 runs a plan no hungrier than FSDP2's; the measurement grows it ([Note: measure
        # first, then spend] in zbuf/step_memory.py).
        opts = dataclasses.replace(opts, measuring=True)
    if budget_bytes is None and opts.free_memory_bytes is None:
        import torch.distributed as dist

        from .budget import agree_free_memory

        group = _shard_group(model)
        if group is not None or not dist.is_initialized():
            # What step 0 will hold that is known exactly now: the gradients, and the
            # optimizer's state and temporaries from its type and the shards ([Note: optimizer
            # state bytes] in zbuf/optimizer_policy.py); the rest is measured on step 0.
            reserve = _gradient_bytes(model)
            if optimizer is not None:
                reserve += OptimizerPolicy.of(optimizer).step_bytes(optimizer)
            free = agree_free_memory(group, reserve_bytes=reserve)
            opts = dataclasses.replace(opts, free_memory_bytes=free)
            host_free = free + reserve
    elif opts.free_memory_bytes is not None:
        host_free = opts.free_memory_bytes  # the caller's agreed value: the stand-in's too
    compiled = torch.compile(
        model, backend="zbuf", options=dataclasses.asdict(opts), fullgraph=fullgraph, dynamic=dynamic
    )
    if _shard_group(model) is None:
        if optimizer is not None:
            raise ValueError("zbuf.compile(..., optimizer=...) measures the step of a model "
                             "sharded with zbuf.shard; shard the model first, or leave out "
                             "optimizer=")
        return compiled
    from ..step_memory import StepMemory
    from .replan import Replanner

    replanner = None
    if budget_bytes is None:
        replanner = Replanner(compiled, opts, fullgraph=fullgraph, dynamic=dynamic)
    compiled.__dict__["_zbuf_step_memory"] = StepMemory(
        model, optimizer, hooked=compiled, replanner=replanner, plan_sizes_pool=True,
        host_free_bytes=host_free)
    return compiled


def step_memory_of(compiled: torch.nn.Module):
    """The ``zbuf.step_memory.StepMemory`` that ``zbuf.compile`` attached to ``compiled`` (its
    measured budget, per-step rows and events), or None."""
    return compiled.__dict__.get("_zbuf_step_memory")
