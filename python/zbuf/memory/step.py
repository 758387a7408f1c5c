"""The whole training step under one memory budget, measured on the first step.

[Note: whole-step budget]
[Note: measure first, then spend]
The gather schedule is planned before the first step, from the rank-agreed free memory
([Note: rank-agreed budget] in compile/budget.py). Much of what a step holds is not there yet:
the optimizer's state (created lazily by its first ``step()``) and temporaries, the gradients,
an eager loss, NCCL's buffers (allocated by the first collective), the allocator's
fragmentation. A first plan that spent the free memory at once could run out of memory in step
0, before any measurement could correct it. So zbuf measures first and spends after, each
decision once, in ``PlanPhase``'s order ([Note: one planner interface] in planner.py):

0. Step 0's plan is no hungrier than FSDP2's (``CompileOptions.measuring``): the user's
   checkpointing as written (``auto`` keeps nothing more), no persistence, each graph gathers at
   most what one node reads plus about one block ahead (``budget.gather_reserve``), and the free
   memory it is planned from leaves out what is known exactly: the gradients and, with
   ``optimizer=``, the optimizer's state and temporaries from its type and the shards
   ([Note: optimizer state bytes] in optimizer_state.py).
1. Measure: step 0 runs on that plan. The pool's budget starts at 0, so the plans' first runs
   size it to exactly what they need ([Note: one writer of the pool's budget] in
   pool_budget.py). Step 0's phases are measured ([Note: phase peaks] in phases.py). Before its
   optimizer step the pool gives all its idle blocks back (nothing is known yet about what the
   optimizer needs; ``SharedMemory.yield_idle``).
2. At the first forward of step 1, on every rank (the same program point of every rank), the
   measurement becomes the ledger ([Note: the ledger] in ledger.py; with the optimizer in
   backward, step 1 is the measured step and this happens at step 2: [Note: a state made inside
   the measured phase]): what step 0 left resident that was not there when it started (the
   optimizer's state, kept gradients) is added to its forward and backward peaks, which ran
   without it; the limit, the peaks, the pool's excess and the fragmentation are agreed with
   one all-reduce; the gather budget and the room follow. One budget serves every graph: the
   pool keeps the blocks of the forward's plan while backward runs and vice versa, so each
   phase's peak meets the pool's whole size.
3. Grow: the plan grows into the measured room, once ([Note: bounded re-plan] in
   compile/replan.py): as data where it can (the weights kept for backward), compiled again
   only where its structure must change. After a compile the pool's budget starts again at 0 for
   the new plans to size. If nothing would change, nothing does.
4. Settle: after ``STEADY_STEP`` (the first step after the new plan's first run: steady-state
   reserved bytes, not step 0's, which lacked the optimizer's fragmentation) the same
   measurement and agreement run once more, and the plan settles, once: compiled again if its
   plans no longer fit even with nothing kept, else the keep-set shrinks if the headroom fell
   below the margin, or is chosen if step 1 compiled the plan.
5. From then on, before each optimizer step the pool gives its idle blocks back if the measured
   optimizer peak plus the pool's bytes would not fit the usable memory (with an optimizer
   attached; without one the optimizer runs inside "backward" and its peak is part of the
   budget).

The host (CPU) runs the same steps on a stand-in ([Note: phase peaks]): peaks are the tracked
parameter, gradient and optimizer-state bytes plus the plans' projected activation peaks, and the
limit is the agreed free memory at compile time plus the tracked bytes then. On a real host
that is far above anything a test model uses, so the CPU default grows its plan at step 1 (at
world > 1: persistence) and never shrinks; tests shrink the agreed free memory to see the rest.

How zbuf learns of the optimizer: ``zbuf.compile(model, optimizer=opt)``. Its step hooks delimit
the optimizer phase (so that the pool can lend its idle blocks to it instead of the budget
having to leave room for the optimizer's temporaries beside the pool) and expose its state to
the CPU stand-in. Creating the state eagerly was the alternative; it needs a real first step
(AdamW's state is created inside ``step()``, and a dry step would advance its step counter), so
the measured first step is used instead. Without ``optimizer=`` the budget is still measured,
with the optimizer counted as part of backward.

[Note: the state in segments of its own]
Left to itself, the caching allocator carves the optimizer's state, made in step 0's optimizer
step, out of the blocks step 0's forward and backward freed, the largest among them the segment
of the user's fp32 loss (9.27 GiB at qwen3-32b, mb 4, seq 4096). Such a segment then holds live
state for good, and the next step's loss finds no contiguous room in the cache and none left on
the card beside it: at qwen3-32b as rank 0 of 8 on an 80 GiB card, ``zbuf.compile(model,
optimizer=opt)`` ran out of memory in step 1 asking for 9.27 GiB with 56.0 GiB allocated and
14.4 GiB cached but unallocated. So as step 0's optimizer step begins (after the plan has
decided where the state goes, [Note: offloading when the step does not fit] in
zbuf/offload_choice.py), the memory owner empties torch's cache: the segments step 0 left wholly
free go back to the device, and the state (and the step's temporaries) is made in new segments
sized by what it asks for, or in the free parts of segments still in use (the gradients'), which
it could not have made whole anyway. The next step's activations get new segments beside it;
step 1 pays its forward's device allocations once. The same run then completed with no retry
after step 2 (benches/results/onepath32b.md). Under the expandable segments zbuf turns on
([Note: torch's allocator grows in place] in shared.py) such a hole costs a retry rather than
the step; the emptying stays for a user who configures torch's allocator without them.
"""

