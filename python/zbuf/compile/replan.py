"""Re-planning a zbuf-compiled model under the budget the whole step measured: grown once
after the measured step, settled at most once after a steady one.

[Note: bounded re-plan]
``zbuf.memory.step`` measures the first step, whose plan spent nothing it could not know
([Note: measure first, then spend] in zbuf/memory/step.py), and grows the plans into the
measured room once (``grow``); a steady step later, it settles them once (``settle``): shrinks
them if they no longer fit, or picks the weights kept for backward of a plan that ``grow``
compiled. A plan has two parts, and a re-plan changes the cheaper one when it can:

* data: which gathered weights forward keeps for backward (the pools' keep-sets, [Note:
  weights kept at run time] in zbuf/kept_weights.py, chosen by [Note: the run-time keep-set] in
  persist.py). Changing it compiles nothing: the compiled graphs always re-gather in backward,
  and a kept weight's gather finds its buffer held from forward. This is what growth into the
  measured room normally is with the user's checkpointing as written (``recompute=
  "checkpointed"`` or ``"none"``): the weights kept for backward, prefetch as compiled at step 0
  (about one block ahead, which the cost model says hides the communication at qwen3-14b's
  size: benches/results/compile_time_14b.md). Shrinking the keep-set is data too.
* structure: the gather budget the graphs were planned within, and ``recompute="auto"``'s kept
  activations. The model is compiled again when the keep-set cannot help: ``auto`` has regions
  to keep (its activations are graph structure), or a plan does not fit the measured budget
  even with nothing kept. So a model is compiled at most three times. The plans live in
  compiled code, so a new plan needs a new compile of the model's frames, and nothing else:

  - the compiled module's ``forward`` is a ``PlannedForward`` that calls the current compiled
    callable. Re-planning compiles the same module again with ``torch.compile(...,
    backend="zbuf", options=<budget_bytes=the measured budget>)``: a new backend instance, so
    Dynamo's backend-match guard fails for the old cache entries of these frames and they are
    traced and planned again (one recompile per frame and re-plan, well inside Dynamo's
    recompile limit); every other compiled function in the process keeps its code (no
    ``torch._dynamo.reset()``).
  - the swap happens in a forward pre-hook: ``nn.Module`` has already picked ``forward`` (the
    ``PlannedForward``) when hooks run, and the ``PlannedForward`` forwards this very call to
    the new compiled callable, so the step that decides is the first step of the new plan;
  - the budget is an option (``budget_bytes``, or ``measured_room_bytes`` for budgeted
    recompute), quantised by the caller, so it enters the passes' cache uuid and a relaunch of
    the same configuration finds the same compiled graphs in Inductor's cache;
  - the new graphs are compiled with ``persist=False``: they re-gather in backward too, and
    their keep-set is chosen at the steady step, the first decision point at which their
    schedule records (the keep-set's input) exist;
  - the old plans' schedule records stay (``schedule_report`` lists every graph compiled); the
    re-planner knows which ones are current.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import torch

from .. import runtime
from ..memory import PlanPhase, PlanPhases, Replan, StepProfile, pool_budget
from .budget import PlanExceedsMemoryError
from .dynamo_settings import traced_as_zbuf
from .options import CompileOptions
from .persist import KeepCandidate, choose_kept
from .report import ScheduleRecord, schedule_report

__all__ = ["PlannedForward", "Replanner"]


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

    plans_from_profile = False
    """The whole graph's plans need no step profile ([Note: one planner interface])."""

    def __init__(self, compiled: torch.nn.Module, options: CompileOptions, *, fullgraph: bool,
                 dynamic: Optional[bool]) -> None:
        self.compiled = compiled
        self.model = compiled._orig_mod
        self.options = options
        self.fullgraph = fullgraph
        self.dynamic = dynamic
        self.forward = PlannedForward(compiled.forward)
        compiled.forward = self.forward
        self.persist = options.persist
        """The user's persistence option: the keep-set follows it ([Note: the run-time
        keep-set] in persist.py); the graphs compiled again never persist themselves."""
        self.recompiled = False
        """Compiled again at least once."""
        self.phases = PlanPhases()
        """Where the plan stands: measured, grown, settled ([Note: one planner interface] in
        zbuf/memory/planner.py)."""
        self.kept: tuple[KeepCandidate, ...] = ()
        """The weights forward keeps for backward ([Note: weights kept at run time] in
        zbuf/kept_weights.py), in the order they were chosen."""
        self._kept_pools: set[int] = set()  # pool ids whose keep-set this re-planner set
        self.plan_starts: list[int] = [0]
        """graph_id of each plan's first record, in order: the last one starts the current
        plan, the others the plans it replaced (a run's record tells them apart)."""

    # -- the current plan ---------------------------------------------------------------------

    def records(self) -> list[ScheduleRecord]:
        """Schedule records of the model's graphs under the current plan."""
        return [r for r in schedule_report(self.model) if r.graph_id >= self.plan_starts[-1]]

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

    def recompute_stats(self) -> None:
        """None: the whole graph's recompute is in its schedule records (the block frames'
        re-planner reports its levels here)."""
        return None

    @property
    def kept_bytes(self) -> int:
        """Gathered bytes forward keeps for backward under the current keep-set."""
        return sum(c.nbytes for c in self.kept)

    @staticmethod
    def plan_needs(r: ScheduleRecord) -> int:
        """Gathered bytes graph ``r``'s compiled plan holds at its peak: its live gathered bytes,
        plus, in a backward graph, the weights its compile kept from forward (they are not in
        its profile)."""
        return r.peak_live_gathered_bytes + (r.persistent_bytes if r.kind == "backward" else 0)

    def needs(self, r: ScheduleRecord) -> int:
        """Gathered bytes graph ``r`` holds at its peak: its plan's, plus the weights held for
        backward (charged to every graph as live throughout: [Note: the run-time keep-set])."""
        return self.plan_needs(r) + self.kept_bytes

    def largest_need(self) -> int:
        """The most gathered bytes any current graph holds at once (0: nothing compiled)."""
        return max((self.needs(r) for r in self.records()), default=0)

    def plans_fit(self, budget_bytes: int) -> bool:
        """Whether no current graph would gain from a plan compiled under ``budget_bytes``: each
        plan needs at most that, or already no more than its floor (the bytes one node needs at
        once, which no plan goes below). The keep-set is not counted: it can always shrink."""
        return all(self.plan_needs(r) <= max(budget_bytes, r.floor_bytes) for r in self.records())

    @staticmethod
    def refuse_if_no_plan_fits(peak_bytes: int, usable_bytes: int, *, phase: str, step: int,
                               growth_bytes: int) -> None:
        """Refuse the next step when torch's own measured peak, before any gathered weight,
        exceeds what it may use.

        [Note: no step above its measured memory]
        The measured step may show that the step cannot fit whatever the gathers do: its peak
        of live tensors (not the allocator's cache, which its retries can free) plus what it
        left resident (the optimizer's state, kept gradients) is above the limit itself, before
        any margin: the smallest plan would still run out of memory in the next step. An error
        on one rank mid-step can leave the others in a collective; this one is raised on every rank
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
            f"of the model, or shard over more ranks", what=f"the measured step {step}",
            needs_bytes=peak_bytes, memory_bytes=usable_bytes)

    # -- re-planning --------------------------------------------------------------------------

    def keeps_activations(self) -> bool:
        """Whether ``recompute="auto"`` has regions whose activations a grown plan could keep:
        graph structure, so growing them compiles the model again."""
        return any(r.recompute is not None and r.recompute.mode == "auto" and r.recompute.regions > 0
                   for r in self.records())

    def must_recompile(self, budget_bytes: int) -> bool:
        """Whether the plan's structure must change for ``budget_bytes`` ([Note: bounded
        re-plan]): its plans do not fit it even with nothing kept."""
        return not self.plans_fit(budget_bytes)

    def keep_candidates(self) -> list[KeepCandidate]:
        """The weights a current forward graph and a current backward graph both gather, each
        with where backward first needs it: positions in the backward graphs in the order they
        were recorded (the order they first ran), the earlier graphs' lengths added."""
        records = self.records()
        forward = {w[0] for r in records if r.kind == "forward" for w in r.gathered_weights}
        found: dict[int, KeepCandidate] = {}
        offset = 0
        for r in records:
            if r.kind != "backward":
                continue
            for param_id, pool_id, nbytes, first_read in r.gathered_weights:
                if param_id in forward and param_id not in found:
                    found[param_id] = KeepCandidate(param_id, nbytes, offset + first_read, pool_id)
            offset += r.num_nodes
        return list(found.values())

    def choose_kept(self, budget_bytes: int, world_size: int) -> tuple[KeepCandidate, ...]:
        """The keep-set for ``budget_bytes`` ([Note: the run-time keep-set] in persist.py)."""
        o = self.options
        if self.persist is False or (self.persist is None and world_size == 1):
            return ()
        need = max((self.plan_needs(r) for r in self.records()), default=0)
        cap = min(int(o.persist_fraction * budget_bytes), budget_bytes - need)
        return choose_kept(self.keep_candidates(), cap,
                           o.collective_latency_seconds * o.link_bytes_per_second)

    def set_kept(self, kept: tuple[KeepCandidate, ...]) -> None:
        """Make ``kept`` the keep-set of the model's pools (every rank, same program point)."""
        like = next(iter(self.model.parameters()))
        by_pool: dict[int, dict[int, int]] = {p: {} for p in self._kept_pools}
        for c in kept:
            by_pool.setdefault(c.pool_id, {})[c.key] = c.nbytes
        for pool_id, weights in sorted(by_pool.items()):
            pool_budget.keep_weights(runtime.pool_of(pool_id, like), weights)
        self._kept_pools = {p for p, w in by_pool.items() if w}
        self.kept = kept

    def _outcome(self, recompiled: bool) -> Replan:
        return Replan(recompiled, self.kept_bytes, len(self.kept))

    def grow(self, budget_bytes: int, room_bytes: int, world_size: int,
             profile: Optional[StepProfile] = None) -> Optional[Replan]:
        """After the measured step: spend the measured ``budget_bytes`` of gathered weights
        (``room_bytes`` for ``recompute="auto"``). Keeps weights for backward without compiling
        when the plan's structure may stay; compiles again when it must change ([Note: bounded
        re-plan]). Once. Returns what changed (None: nothing). Every rank must get the same
        answer: call it with rank-agreed numbers, at the same point of every rank's program."""
        if not self.options.measuring or not self.phases.enter(PlanPhase.GROWN):
            return None
        if self.keeps_activations() or self.must_recompile(budget_bytes):
            self.recompile(budget_bytes, room_bytes)
            return self._outcome(recompiled=True)
        kept = self.choose_kept(budget_bytes, world_size)
        if kept == self.kept:
            return None
        self.set_kept(kept)
        return self._outcome(recompiled=False)

    def settle(self, budget_bytes: int, room_bytes: int, world_size: int,
               profile: Optional[StepProfile] = None) -> Optional[Replan]:
        """At a steady step, once: compile again if a current plan does not fit the budget
        measured there even with nothing kept; else choose the keep-set again if the current one
        does not fit it, or if ``grow`` compiled the plan (its keep-set is chosen now, from its
        records). Returns what changed (None: nothing); rank-agreed inputs, as ``grow``."""
        if not self.phases.enter(PlanPhase.SETTLED):
            return None
        if self.must_recompile(budget_bytes):
            self.recompile(budget_bytes, room_bytes)
            return self._outcome(recompiled=True)
        over = self.largest_need() > budget_bytes
        if not (over or (self.recompiled and not self.kept)):
            return None
        kept = self.choose_kept(budget_bytes, world_size)
        if kept == self.kept:
            return None
        self.set_kept(kept)
        return self._outcome(recompiled=False)

    def recompile(self, budget_bytes: int, room_bytes: int) -> None:
        """[Note: whole-step budget] step 3 in zbuf/memory/step.py: with ``recompute="auto"``
        (and no explicit activation budget) the measured room becomes the plans' memory as it is
        ([Note: measured memory is not margined twice] in budget.py), so that budgeted recompute
        chooses the split of activations and gathers again; otherwise the gathers get
        ``budget_bytes``. The new graphs re-gather every weight in backward;
        nothing is kept until ``settle`` chooses from their records."""
        self.set_kept(())
        self.options = dataclasses.replace(self.options, measuring=False, persist=False)
        o = self.options
        if o.recompute == "auto" and o.activation_budget_bytes is None:
            self.options = dataclasses.replace(o, measured_room_bytes=room_bytes)
        else:
            self.options = dataclasses.replace(o, budget_bytes=budget_bytes)
        self.plan_starts.append(
            max((r.graph_id for r in schedule_report(self.model)), default=-1) + 1)
        fresh = torch.compile(self.model, backend="zbuf", options=dataclasses.asdict(self.options),
                              fullgraph=self.fullgraph, dynamic=self.dynamic)
        # The wrapper's Dynamo context follows its plan (torch reads it for pickling and AOT).
        self.compiled.dynamo_ctx = fresh.dynamo_ctx
        self.forward.fn = traced_as_zbuf(fresh.forward)
        self.recompiled = True
