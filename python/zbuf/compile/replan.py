"""Re-planning a zbuf-compiled model under the budget the whole step measured: grown once
after the measured step, shrunk at most once after a steady one.

[Note: bounded re-plan]
``zbuf.step_memory`` measures the first step, whose plan spent nothing it could not know
([Note: measure first, then spend] in zbuf/step_memory.py), and grows the plans into the
measured room once (``grow``); a steady step later, it shrinks them once if they no longer fit
(``shrink_if_needed``). So a model is compiled at most three times. The plans live in compiled
code, so a new plan needs a new compile of the model's frames, and nothing else:

* the compiled module's ``forward`` is a ``PlannedForward`` that calls the current compiled
  callable. Re-planning compiles the same module again with ``torch.compile(...,
  backend="zbuf", options=<budget_bytes=the measured budget>)``: a new backend instance, so
  Dynamo's backend-match guard fails for the old cache entries of these frames and they are
  traced and planned again (one recompile per frame and re-plan, well inside Dynamo's recompile
  limit); every
  other compiled function in the process keeps its code (no ``torch._dynamo.reset()``).
* the swap happens in a forward pre-hook: ``nn.Module`` has already picked ``forward`` (the
  ``PlannedForward``) when hooks run, and the ``PlannedForward`` forwards this very call to the
  new compiled callable, so the step that decides is the first step of the new plan;
* the budget is an option (``budget_bytes``, or ``free_memory_bytes`` for budgeted recompute),
  quantised by the caller, so it enters the passes' cache uuid and a relaunch of the same
  configuration finds the same compiled graphs in Inductor's cache;
* a model whose blocks are compiled once ([Note: compile repeated blocks once] in regions.py)
  holds one block's weights at least; when the budget is below that, the re-plan compiles the
  model whole (its blocks unmarked), whose floor is one node's weights;
* the old plans' schedule records stay (``schedule_report`` lists every graph compiled); the
  re-planner knows which ones are current.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import torch

from .budget import PlanExceedsMemoryError
from .options import CompileOptions
from .regions import is_marked_model, unmark_repeated_blocks
from .report import ScheduleRecord, graph_summary, schedule_report
from .schedule import exposed_seconds, plan_schedule

__all__ = ["PlannedForward", "Replanner", "GROW_MIN_GAIN"]

GROW_MIN_GAIN = 0.01
"""Least share of the current graphs' modelled compute time that more prefetch must take off
their modelled exposure to be worth a recompile: below it the grown plan would differ from the
measured one by less than a step's noise, and the recompile costs seconds."""