from __future__ import annotations

import collections
import enum
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import in_backward
from ..shard import roots
from . import pool_budget
from .agreement import agree_extremes
from .device import local_free_bytes
from .ledger import PPM, Ledger, fragmentation_ppm, without_margin
from .phases import ROWS_KEPT, PhaseMeter, StepPhases, StepProfile
from .progress import Point, StepProgress
from .planner import PlanPhase, PlanPhases, StatePlacement, StructurePlanner
from .shared import SharedMemory

__all__ = ["StepMemory", "StepMemoryRow", "MeasuredBudget"]


class _Window(enum.Enum):
    """Where sizing the offload's window stands ([Note: the step's window] in
    zbuf/offload_window.py)."""

    WAITING = "waiting for the settled plan"
    PROFILING = "profiling a step"
    DONE = "sized (or found none)"


class MeasuredBudget(NamedTuple):
    """The rank-agreed outcome of the measured step ([Note: whole-step budget], step 2)."""

    limit_bytes: int
    """Bytes torch and the pool may use together (smallest over the ranks)."""
    forward_peak_bytes: int
    """Torch's forward peak with step 0's growth added (largest over the ranks)."""
    backward_peak_bytes: int
    """Torch's backward peak, likewise (without an optimizer: backward and optimizer)."""
    optimizer_peak_bytes: Optional[int]
    """Torch's optimizer-step peak (largest over the ranks); None without an optimizer."""
    pool_excess_bytes: int
    """What the pool held beyond its plans' largest live gathered bytes (largest over ranks)."""
    budget_bytes: int
    """The gather budget every graph is planned within (quantised)."""
    room_bytes: int
    """What activations and gathered weights may share (quantised): the limit less the margin,
    the pool's excess and the peaks without the plans' projected activations, divided by one
    plus ``fragmentation``. A re-plan with ``recompute="auto"`` plans its activations and
    gathers within it."""
    planned_budget_bytes: Optional[int]
    """The smallest budget of the plans step 0 ran (None: nothing compiled, or an explicit
    ``budget_bytes``)."""
    replanned: bool
    """Whether the plan changed here: compiled again, or a new keep-set ([Note: bounded
    re-plan] in compile/replan.py)."""
    measured_step: int
    """The step the numbers come from."""
    fragmentation: float
    """The allocator's reserved-but-unallocated bytes per byte the step allocated beyond its start,
    in the measured step's worse phase (largest over the ranks; [Note: fragmentation grows with
    the room])."""
    recompiled: bool = False
    """Whether the re-plan compiled the model again; False when it changed only which weights
    forward keeps for backward, or did nothing ([Note: bounded re-plan])."""
    kept_bytes: int = 0
    """Gathered bytes forward keeps for backward after this decision ([Note: weights kept at run
    time] in zbuf/kept_weights.py)."""
    kept_weights: int = 0
    """How many weights forward keeps for backward after this decision."""
    recompute: Optional[dict[str, Any]] = None
    """Block frames' ``recompute="auto"``: the blocks' levels in force after this decision
    (``RecomputeStats`` as a dict: [Note: block levels] in compile/block_replan.py); None
    elsewhere (the whole graph's are in its schedule records)."""


