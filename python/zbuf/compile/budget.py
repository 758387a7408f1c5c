"""The gathered-bytes budget every rank plans against.

[Note: rank-agreed budget]
The planner's output must be identical on all ranks ([Note: rank-invariant schedule]), so its
budget cannot be each rank's own free memory. ``agree_free_memory`` takes the minimum free memory
over the group with one all-reduce; ``zbuf.compile`` calls it (every rank calls ``zbuf.compile``
at the same point of its program), taking the optimizer's state off each rank's free memory
first (it will exist from the first ``step()`` on), and passes the result to the backend as the
option ``free_memory_bytes``, with the gradients' bytes as ``gradient_bytes`` ([Note: gradients
live in backward]), so the values live with the compiled model that planned with them (and are
part of the passes' cache key through the options' digest). The rest of what a step holds
(temporaries, NCCL, fragmentation) is measured on the first step, which may re-plan once
([Note: whole-step budget] in zbuf/memory/step.py). A graph's budget is then its memory
(``graph_memory``: the free memory less the gradients it does not make itself, less
``unmeasured_fraction``) less its projected activation peak; the
planner raises it to the smallest feasible value (at least the largest single gather). An
explicit ``budget_bytes`` overrides all of this. Without ``free_memory_bytes`` (plain
``torch.compile(m, backend="zbuf")``), what this process may allocate stands in for the free
memory: the device's total memory under the user's ``set_per_process_memory_fraction``; still
the same on every rank of a homogeneous job, just less tight.

The agreed free memory is rounded to a value that repeats from launch to launch ([Note: stable
agreed memory] in zbuf/memory/agreement.py).

[Note: measured memory is not margined twice]
``unmeasured_fraction`` stands for what nobody has measured when the first plans are made (the
allocator's fragmentation, workspaces, NCCL's buffers), so it applies to the free memory agreed
at compile time only. The measured step replaces that guess by its measurement: the ledger's
room (``Ledger.room_bytes`` in zbuf/memory/ledger.py) already leaves out the one margin of
measured memory (``MARGIN_DIVISOR``) and divides by the measured fragmentation. A plan made from
it (``recompute="auto"``'s re-plan: the option ``measured_room_bytes``) takes that room as its
memory at face value, less only the other graphs' gradients, which a backward that was not the
measured peak's may run beside ([Note: gradients live in backward]).
"""

from __future__ import annotations


import numpy as np
import torch
import torch.distributed as dist
import torch.fx

from ..devices import current_cuda
from ..memory import agree_extremes, host_bytes, local_free_bytes, stable_free_memory
from .graph_info import activation_profile, block_of, gather_nodes, gathered_nbytes, weight_tree
from .options import CompileOptions

__all__ = ["PlanExceedsMemoryError", "check_plan_fits", "check_optimizer_fits", "agree_free_memory", "graph_budget", "graph_memory", "gradient_reserve", "local_free_bytes",
           "gather_reserve", "planning_profile", "PREFETCH_BLOCKS"]

PREFETCH_BLOCKS = 2
"""Blocks of gathered weights kept for the gather planner beyond what one node reads at once:
the block that runs and the one being prefetched (FSDP2's one block ahead). Recompute's
activation budget leaves them ([Note: budgeted recompute] in recompute.py), and the measured
step's plan gets no more ([Note: measure first, then spend] in zbuf/memory/step.py)."""


