"""What the step's memory owner asks of whatever plans a structure, and the one state machine
every such planner runs: measure -> grow -> settle.

[Note: one planner interface]
``StepMemory`` (step.py) measures the step and decides how much memory a plan may use; a
planner turns that into a plan for its structure: the whole graph (compile/replan.py,
``Replanner``) or the block frames (compile/block_replan.py, ``BlockReplanner``). The memory
owner never looks inside a plan: it reads what the plans hold (``largest_need``,
``activation_peaks``, ``planned_budget``, ``kept``, ``recompute_stats``) and hands the
rank-agreed budget and room over twice, once to ``grow`` and once to ``settle``. The arrow runs
one way: ``zbuf.compile`` builds a planner and gives it to ``StepMemory``; nothing here imports
``zbuf.compile``.

Each decision is made once, in order, on every rank at the same program point ([Note: bounded
re-plan] in compile/replan.py): ``PlanPhase`` names where a planner stands, and ``PlanPhases``
is the machine both planners share, and ``StepMemory`` with them (its decisions are the phases'
entries).
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, Optional, Protocol, Sequence

from .phases import StepProfile
from .progress import Point

__all__ = ["PlanPhase", "PlanPhases", "Replan", "StructurePlanner", "StatePlacement"]


class PlanPhase(enum.IntEnum):
    """Where a planner stands, in the order it gets there."""

    MEASURING = 0
    """The lean first plan runs ([Note: measure first, then spend] in step.py) and is measured."""
    GROWN = 1
    """The plan grew into the measured room (or was left as it was) and runs to the steady step."""
    SETTLED = 2
    """The steady step was judged; the plan changes no more."""


class PlanPhases:
    """A planner's ``PlanPhase``: each later phase is entered once, never twice or backwards."""

    __slots__ = ("phase",)

    def __init__(self) -> None:
        self.phase = PlanPhase.MEASURING

    def enter(self, phase: PlanPhase) -> bool:
        """Move to ``phase`` if it lies ahead; returns whether the decision that leads there is
        due (False: it was made already)."""
        if self.phase >= phase:
            return False
        self.phase = phase
        return True


class Replan(NamedTuple):
    """What a re-plan changed."""

    recompiled: bool
    """The model was compiled again (its structure changed); False: only the keep-set."""
    kept_bytes: int
    """Gathered bytes forward keeps for backward from now on."""
    kept_weights: int
    """How many weights forward keeps for backward from now on."""


class KeptWeight(Protocol):
    """A weight forward keeps for backward, as the memory owner counts it."""

    nbytes: int


class RecomputeReport(Protocol):
    """A planner's recompute levels in force, for the run record."""

    def to_dict(self) -> dict[str, Any]: ...


class StructurePlanner(Protocol):
    """What ``StepMemory`` asks of the planner of one structure ([Note: one planner interface])."""

    kept: Sequence[KeptWeight]
    """The weights forward keeps for backward under the plan in force."""

    def largest_need(self) -> int:
        """The most gathered bytes the plans in force hold at once, kept weights included."""

    def activation_peaks(self, *, gradients: bool = True) -> dict[str, int]:
        """The plans' projected activation peaks by phase ("forward", "backward");
        ``gradients=False``: less the gradient shards each graph makes."""

    def planned_budget(self) -> Optional[int]:
        """The gather budget the plans in force were made within (None: nothing gathers)."""

    def recompute_stats(self) -> Optional[RecomputeReport]:
        """The recompute levels in force, if this planner chooses them (else None)."""

    def refuse_if_no_plan_fits(self, peak_bytes: int, usable_bytes: int, *, phase: str,
                               step: int, growth_bytes: int) -> None:
        """Raise on every rank when torch's own measured peak exceeds what it may use."""

    plans_from_profile: bool
    """Whether ``grow`` and ``settle`` need their step's profile ([Note: progress points] in
    progress.py): the memory owner then profiles the measured and the steady step."""

    def grow(self, budget_bytes: int, room_bytes: int, world_size: int,
             profile: Optional[StepProfile]) -> Optional[Replan]:
        """After the measured step, once: spend the measured budget and room. ``profile``: the
        measured step's, rank-agreed, what step 0 left resident added (None unless
        ``plans_from_profile``, or where the ranks' points differ)."""

    def settle(self, budget_bytes: int, room_bytes: int, world_size: int,
               profile: Optional[StepProfile]) -> Optional[Replan]:
        """At the steady step, once: shrink what no longer fits (``profile``: the steady
        step's, as ``grow``'s)."""


class StatePlacement(Protocol):
    """What ``StepMemory`` asks of the choice of where the optimizer's state lives, made at step
    0's optimizer step ([Note: offloading when the step does not fit] in zbuf/offload_choice.py)."""

    @property
    def pending(self) -> bool:
        """The choice is still to be made."""

    @property
    def offloaded(self) -> bool:
        """Some of the state lives in host memory."""

    def decide(self, usable_bytes: int, peak_bytes: int, step_start_bytes: int,
               fragmentation_ppm: int) -> None:
        """Choose from step 0's rank-agreed peak, what the optimizer step starts from and the
        fragmentation step 0 measured so far ([Note: fragmentation grows with the room] in
        ledger.py)."""

    def plan_window(self, profile: StepProfile, usable_bytes: int,
                    fragmentation_ppm: int) -> None:
        """Size the step's window from one profiled step, rank-agreed ([Note: the step's
        window] in zbuf/offload_window.py)."""

    def at(self, point: Point) -> None:
        """A progress point of the running step ([Note: progress points] in progress.py)."""

    def report(self) -> dict[str, Any]:
        """For the run record: who chose, why, and what moved."""