class StepMemoryRow(NamedTuple):
    """One step of one rank (the run record's ``memory`` rows)."""

    phases: StepPhases
    pool_held_bytes: int
    """The pool's bytes (idle + checked out) at the step's end."""
    pool_idle_bytes: int
    """The pool's idle bytes at the step's end."""
    yielded_bytes: int
    """Idle pool bytes given back to the device before this step's optimizer step."""
    reclaims: int
    """Pool acquires for which torch's cache was emptied during this step."""
    torch_ooms: int
    """Torch allocator out-of-memory errors during this step (CUDA)."""
    budget_bytes: Optional[int]
    """The gather budget in force in this step: the first plan's (smallest over its graphs) until
    the re-plan, the measured one after it (None: no compiled plan)."""
    replanned: bool
    """The re-plan took effect in this step (its graphs were compiled in it)."""
    pool_budget_bytes: int
    """The pool's own budget at the step's end: what the plan set it to ([Note: one writer of the
    pool's budget] in pool_budget.py) less what its pressure policy took back after torch's
    allocator retried ([Note: pressure policy] in rust/pressure.rs); gathers beyond it are freed
    on release."""
    pool_recovered: bool
    """The pool's one-shot recovery has run ([Note: one-shot recovery] in rust/pool/mod.rs): it
    keeps blocks only of the sizes it held then."""
    pool_alloc_failures: int
    """The pool's allocations the device refused during this step (each frees the pool's idle
    blocks, waits for its pending frees and retries once)."""


def _root_of(model: nn.Module):
    found = roots(model)
    if not found:
        raise ValueError("zbuf's step memory needs a model sharded with zbuf.shard (it finds the "
                         "pool and the process group there); call zbuf.shard(model) first")
    return found[0]


