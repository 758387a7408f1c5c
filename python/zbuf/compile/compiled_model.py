"""``zbuf.compile(model, ...)``: the ``zbuf`` backend (backend.py) with typed options, the
rank-agreed free memory it plans from ([Note: rank-agreed budget] in budget.py), and the whole
step's measured memory (zbuf/memory/step.py) with the re-planner that acts on it (replan.py).
The backend itself knows nothing of steps: it plans each graph it is handed within the options.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..memory import OptimizerPolicy, StepMemory
from ..offload_choice import OffloadChoice, slot_estimate_bytes
from ..optimizer_in_backward import BATCH_BYTES, BackwardStep
from ..optimizer_step_offload import BUCKET_BYTES
from ..shard import roots
from .budget import agree_free_memory, check_optimizer_fits
from .dynamo_settings import traced_as_zbuf
from .modes import Modes, refusal
from .options import CompileOptions
from .block_frames import install_block_frames
from .block_replan import BlockReplanner
from .block_stacks import repeated_blocks
from .replan import Replanner

__all__ = ["compile_model", "pick_structure", "step_memory_of"]


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


def _offloaded_step_bytes(policy: OptimizerPolicy, optimizer: torch.optim.Optimizer):
    """``(state on the device through every graph, temporaries)`` of a step whose state is all
    in host memory: none, and in the optimizer step its two slots and one bucket's temporaries
    ([Note: optimizer state offloaded after backward] in zbuf/optimizer_step_offload.py)."""
    per_param = BUCKET_BYTES // max(1, policy.state_copies)
    return 0, (slot_estimate_bytes(optimizer)
               + policy.batch_temporary_bytes(optimizer, per_param))


def _attach_offload(step_memory: StepMemory, choice: OffloadChoice | None) -> None:
    """The offload's hooks after the step memory's, whose step-0 decision they act on."""
    if choice is None:
        return
    step_memory.offload_choice = choice
    step_memory.meter.off_device_bytes = choice.install().host_held_bytes


def pick_structure(model: torch.nn.Module, opts: CompileOptions) -> str:
    """[Note: one path]

    ``zbuf.compile(model, optimizer=opt)`` with no other option is the path a user takes, so its
    structure is the one that serves a user best where both apply: one Dynamo frame per repeated
    block. Measured on one H200, qwen3-14b as rank 0 of 8 (simulated) on an 80 GiB card, the
    user's own decoder with its checkpoint around each block call (issue 36's table): the whole
    graph's first step took 137-146 s against FSDP2's 18.6 s, the block frames' 11.2 s; their
    steps 0.93-0.95x and 0.99x FSDP2's. A first step ten times FSDP2's is what a user meets
    first and on every change of shape; the step gap is the block frames' to close.
    The whole graph stays for what only it does (``CompileOptions.graph_only``: the optimizer
    in backward, a cap on the whole graph's activations) and
    for a model with no repeated stack of sharded blocks, which has no block frame to share.
    Every rank picks alike: the inputs are the model's structure and the options."""
    if opts.structure is not None:
        return opts.structure
    if opts.graph_only or _shard_group(model) is None or not repeated_blocks(model):
        return "graph"
    return "blocks"


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
    optimizer_in_backward: bool = False,
    offload_optimizer: bool | None = None,
    **options: Any,
) -> torch.nn.Module:
    """``torch.compile(model, backend="zbuf")`` with typed options (see ``CompileOptions``), and
    the whole training step under one measured memory budget.

    ``recompute``: ``"checkpointed"`` (backward recomputes the model's checkpointed regions as
    written), ``"auto"`` (zbuf decides per checkpointed region what to keep and what to recompute
    within the rank-agreed budget) or ``"none"`` (keep every region's activations); see
    [Note: recompute modes] in recompute.py.

    ``structure``: unset, zbuf picks ([Note: one path]): a sharded model with repeated blocks
    runs as ``"blocks"`` unless an option only the whole graph takes is set.
    ``structure="blocks"``: Dynamo traces one frame per repeated block, shared by identical
    blocks, and zbuf's runtime gathers, prefetches and re-gathers the blocks' weights; the model
    is returned itself, its blocks swapped in place ([Note: one Dynamo frame per block] in
    block_frames.py). ``recompute="auto"`` there gives each block call a recompute level in the
    room the first step measures ([Note: block levels] in block_replan.py).

    Every rank must call this at the same point: without an explicit ``budget_bytes`` (or
    ``free_memory_bytes``) it agrees on the rank-minimum free memory with one all-reduce over the
    model's sharding group ([Note: rank-agreed budget] in budget.py).

    For a model sharded with ``zbuf.shard``, the first step is measured and, if the step does not
    fit the plans, the model is re-planned once, at the first forward of the second step, on
    every rank ([Note: whole-step budget] in zbuf/memory/step.py; ``zbuf.step_memory_of``).
    ``optimizer``: the model's optimizer. zbuf then measures its step separately and lends it the
    pool's idle blocks when it needs them; without it the optimizer step is measured as part of
    backward and the budget leaves room for it beside the pool. An explicit ``budget_bytes`` is
    never re-planned.

    ``optimizer_in_backward=True``: ``optimizer`` updates each shard in backward as soon as its
    gradient is reduced, and the gradient is dropped there, so the step never holds all
    gradients at once ([Note: optimizer in backward] in zbuf/optimizer_in_backward.py). Every
    backward is then an optimizer step (no gradient accumulation, nothing left to clip); the
    loop's ``optimizer.step()`` after backward finds no gradients on the shards and may stay.
    Needs ``optimizer=`` and ``fullgraph=True``.

    ``offload_optimizer``: where the optimizer's parameter-shaped state (AdamW's moments)
    lives. ``None`` (the default, with ``optimizer=`` on a sharded model): on the device while
    the step fits, else the plan moves what does not fit to pinned host memory, decided at step
    0's optimizer step and said in the record ([Note: offloading when the step does not fit] in
    zbuf/offload_choice.py). ``True``: all of it in host memory, streamed through two device
    slots around the ``opt.step()`` after backward ([Note: optimizer state offloaded after
    backward] in zbuf/optimizer_step_offload.py); with ``optimizer_in_backward=True`` brought
    one batch ahead of each step in backward instead ([Note: optimizer state off the device] in
    zbuf/optimizer_offload.py). ``False``: on the device. Each costs two copies of the moved
    state over the host link per step, one each way at once, overlapped with the step.
    """
    unknown = CompileOptions.unknown(options)
    if unknown:
        raise TypeError(f"zbuf.compile: unknown option(s) {', '.join(unknown)}; the options are "
                        f"zbuf.compile.CompileOptions' fields")
    refused = refusal(Modes(optimizer_in_backward=optimizer_in_backward,
                            offload_optimizer=offload_optimizer is True,
                            optimizer=optimizer is not None,
                            fullgraph=fullgraph))  # [Note: one table of modes] in modes.py
    if refused is not None:
        raise ValueError(f"zbuf.compile: {refused}")
    opts = CompileOptions(budget_bytes=budget_bytes, prefetch=prefetch, persist=persist,
                          recompute=recompute, optimizer_in_backward=optimizer_in_backward,
                          **options)
    if opts.structure == "blocks" and _shard_group(model) is None:
        raise ValueError("zbuf.compile(..., structure='blocks') needs a model sharded with "
                         "zbuf.shard (its runtime gathers the blocks' shards); shard it first")
    opts = dataclasses.replace(opts, structure=pick_structure(model, opts))
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer= takes the model's torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    host_free = None
    sharded = _shard_group(model) is not None
    choice = None
    if optimizer is not None and sharded and not optimizer_in_backward and (
            offload_optimizer is not False):
        choice = OffloadChoice(optimizer, roots(model)[0].device, offload_optimizer)
    if budget_bytes is None and sharded:
        # Step 0 runs a plan no hungrier than FSDP2's; the measurement grows it ([Note: measure
        # first, then spend] in zbuf/memory/step.py).
        opts = dataclasses.replace(opts, measuring=True)
    if budget_bytes is None and opts.free_memory_bytes is None:
        group = _shard_group(model)
        if group is not None or not dist.is_initialized():
            # What step 0 will hold beside its graphs that is known exactly now: the optimizer's
            # state from its type and the shards ([Note: optimizer state bytes] in
            # zbuf/memory/optimizer_state.py), through every graph; the gradients, through the
            # backward graphs only ([Note: gradients live in backward] in budget.py); the rest is
            # measured on step 0.
            gradients = _gradient_bytes(model)
            reserve, temporaries, beside = 0, 0, gradients
            if optimizer is not None:
                policy = OptimizerPolicy.of(optimizer)
                reserve, temporaries = policy.step_bytes(optimizer)
                if optimizer_in_backward:  # a batch at a time, no gradient kept beside it
                    temporaries, beside = policy.batch_temporary_bytes(optimizer, BATCH_BYTES), 0
                if offload_optimizer and optimizer_in_backward:
                    reserve = policy.offloaded_state_bytes(optimizer, BATCH_BYTES)
                elif choice is not None and choice.offloaded:
                    reserve, temporaries = _offloaded_step_bytes(policy, optimizer)
            free = agree_free_memory(group, reserve_bytes=reserve)
            if choice is not None and choice.pending and free < beside + temporaries:
                # [Note: offloading when the step does not fit]: known before step 0, which
                # decides how much stays; its graphs are planned without the state.
                choice.expect(free, beside + temporaries)
                reserve, temporaries = _offloaded_step_bytes(policy, optimizer)
                free = agree_free_memory(group, reserve_bytes=reserve)
            # The step's temporaries come after backward, beside the gradients it kept.
            check_optimizer_fits(max(0, free - beside), temporaries, type(optimizer).__name__)
            opts = dataclasses.replace(opts, free_memory_bytes=free, gradient_bytes=gradients)
            host_free = free + reserve
    elif opts.free_memory_bytes is not None:
        host_free = opts.free_memory_bytes  # the caller's agreed value: the stand-in's too
    if opts.structure == "blocks":
        # [Note: one Dynamo frame per block] in block_frames.py: the model itself, its blocks
        # run as compiled frames; the measured room re-plans recompute="auto"'s levels and the
        # blocks kept for backward ([Note: block levels] in block_replan.py).
        frames = install_block_frames(model, opts, fullgraph=fullgraph, dynamic=dynamic)
        block_replanner = BlockReplanner(frames) if budget_bytes is None else None
        step_memory = StepMemory(model, optimizer, hooked=model, replanner=block_replanner,
                                 host_free_bytes=host_free)
        frames.forward_observers.append(step_memory.progress.forward_block)
        frames.offload.upload_observers.append(step_memory.progress.upload_started)
        if block_replanner is not None:
            frames.finish_observers.append(lambda: block_replanner.lock_ahead(
                0 if choice is None else choice.undecided_host_bytes()))
        model.__dict__["_zbuf_step_memory"] = step_memory
        _attach_offload(step_memory, choice)
        return model
    compiled = torch.compile(
        model, backend="zbuf", options=dataclasses.asdict(opts), fullgraph=fullgraph, dynamic=dynamic
    )
    compiled.forward = traced_as_zbuf(compiled.forward)
    if _shard_group(model) is None:
        if optimizer is not None:
            raise ValueError("zbuf.compile(..., optimizer=...) measures the step of a model "
                             "sharded with zbuf.shard; shard the model first, or leave out "
                             "optimizer=")
        return compiled
    replanner = None
    if budget_bytes is None:
        replanner = Replanner(compiled, opts, fullgraph=fullgraph, dynamic=dynamic)
    if optimizer_in_backward:
        compiled.__dict__["_zbuf_backward_step"] = BackwardStep(model, optimizer,
                                                                offload=bool(offload_optimizer))
    compiled.__dict__["_zbuf_step_memory"] = StepMemory(
        model, optimizer, hooked=compiled, replanner=replanner, plan_sizes_pool=True,
        host_free_bytes=host_free)
    _attach_offload(compiled.__dict__["_zbuf_step_memory"], choice)
    return compiled


def step_memory_of(compiled: torch.nn.Module):
    """The ``zbuf.step_memory.StepMemory`` that ``zbuf.compile`` attached to ``compiled`` (its
    measured budget, per-step rows and events), or None."""
    return compiled.__dict__.get("_zbuf_step_memory")