class PlannedForward:
    """The compiled module's ``forward``: calls the compiled callable of the current plan."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class Replanner:
    """Remakes the plans of ``compiled`` (what ``torch.compile(model, backend="zbuf")`` returned)
    at most once ([Note: bounded re-plan])."""

    def __init__(self, compiled: torch.nn.Module, options: CompileOptions, *, fullgraph: bool,
                 dynamic: Optional[bool]) -> None:
        self.compiled = compiled
        self.model = compiled._orig_mod
        self.options = options
        self.fullgraph = fullgraph
        self.dynamic = dynamic
        self.forward = PlannedForward(compiled.forward)
        compiled.forward = self.forward
        self.replanned = False
        """Compiled again at least once."""
        self.grown = False
        """Re-planned after the measured step."""
        self.shrunk = False
        """Re-planned after a steady step whose headroom fell below the margin."""
        self._first_graph = 0  # graph_id of the first record of the current plan

    # -- the current plan ---------------------------------------------------------------------

    def records(self) -> list[ScheduleRecord]:
        """Schedule records of the model's graphs under the current plan."""
        return [r for r in schedule_report(self.model) if r.graph_id >= self._first_graph]

    def planned_budget(self) -> Optional[int]:
        """The smallest budget any current graph was planned within (None: none gathers)."""
        budgets = [r.budget_bytes for r in self.records() if r.gathers]
        return min(budgets) if budgets else None

    def activation_peaks(self, *, gradients: bool = True) -> dict[str, int]:
        """The largest projected activation peak of the current graphs, by kind; with
        ``gradients=False`` less the gradient shards each graph makes (they are in its profile:
        [Note: gradients live in backward] in budget.py)."""
        out: dict[str, int] = {}
        for r in self.records():
            peak = r.activation_peak_bytes - (0 if gradients else r.gradient_bytes)
            out[r.kind] = max(out.get(r.kind, 0), peak)
        return out

    @staticmethod
    def needs(r: ScheduleRecord) -> int:
        """Gathered bytes graph ``r`` holds at its peak: its live gathered bytes, plus, in a
        backward graph, the weights kept from forward (they are not in its profile)."""
        return r.peak_live_gathered_bytes + (r.persistent_bytes if r.kind == "backward" else 0)

    def largest_need(self) -> int:
        """The most gathered bytes any current graph holds at once (0: nothing compiled)."""
        return max((self.needs(r) for r in self.records()), default=0)

    def fits(self, budget_bytes: int) -> bool:
        """Whether no current graph would gain from a plan under ``budget_bytes``: each needs
        at most that, or already no more than its floor (the bytes one node needs at once, which
        no plan goes below)."""
        return all(self.needs(r) <= max(budget_bytes, r.floor_bytes) for r in self.records())

    @staticmethod
    def refuse_if_no_plan_fits(peak_bytes: int, usable_bytes: int, *, phase: str, step: int,
                               growth_bytes: int) -> None:
        """Refuse the next step when torch's own measured peak, before any gathered weight,
        exceeds what it may use.

        [Note: no step above its measured memory]
        The measured step may show that the step cannot fit whatever the gathers do: its peak
        of live tensors (not the allocator's cache, which its retries can free) plus what it
        left resident (the optimizer's state, kept gradients) is above the limit itself, before
        any margin. Up to 845ca7f the re-plan then went to the
        smallest plan and ran it into an out-of-memory error in the next backward (qwen3-1.7b
        at world 1, one H200, ``--mem-frac`` 0.25: step 1's backward, 35.2 GiB of live tensors
        measured against 34.9 GiB, died with 31.0 GiB allocated and 3.2 GiB fragmented). An error on
        one rank mid-step can leave the others in a collective; this one is raised on every rank
        (rank-agreed numbers) at the next step's first forward, before it runs anything."""
        if peak_bytes <= usable_bytes:
            return
        gib = 2**30
        raise PlanExceedsMemoryError(
            f"zbuf: the measured step {step} needs {peak_bytes / gib:.2f} GiB in {phase} without "
            f"any gathered weight ({growth_bytes / gib:.2f} GiB of it what step {step} left "
            f"resident: the optimizer's state, kept gradients) but every rank may use "
            f"{usable_bytes / gib:.2f} GiB; the next step would run out of memory, so it is "
            f"refused before it runs. Lower the micro-batch or sequence length, checkpoint more "
            f"of the model, or shard over more ranks")

    # -- re-planning --------------------------------------------------------------------------

    def below_block_floor(self, budget_bytes: int) -> bool:
        """Whether a current graph holds more than ``budget_bytes`` only because its blocks are
        compiled once, each a unit of gathered weights ([Note: compile repeated blocks once]
        in regions.py): compiled whole, its floor is one node's weights."""
        return is_marked_model(self.model) and any(
            self.needs(r) > budget_bytes for r in self.records())

    def prefetch_gain_seconds(self, budget_bytes: int) -> float:
        """Modelled exposure ([Note: modelled exposure] in schedule.py) that the current graphs
        would lose if re-planned within ``budget_bytes``: each graph's planner input is planned
        again under the new budget, as the re-plan would. ``inf`` when a graph that leaves
        communication exposed was served from Inductor's cache (its planner input is unknown)."""
        gain = 0.0
        for r in self.records():
            if not r.gathers or r.modelled_exposed_seconds <= 0:
                continue
            summary = graph_summary(r)
            if summary is None:
                return math.inf
            kept = r.persistent_bytes if r.kind == "backward" else 0
            grown = plan_schedule(summary, max(1, budget_bytes - kept), self.options)
            gain += r.modelled_exposed_seconds - exposed_seconds(summary, grown, self.options)
        return gain

    def can_grow(self, world_size: int, budget_bytes: int) -> bool:
        """Whether the current plan, the measured step's ([Note: measure first, then spend] in
        zbuf/step_memory.py), held something back that ``budget_bytes`` would buy: persistence
        (at world > 1, or asked for), ``recompute="auto"``'s kept activations, or prefetch that
        takes at least ``GROW_MIN_GAIN`` of the modelled compute time off the modelled exposure.
        A grown plan that would equal the measured one is not compiled."""
        o = self.options
        if not o.measuring:
            return False
        if o.persist is True or (o.persist is None and world_size > 1):
            return True
        records = self.records()
        if any(r.recompute is not None and r.recompute.mode == "auto" and r.recompute.regions > 0
               for r in records):
            return True
        compute = sum(r.modelled_compute_seconds for r in records)
        return o.prefetch and self.prefetch_gain_seconds(budget_bytes) > GROW_MIN_GAIN * compute

    def grow(self, budget_bytes: int, room_bytes: int, world_size: int) -> bool:
        """After the measured step: compile again within the measured ``budget_bytes`` of
        gathered weights (``room_bytes`` for ``recompute="auto"``) if the measured step's plan
        held something back or does not fit it. Once. Returns whether it re-planned. Every rank
        must get the same answer: call it with rank-agreed numbers, at the same point of every
        rank's program."""
        if self.replanned or not (self.can_grow(world_size, budget_bytes) or not self.fits(budget_bytes)
                                  or self.below_block_floor(budget_bytes)):
            return False
        self.replan(budget_bytes, room_bytes)
        self.grown = True
        return True

    def shrink_if_needed(self, budget_bytes: int, room_bytes: int) -> bool:
        """At a steady step: compile again, once, if a current plan does not fit the budget
        measured there. Returns whether it re-planned; rank-agreed inputs, as ``grow``."""
        if self.shrunk or (self.fits(budget_bytes) and not self.below_block_floor(budget_bytes)):
            return False
        self.replan(budget_bytes, room_bytes)
        self.shrunk = True
        return True

    def replan(self, budget_bytes: int, room_bytes: int) -> None:
        """[Note: whole-step budget] step 3 in zbuf/step_memory.py: with ``recompute="auto"``
        (and no explicit activation budget) the measured room becomes the plans' free memory, so
        that budgeted recompute chooses the split of activations and gathers again; otherwise
        the gathers get ``budget_bytes``."""
        self.options = dataclasses.replace(self.options, measuring=False)
        if self.below_block_floor(budget_bytes):
            # The re-plan compiles the model whole, where gathers can be released inside a block.
            unmark_repeated_blocks(self.model)
            self.options = dataclasses.replace(self.options, compile_blocks_once=False)
        o = self.options
        if o.recompute == "auto" and o.activation_budget_bytes is None:
            free = math.ceil(room_bytes / (1.0 - o.margin_fraction))
            self.options = dataclasses.replace(o, free_memory_bytes=free)
        else:
            self.options = dataclasses.replace(o, budget_bytes=budget_bytes)
        self._first_graph = max((r.graph_id for r in schedule_report(self.model)), default=-1) + 1
        fresh = torch.compile(self.model, backend="zbuf", options=dataclasses.asdict(self.options),
                              fullgraph=self.fullgraph, dynamic=self.dynamic)
        # The wrapper's Dynamo context follows its plan (torch reads it for pickling and AOT).
        self.compiled.dynamo_ctx = fresh.dynamo_ctx
        self.forward.fn = fresh.forward
        self.replanned = True