class StepMemory:
    """The whole-step budget of one sharded model ([Note: whole-step budget]).

    A model sharded by several ``zbuf.shard`` calls onto different pools is arbitrated on its
    first root's pool only (the others keep their idle blocks through the optimizer step).

    Args:
        model: the sharded model (``zbuf.shard``).
        optimizer: its optimizer, or None (the optimizer then counts as part of backward).
        hooked: the module whose forward delimits a step (the compiled wrapper when compiled;
            default ``model``).
        replanner: the compiled model's re-planner (compile/replan.py); None for an eager model,
            which is measured and arbitrated but has no plan to remake.
        host_free_bytes: CPU stand-in only: the free memory the limit starts from (what
            ``zbuf.compile`` agreed, before the gradients came off; default: the host's
            available memory).
        plan_sizes_pool: the model is compiled, so its plans size the pool on their first runs:
            the pool's budget starts at 0 and becomes exactly what the plans need (an emulated
            card's split follows it: [Note: emulated capacity] in shared.py).
    """

    MEASURED_STEP = 0
    """The step whose measurement sets the budget (the plan grows at the next forward); with the
    optimizer in backward, the step after it ([Note: a state made inside the measured phase])."""
    STEADY_STEP = 2
    """The step whose headroom is checked (the plan shrinks at the next forward if it fell below
    the margin): the first after the grown plan's first run (step 1, which compiles it and sizes
    the pool for it), so its reserved bytes are the steady state's, not step 0's; counted from
    ``MEASURED_STEP``."""

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 hooked: Optional[nn.Module] = None, replanner: Optional[StructurePlanner] = None,
                 host_free_bytes: Optional[int] = None, plan_sizes_pool: bool = False) -> None:
        root = _root_of(model)
        pool = root.pool
        if plan_sizes_pool:
            pool_budget.size_by_first_runs(pool)
        self.plan_sizes_pool = plan_sizes_pool
        self.model = model
        self.optimizer = optimizer
        self.memory = SharedMemory(pool)
        self.meter = PhaseMeter(pool.device, model, optimizer)
        self.replanner = replanner
        self.phases = PlanPhases()
        """Where the step's memory stands, as its planner's ([Note: one planner interface] in
        planner.py): measuring until the measured step's decision, grown until the steady
        step's, then settled."""
        self.measured: Optional[MeasuredBudget] = None
        """The decision after the measured step (the plan grown into the room, [Note: measure
        first, then spend])."""
        self.steady: Optional[MeasuredBudget] = None
        """The check after the steady step (the plan shrunk if its headroom fell short)."""
        self._judged: Optional[tuple[StepPhases, int]] = None
        """The closed step the next decision reads (phases, pool held), until it is made."""
        self.rows: collections.deque[StepMemoryRow] = collections.deque(maxlen=ROWS_KEPT)
        """The latest closed steps' rows, oldest first."""
        self._replan_steps: set[int] = set()
        self._yielded = 0
        self._pool_after_backward: Optional[int] = None  # of the running step
        self._events0 = self._event_counts(self.memory.pool.stats())
        self.offload_choice: Optional[StatePlacement] = None
        """Where the optimizer's state lives, when the plan decides it at step 0 ([Note:
        offloading when the step does not fit] in zbuf/offload_choice.py); set by
        ``zbuf.compile``."""
        self._host_limit = None
        if pool.device.type != "cuda":
            if host_free_bytes is None:
                host_free_bytes = local_free_bytes(pool.device)
            self._host_limit = int(host_free_bytes) + self.meter.tracked_bytes()
        self.meter.on_close = self._row
        # [Note: a state made inside the measured phase]
        # The measurement adds what step 0 left resident (the optimizer's state) to its phases'
        # peaks, since they ran without it. With the optimizer in backward, step 0's backward
        # makes that state as it runs: its peak already holds some or all of it, and adding it
        # again would count the state twice. Step 1 runs the same lean plan with the state resident throughout, so
        # it is the step measured, and nothing is added twice.
        self.measured_step = self.MEASURED_STEP + int(root.steps_in_backward)
        self.steady_step = self.measured_step + self.STEADY_STEP - self.MEASURED_STEP
        self.progress = StepProgress(model)
        """The step's progress points ([Note: progress points] in progress.py): the meter reads
        its segments at them while it profiles, and the offload's window acts at them."""
        self.progress.listeners += [self.meter.segment, self._at_point]
        self._window = _Window.WAITING
        hooked = hooked if hooked is not None else model
        # Order matters: the meter closes step 0 before the decision reads it, and starts the
        # backward before its first progress point.
        self.meter.attach(hooked)
        self._handles = [hooked.register_forward_pre_hook(lambda _m, _a: self._on_forward()),
                         hooked.register_forward_hook(lambda _m, _a, _o: self._on_output())]
        if optimizer is not None:
            # Steps inside backward (the optimizer in backward) are backward's, as the meter's.
            self._handles.append(optimizer.register_step_pre_hook(
                lambda _o, _a, _k: None if in_backward() else self._before_optimizer()))
            self._handles.append(optimizer.register_step_post_hook(
                lambda _o, _a, _k: None if in_backward() else self.memory.take_back()))

    def detach(self) -> None:
        """Remove every hook (the meter's and the progress points' too)."""
        self.meter.detach()
        self.progress.detach()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- hooks --------------------------------------------------------------------------------

    def _on_forward(self) -> None:
        if self._judged is not None:
            grow = self.phases.phase is PlanPhase.MEASURING
            decision = self._decide(*self._judged, grow=grow)  # a refusal leaves the phase
            self.phases.enter(PlanPhase.GROWN if grow else PlanPhase.SETTLED)
            self._judged = None
            if grow:
                self.measured = decision
            else:
                self.steady = decision
        self.memory.observe_step()
        self.memory.take_back()  # the pool's share may have moved (first runs size it)
        self._size_window()
        if self._profiles_for_plan():
            self.progress.watch_gradients()
            self.meter.profile_open_step()
        self.progress.forward_started()

    def _on_output(self) -> None:
        if torch.is_grad_enabled():  # an evaluation forward has no backward to mark
            self.progress.backward_started()

    def _at_point(self, point: Point) -> None:
        if self.offload_choice is not None:
            self.offload_choice.at(point)

    def _size_window(self) -> None:
        """[Note: the step's window] in zbuf/offload_window.py: once the plan has settled and
        the state is offloaded, the next step is profiled, and the forward after it sizes the
        window from that step, agreed over the ranks."""
        if (self._window is _Window.DONE or self.phases.phase is not PlanPhase.SETTLED
                or self.offload_choice is None or not self.offload_choice.offloaded):
            return
        profile = self.meter.profile
        last = self.meter.closed - 1  # the step before the one opening now
        if self._window is _Window.PROFILING and profile is not None and profile.step == last:
            self._window = _Window.DONE
            self._plan_window(profile)
            return
        self._window = _Window.PROFILING
        self.progress.watch_gradients()
        self.meter.profile_open_step()  # again, if the last step had no backward or no step

    def _profiles_for_plan(self) -> bool:
        """Whether the step opening now is one the planner decides on from its profile (the
        measured and the steady step, [Note: offloaded under the step's own peak] in
        zbuf/compile/block_replan.py)."""
        if self.replanner is None or not self.replanner.plans_from_profile:
            return False
        due = {PlanPhase.MEASURING: self.measured_step,
               PlanPhase.GROWN: self.steady_step}.get(self.phases.phase)
        return self.meter.closed == due

    def _agreed_profile(self, step: int, growth: int = 0) -> Optional[StepProfile]:
        """The profile of ``step`` with ``growth`` added to its forward and backward segments,
        each segment the largest over the ranks; None if ``step`` was not profiled or the ranks'
        steps have different points (no common points to act at). Every rank must call it."""
        profile = self.meter.profile
        if profile is None or profile.step != step:
            profile = StepProfile(step, (), (), 0)
        lengths = [len(profile.forward), len(profile.backward)]
        low, high = agree_extremes(self.group, self.memory.device, smallest=lengths,
                                   largest=lengths)
        if low != high or not lengths[0]:
            return None
        _, agreed = agree_extremes(
            self.group, self.memory.device, smallest=[],
            largest=[profile.optimizer, *profile.forward, *profile.backward])
        segments = [b + growth for b in agreed[1:]]
        return StepProfile(step, tuple(segments[:lengths[0]]), tuple(segments[lengths[0]:]),
                           agreed[0])

    def _plan_window(self, profile: StepProfile) -> None:
        agreed = self._agreed_profile(profile.step)
        if agreed is None:
            return
        row = next(r for r in self.meter.rows if r.step == profile.step)
        usable = without_margin(self.limit_bytes()) - self.memory.pool_share_bytes()
        # The progress still holds the profiled step's backward: no backward ran since.
        (usable,), (frag, busy) = agree_extremes(
            self.group, self.memory.device, smallest=[usable],
            largest=[fragmentation_ppm(row), self.progress.link_busy_until])
        self.offload_choice.plan_window(agreed, usable, frag, busy)

    def _before_optimizer(self) -> None:
        self._pool_after_backward = self.memory.pool.stats().charged_bytes
        m = self.measured
        usable = without_margin(self.limit_bytes())
        if m is None or m.optimizer_peak_bytes is None:
            lend = True  # [Note: whole-step budget], step 1: nothing measured yet
        else:
            lend = m.optimizer_peak_bytes + self.memory.pool_share_bytes() > usable
        if lend:
            self._yielded += self.memory.yield_idle()
        if self.offload_choice is not None and self.offload_choice.pending:
            self._choose_offload()
        if self.meter.closed == 0 and self.memory.device.type == "cuda":
            torch.cuda.empty_cache()  # [Note: the state in segments of its own]

    def _choose_offload(self) -> None:
        """[Note: offloading when the step does not fit]: step 0's largest peak so far (torch's
        reserved bytes and the pool's, on the CPU stand-in with the plans' projected
        activations), what the optimizer step starts from (allocated now, and the pool's
        blocks left after it lent) and the fragmentation of step 0's forward and backward,
        agreed over the ranks, decide where the state goes."""
        peak = self.meter.reserved_peak_so_far() + (self._pool_after_backward or 0)
        if self._host_limit is not None and self.replanner is not None:
            peak += max(self.replanner.activation_peaks(gradients=False).values(), default=0)
        held = self.meter.resident_bytes() + self.memory.pool.stats().charged_bytes
        frag = fragmentation_ppm(self.meter.row_so_far())
        (limit,), (peak, held, frag) = agree_extremes(self.group, self.memory.device,
                                                      smallest=[self.limit_bytes()],
                                                      largest=[peak, held, frag])
        resumed = any(isinstance(v, torch.Tensor) and v.dim() > 0
                      for st in self.optimizer.state.values() for v in st.values())
        self.offload_choice.decide(without_margin(limit), peak, held, frag)
        if resumed and self.offload_choice.offloaded:
            # [Note: a state made inside the measured phase], the other way round: a run that
            # loaded its state before zbuf.compile installed the offload ran step 0's forward
            # and backward beside it, which moves to the host now; step 1 runs without it, so
            # it is the step measured. (Loaded after, the state is held aside until this
            # decision: [Note: loading streamed state] in zbuf/optimizer_step_offload.py.)
            self.measured_step += 1
            self.steady_step += 1

    # -- the decision -------------------------------------------------------------------------

    def limit_bytes(self) -> int:
        """This rank's limit for torch + pool ([Note: whole-step budget])."""
        if self._host_limit is not None:
            return self._host_limit
        return self.memory.limit_bytes()

    def _decide(self, row: StepPhases, pool_held: int, *, grow: bool) -> MeasuredBudget:
        growth = max(0, self.meter.resident_bytes() - row.start_bytes)
        fw = row.forward_reserved_bytes + growth
        bw = row.backward_reserved_bytes + growth
        # What was measured alive: the allocator's cache and fragmentation are its to recover;
        # on the CPU stand-in, the tracked state (the plans' activations are projected, not
        # measured).
        live, live_phase = max((row.forward_peak_bytes + growth, "forward"),
                               (row.backward_peak_bytes + growth, "backward"))
        excess = 0
        act: dict[str, int] = {}
        if self.replanner is not None:
            excess = max(0, pool_held - self.replanner.largest_need())
            act = self.replanner.activation_peaks()
            if self._host_limit is not None:
                # CPU stand-in: activations are invisible to the meter; the plans project them.
                # The gradients are in both: the meter tracks them, the profiles count them.
                own = self.replanner.activation_peaks(gradients=False)
                fw += own.get("forward", 0)
                bw += own.get("backward", 0)
        ledger = Ledger.agreed(
            self.group, self.memory.device, limit_bytes=self.limit_bytes(),
            torch_forward_bytes=fw, torch_backward_bytes=bw, torch_live_bytes=live,
            optimizer_bytes=row.optimizer_reserved_bytes, pool_excess_bytes=excess,
            fragmentation_ppm=fragmentation_ppm(row))
        if self.replanner is not None:  # [Note: no step above its measured memory]
            self.replanner.refuse_if_no_plan_fits(
                ledger.torch_live_bytes, ledger.limit_bytes - ledger.pool_excess_bytes,
                phase=live_phase, step=row.step, growth_bytes=growth)
        budget = ledger.gather_budget_bytes
        # The peaks less the plans' projected activations (rank-invariant: the same graphs on
        # every rank). At the steady step the plan being judged was measured: what it holds is
        # not charged the fragmentation again ([Note: fragmentation grows with the room]).
        held = None if grow or self.replanner is None else self.replanner.largest_need()
        room = ledger.room_bytes(act, held)
        planned = replan = None
        if self.replanner is not None:
            planned = self.replanner.planned_budget()
            profile = (self._agreed_profile(row.step, growth)
                       if self.replanner.plans_from_profile else None)
            decide = self.replanner.grow if grow else self.replanner.settle
            replan = decide(budget, room, self._world_size(), profile)
        if replan is not None:
            self._replan_steps.add(self.meter.closed)  # the step now opening
            if replan.recompiled and self.plan_sizes_pool:
                # The new plans' first runs size the pool, as the first plans' did; a new
                # keep-set moved the pool's budget itself. Block frames size it from their
                # plan, which no re-plan changes.
                pool_budget.size_by_first_runs(self.memory.pool)
        kept = self.replanner.kept if self.replanner is not None else ()
        stats = self.replanner.recompute_stats() if self.replanner is not None else None
        return MeasuredBudget(ledger.limit_bytes, ledger.torch_forward_bytes,
                              ledger.torch_backward_bytes, ledger.optimizer_bytes,
                              ledger.pool_excess_bytes, budget, room, planned,
                              replan is not None, row.step, ledger.fragmentation_ppm / PPM,
                              recompiled=bool(replan and replan.recompiled),
                              kept_bytes=sum(c.nbytes for c in kept), kept_weights=len(kept),
                              recompute=None if stats is None else stats.to_dict())

    def _world_size(self) -> int:
        g = self.group
        return g.size() if g is not None else 1

    @property
    def group(self) -> dist.ProcessGroup:
        """The model's sharding group, read when needed: holding it would keep it (and gloo's
        threads) alive past ``destroy_process_group()`` ([Note: a model does not keep its group
        alive] in shard_state.py)."""
        return _root_of(self.model).group

    # -- telemetry ----------------------------------------------------------------------------

    def _event_counts(self, pool_stats) -> tuple[int, int, int]:
        e = self.memory.events
        return e.reclaims, e.torch_ooms, pool_stats.alloc_failures

    def close_step(self) -> Optional[StepMemoryRow]:
        """Close the running step (call after it, e.g. after ``loss.item()``); returns its row."""
        phases = self.meter.close_step()  # its on_close is _row
        return None if phases is None else self.rows[-1]

    def _row(self, phases: StepPhases) -> None:
        s = self.memory.pool.stats()
        held = self._pool_after_backward
        held = s.charged_bytes if held is None else held
        judged = {PlanPhase.MEASURING: self.measured_step,
                  PlanPhase.GROWN: self.steady_step}.get(self.phases.phase)
        if phases.step == judged:
            self._judged = (phases, held)
        self._pool_after_backward = None
        counts = self._event_counts(s)
        m = self.measured
        if self.steady is not None and self.steady.replanned:
            budget = self.steady.budget_bytes
        elif m is not None and m.replanned:
            budget = m.budget_bytes
        elif m is not None:
            budget = m.planned_budget_bytes
        else:
            budget = self.replanner.planned_budget() if self.replanner is not None else None
        row = StepMemoryRow(
            phases, s.charged_bytes, s.idle_bytes, self._yielded,
            counts[0] - self._events0[0], counts[1] - self._events0[1], budget,
            phases.step in self._replan_steps, s.budget_bytes, s.recovering or s.recovered,
            counts[2] - self._events0[2])
        self._yielded = 0
        self._events0 = counts
        self.rows.append(row)

    def report(self) -> dict[str, Any]:
        """The measured budget and the cumulative events, JSON-able (for a run record)."""
        m = self.measured
        return {
            "measured": None if m is None else m._asdict(),
            "steady": None if self.steady is None else self.steady._asdict(),
            "events": dict(vars(self.memory.events)),
            "optimizer_attached": self.optimizer is not None,
            "capacity": self.memory.capacity_fraction(),
            "torch_allocator": self.memory.torch_allocator,
            "optimizer_offload": (None if self.offload_choice is None
                                  else self.offload_choice.report()),
        }