def _total_bytes(device: torch.device) -> int:
    """What this process may allocate on ``device`` at most, the same on every rank of a
    homogeneous job: the card's memory under the user's ``set_per_process_memory_fraction``
    (which torch and the pool share: [Note: one cap for torch and the pool] in
    zbuf/memory/device.py);
    on the host, its memory."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * min(1.0, torch.cuda.get_per_process_memory_fraction(device)))
    return host_bytes("total")


def agree_free_memory(group: dist.ProcessGroup | None = None, device: torch.device | None = None,
                      reserve_bytes: int = 0) -> int:
    """The minimum free memory over ``group`` (None: the default group), with one all-reduce;
    this process's own free memory when no process group is initialised; rounded down to a value
    that repeats from launch to launch ([Note: stable agreed memory] in zbuf/memory/agreement.py).

    ``reserve_bytes``: memory the step will hold that is not allocated yet and that this rank
    knows exactly (``zbuf.compile`` passes its gradients' bytes), taken off the free memory."""
    if device is None:
        device = current_cuda() if torch.cuda.is_available() else torch.device("cpu")
    (free,), _ = agree_extremes(group, device,
                                smallest=[max(0, local_free_bytes(device) - reserve_bytes)])
    return stable_free_memory(free)


def planning_profile(graph: torch.fx.Graph, options: CompileOptions) -> np.ndarray:
    """The activation profile a graph is planned and checked with: beside the agreed free memory
    it leaves out the shards, against the total memory it counts them.

    [Note: the model's state is not an activation]
    ``zbuf.compile`` agrees on the free memory beside the model's state: the shards are resident
    when it asks, and the optimizer's state is taken off before the agreement (it is known
    exactly then). A graph's static profile counts its shards (inputs, alive from the start):
    compared with the free memory, those bytes would count twice. So beside the agreed
    free memory every planner (gathers, persistence, budgeted recompute, the refusal, the
    measured step's room) reads the profile without the shards, and counts each gradient once:
    in the profile of the graph that makes it, as a reservation in the others' ([Note:
    gradients live in backward]). Against the total memory a plain
    ``torch.compile(backend="zbuf")`` plans in (``free_memory_bytes`` unset), the shards are in
    the profile, as they are in that memory."""
    return activation_profile(graph, shards=options.free_memory_bytes is None,
                              stepped_gradients=options.optimizer_in_backward)


def gradient_reserve(options: CompileOptions, made_bytes: int, *, backward: bool) -> int:
    """The gradients alive beside a graph that makes ``made_bytes`` of them
    (``graph_info.gradient_shard_bytes``) and does not count the rest.

    [Note: gradients live in backward]
    A step's gradients do not exist in its forward: ``zero_grad()`` sets them to None (torch's
    default), and the backward makes them, each at its reduce-scatter, when the activations
    that peak in forward are gone: taking all of them off the agreed free memory would plan
    every forward as if they were there. So a graph's profile counts the gradient shards it
    returns from their reduce-scatters on (``graph_info.activation_profile``), and only a
    backward (or joint) graph reserves the rest of ``gradient_bytes``: those other graphs'
    backwards (a model with graph breaks) leave alive when it runs. A forward graph reserves
    none. A forward that runs while gradients are kept (``zero_grad(set_to_none=False)``, or
    micro-batches accumulated before one ``step()``) shows them as resident growth in the
    measured step, whose re-plan counts them ([Note: whole-step budget] in
    zbuf/memory/step.py). Against the total memory of a plain
    ``torch.compile(backend="zbuf")`` nothing is reserved: the profile counts the shards too.
    With the optimizer in backward no gradient outlives the graph that makes it ([Note: optimizer
    in backward] in zbuf/optimizer_in_backward.py)."""
    if not backward or options.free_memory_bytes is None or options.optimizer_in_backward:
        return 0
    return max(0, options.gradient_bytes - made_bytes)


def graph_memory(options: CompileOptions, device: torch.device, reserve_bytes: int = 0) -> int:
    """What one graph's activations and gathered weights share, less ``reserve_bytes``
    (``gradient_reserve``): the measured room as it is, else the agreed free memory less
    ``unmeasured_fraction`` ([Note: measured memory is not margined twice])."""
    if options.measured_room_bytes is not None:
        return max(0, options.measured_room_bytes - reserve_bytes)
    free = options.free_memory_bytes
    if free is None:
        free = _total_bytes(device)
    return int(max(0, free - reserve_bytes) * (1.0 - options.unmeasured_fraction))


def gather_reserve(graph: torch.fx.Graph, options: CompileOptions) -> int:
    """``budget_bytes``, or what one node of ``graph`` reads at once plus ``PREFETCH_BLOCKS``
    blocks' gathered weights."""
    if options.budget_bytes is not None:
        return options.budget_bytes
    need: dict[torch.fx.Node, int] = {}
    blocks: dict[str, int] = {}
    for g in gather_nodes(graph):
        nbytes = gathered_nbytes(g)
        key = block_of(g)
        blocks[key] = blocks.get(key, 0) + nbytes
        for c in {u for v in (g, *weight_tree(g)) for u in v.users}:
            need[c] = need.get(c, 0) + nbytes
    per_block = max((b for k, b in blocks.items() if k), default=0)
    return max(need.values(), default=0) + PREFETCH_BLOCKS * per_block


class PlanExceedsMemoryError(MemoryError):
    """A graph's plan projects more memory than every rank agreed it may use ([Note: no plan
    above its memory]); raised at compile time, before the plan ever runs.

    Beside the message, which words the fix for a ``zbuf.compile`` caller, the numbers, for a
    caller that names its own knobs (``zbuf train`` names its options, [Note: a plan that does
    not fit, on the command line] in zbuf/train/refusals.py): ``what`` needs ``needs_bytes``
    where every rank agreed on ``memory_bytes``; ``short_of`` says what takes the room, one of
    ``SHORT_OF``."""

    SHORT_OF = ("activations", "optimizer", "block weights")
    """``"activations"``: a step's activations and gathered weights (a smaller batch,
    checkpointing or more ranks helps); ``"optimizer"``: the optimizer step's temporaries;
    ``"block weights"``: one block's gathered weights under ``structure='blocks'``."""

    def __init__(self, message: str, *, what: str = "the plan", needs_bytes: int = 0,
                 memory_bytes: int = 0, short_of: str = "activations") -> None:
        super().__init__(message)
        self.what, self.needs_bytes, self.memory_bytes = what, needs_bytes, memory_bytes
        self.short_of = short_of


def check_plan_fits(options: CompileOptions, device: torch.device, *, kind: str,
                    peak_bytes: int, activation_peak: int, gathered_peak: int,
                    reserve_bytes: int = 0) -> None:
    """Refuse a plan whose projected peak exceeds the agreed memory.

    [Note: no plan above its memory]
    The planner raises a budget below its floor (what one node reads at once) to that floor, and
    recompute's activation budget is raised to the peak with every region recomputed: so a plan
    could come out above the memory it was planned in (qwen3-14b as rank 0 of 8 with blocks
    compiled once inside the user's ``checkpoint``: a backward activation peak of 120 GiB on an
    80 GiB card). Such a plan would run out of memory in the step, on some rank, mid-collective.
    So the schedule pass projects each graph's peak (static liveness: activations plus live
    gathered weights at each node, plus the weights kept from forward) and raises this error
    instead, naming the graph, the peak and the memory, before anything runs. Every input is
    rank-agreed, so every rank refuses alike. An explicit ``budget_bytes`` is the user's own
    bound on the gathers: the activations are then not checked against a memory nobody agreed
    on (``free_memory_bytes`` unset)."""
    if options.budget_bytes is not None and options.free_memory_bytes is None:
        return
    memory = graph_memory(options, device, reserve_bytes)
    if peak_bytes <= memory:
        return
    agreed = ("the room the measured step left" if options.measured_room_bytes is not None
              else "free memory")
    margin = "" if options.measured_room_bytes is not None else " and the unmeasured_fraction"
    raise PlanExceedsMemoryError(
        f"zbuf: the {kind} graph's plan needs {peak_bytes / 2**20:.1f} MiB at its peak "
        f"(activations {activation_peak / 2**20:.1f} MiB, gathered weights "
        f"{gathered_peak / 2**20:.1f} MiB) but every rank agreed on {memory / 2**20:.1f} MiB "
        f"({agreed} less {reserve_bytes / 2**20:.1f} MiB of other graphs' gradients{margin}); "
        f"refusing to run a plan that cannot fit. "
        f"Lower the micro-batch or sequence length, checkpoint more of the model "
        f"(recompute='auto' or the model's own checkpointing), or shard over more ranks",
        what=f"the {kind} graph's plan", needs_bytes=peak_bytes, memory_bytes=memory)


def check_optimizer_fits(free_bytes: int, temporary_bytes: int, optimizer: str) -> None:
    """Refuse an optimizer whose step's temporaries cannot fit in the memory every rank agreed
    is free beside the model's state ([Note: optimizer state bytes] in
    zbuf/memory/optimizer_state.py): its first ``step()`` would run out of memory after a whole
    forward and backward."""
    if temporary_bytes <= free_bytes:
        return
    raise PlanExceedsMemoryError(
        f"zbuf: {optimizer}'s step needs {temporary_bytes / 2**20:.1f} MiB of temporaries but "
        f"every rank agreed on {free_bytes / 2**20:.1f} MiB free beside the model's state; "
        f"refusing a step that cannot fit. Use fused=True (no parameter-sized temporaries), "
        f"or shard over more ranks", what=f"{optimizer}'s step", needs_bytes=temporary_bytes,
        memory_bytes=free_bytes, short_of="optimizer")


def graph_budget(options: CompileOptions, device: torch.device, activation_peak: int,
                 graph: torch.fx.Graph | None = None, reserve_bytes: int = 0) -> int:
    """The budget of one graph, before the planner's floor (see [Note: rank-agreed budget]).
    The measured step's plan (``options.measuring``) gathers no more than ``gather_reserve`` of
    ``graph``: about one block ahead ([Note: measure first, then spend] in zbuf/memory/step.py)."""
    if options.budget_bytes is not None:
        return options.budget_bytes
    budget = max(1, graph_memory(options, device, reserve_bytes) - activation_peak)
    if options.measuring and graph is not None:
        budget = min(budget, max(1, gather_reserve(graph, options)))
    return budget
