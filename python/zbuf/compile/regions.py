"""Compile each repeated block once: gathers in the outer graph, the body a nested compile region.

[Note: compile repeated blocks once]
Compiled as one graph, a model of N identical blocks is traced, differentiated, partitioned and
turned into code N times over. ``mark_repeated_blocks`` makes every block of a repeated stack
(an ``nn.ModuleList`` of two or more modules of one class that hold zbuf shards) call its body
through one ``torch.compiler.nested_compile_region`` function, ``_run_block``. While tracing, a
marked block's ``__call__``

1. gathers the block's parameters in the *outer* graph (``zbuf::all_gather`` per parameter, as
   parameter access does), then
2. calls ``_run_block(block, ids, gathered, args, kwargs)``, whose body runs the block's normal
   ``__call__`` (hooks, Hugging Face's checkpointing, ``forward``) with parameter access reading
   the gathered tensors ([Note: weights gathered by the caller] in region_inputs.py).

The body thus holds no parameter id, so Dynamo finds the bodies of all blocks equal and emits
one subgraph called N times (``invoke_subgraph``, with the gathered weights as operands; it
still traces each call to compare them, and installs a second subgraph for a block that differs,
e.g. in a per-layer constant, so correctness never depends on the blocks being alike).
AOTAutograd traces and partitions the body once, and Inductor lowers and generates its code
once. zbuf's planner runs on the outer graphs, where the gathers, the releases after each block
call and the reduce-scatters of the gradients the backward body returns are: the whole-step view
(budget, prefetch across blocks, selective persistence, fingerprint) is kept. The passes'
part of this is in passes.py ([Note: region bodies]).

What it gives up:
- A block call is one node to the planner: all of a block's gathered weights are live for the
  whole call (gathered before it, released after it), where the whole-graph plan could release
  each weight after its last use inside the block. The feasible floor of the budget becomes one
  block's weights instead of one node's. When the whole step's measured budget is below that,
  the one re-plan compiles the model whole ([Note: bounded re-plan] in replan.py), so memory
  is never given up for compile time; only that launch's re-plan pays the whole compile.
- Inductor cannot fuse across a block boundary (the last elementwise ops of one block with the
  first of the next).
- Dynamo still traces every block (to compare it with the installed body); only the later
  stages are done once.
- A graph break inside a block is an error (a nested compile region cannot break), where the
  whole-graph compile would split the graph. Use the option only for blocks that trace whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..shard import gather_param, gathered_by_caller, is_sharded, sharded_parameters

__all__ = ["mark_repeated_blocks", "unmark_repeated_blocks", "repeated_blocks", "is_marked",
           "is_marked_model", "block_class"]


@torch.compiler.nested_compile_region
def _run_block(block: nn.Module, ids: tuple[int, ...], gathered: tuple[torch.Tensor, ...],
               args: tuple, kwargs: dict) -> Any:
    with gathered_by_caller(ids, gathered):
        return type(block)._zbuf_region_base.__call__(block, *args, **kwargs)


def _region_call(self, *args, **kwargs):
    base = type(self)._zbuf_region_base
    if not torch.compiler.is_compiling():
        return base.__call__(self, *args, **kwargs)
    params = self.__dict__["_zbuf_region_params"]
    gathered = tuple(gather_param(shard, spec) for shard, spec in params)
    ids = tuple(spec.param_id for _, spec in params)
    return _run_block(self, ids, gathered, args, kwargs)


def block_class(cls: type, kind: str, call) -> type:
    """The subclass of block class ``cls`` whose ``__call__`` is ``call``, for one way of running
    blocks (``kind``: "region" here, "frame" in block_frames.py), with ``cls`` as its
    ``_zbuf_<kind>_base``: one per class and kind (so that Dynamo sees one type for every block
    of a stack), kept on ``cls`` itself, read from its own ``__dict__`` (a subclass of ``cls``
    gets its own)."""
    key = f"_zbuf_{kind}_class"
    sub = cls.__dict__.get(key)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__call__": call, f"_zbuf_{kind}_base": cls,
                                          "__module__": cls.__module__, "__doc__": cls.__doc__})
        type.__setattr__(cls, key, sub)
    return sub


def is_marked(module: nn.Module) -> bool:
    """Whether ``module`` is a block marked by ``mark_repeated_blocks``."""
    return "_zbuf_region_params" in module.__dict__


def is_marked_model(model: nn.Module) -> bool:
    """Whether any block of ``model`` is marked."""
    return any(is_marked(m) for m in model.modules())


def repeated_blocks(model: nn.Module) -> list[list[nn.Module]]:
    """The repeated stacks of ``model``: every ``nn.ModuleList`` of at least two modules of one
    class holding zbuf shards, outermost first (a stack inside a block of another is left to the
    outer one)."""
    stacks: list[list[nn.Module]] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not isinstance(m, nn.ModuleList) or len(m) < 2:
            continue
        kinds = {getattr(type(b), "_zbuf_region_base", type(b)) for b in m}
        if len(kinds) == 1 and all(is_sharded(b) for b in m):
            stacks.append(list(m))
            inside.update(id(x) for b in m for x in b.modules())
    return stacks


def mark_repeated_blocks(model: nn.Module) -> int:
    """Make every block of ``model``'s repeated stacks compile once ([Note: compile repeated
    blocks once]); returns the number of blocks marked. Idempotent. Call after ``zbuf.shard``
    and before ``torch.compile`` traces the model; eager runs are unaffected."""
    stacks = repeated_blocks(model)
    count = 0
    for stack in stacks:
        for block in stack:
            if is_marked(block):
                count += 1
                continue
            # Each parameter once, in a fixed order (a tied one is gathered once per block).
            params = {}
            for _fqn, _sub, _name, shard, spec in sharded_parameters(block):
                params.setdefault(spec.param_id, (shard, spec))
            block.__dict__["_zbuf_region_params"] = list(params.values())
            block.__class__ = block_class(type(block), "region", _region_call)
            count += 1
    return count


def unmark_repeated_blocks(model: nn.Module) -> int:
    """Undo ``mark_repeated_blocks``: the blocks compile as part of the whole graph again (a
    re-plan under a budget below one block's weights does this, compile/replan.py). Returns the
    number of blocks unmarked."""
    count = 0
    for m in model.modules():
        if is_marked(m):
            m.__class__ = type(m)._zbuf_region_base
            del m.__dict__["_zbuf_region_params"]
            count += 1
    return count
