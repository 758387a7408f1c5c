"""Whether the optimizer's state lives on the device or in host memory: the user's word, or the
memory plan's when the user left it open (``zbuf.compile(..., offload_optimizer=None)``).

[Note: offloading when the step does not fit]
A user asks whether a model trains on a card; whether AdamW's moments must leave the card for it
is zbuf's to know, not a flag the user must find. The moments are made by the first ``step()``
and from then on held through every forward and backward, so what decides is step 0 itself,
measured ([Note: measure first, then spend] in zbuf/memory/step.py): at its optimizer step's
pre-hook, before any state exists, the step's largest forward or backward peak (torch's
reserved bytes plus what the pool held) is known on every rank, agreed as the largest, against
the smallest usable limit, with what the optimizer step starts from. If the whole state fits
beside that peak and in the optimizer step with its temporaries, nothing changes. If not, the
state is offloaded ([Note: optimizer state offloaded after backward] in
zbuf/optimizer_step_offload.py), keeping on the device what fits beside the forward/backward
peak and in the optimizer's own step with its temporaries and the two slots the streamed
part passes through (``place_state``): the less moved, the less exposed. Decided there, it is
decided for the run, on every rank alike, before the state exists, so nothing has to move
afterwards; the measured step's decision ([Note: whole-step budget]) then sees only the state
that stayed as the step's growth, and the slots in the optimizer's peak.

One case is known before step 0: when the whole state plus the gradients and the optimizer's
temporaries exceed the free memory agreed at compile time, a plan made with the state reserved
would be refused; then step 0's graphs are planned without it (``expect``), and step 0 decides
how much of it stays, as above. (Deciding there to offload all of it would move more than
needed: at qwen3-32b as rank 0 of 8 with foreach AdamW, whose temporaries are the size of the
shards, compile time sees 32.8 GB of state, 16.4 of gradients and 16.4 of temporaries beside
about 69 GB free, while step 0's measurement keeps most of the state on the card.)

The record says which it was (``report``): chosen by the user or by the plan, and why, in bytes.

[Note: the state placed beside the measured fragmentation]
The state is allocated at step 0's optimizer step ([Note: the state in segments of its own] in
zbuf/memory/step.py), and from then on later steps' activations must find room around it. That
is the allocator's
fragmentation growing with what is put into the memory, which the ledger already measures and
charges ([Note: fragmentation grows with the room] in zbuf/memory/ledger.py): so the state, and
its step's temporaries, are placed in the usable memory (the limit less the ledger's one margin)
beside the measured peaks divided by one plus step 0's fragmentation so far, its forward's and
backward's, rank-agreed (``beside_fragmentation``), whether the whole state fits or only part
of it stays. The placement has no margin of its own: the step's one margin is the ledger's, and
on the CPU stand-in, which fragments nothing, the state may fill the usable memory.

"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from .memory.ledger import PPM, beside_fragmentation
from .memory.optimizer_state import OptimizerPolicy
from .memory.phases import StepProfile
from .memory.progress import Point
from .offload_window import plan_window
from .optimizer_step_offload import BUCKET_BYTES, SLOTS, StepOffload

__all__ = ["OffloadChoice", "Placement", "place_state", "slot_estimate_bytes"]


def slot_estimate_bytes(optimizer: torch.optim.Optimizer,
                        bucket_bytes: int = BUCKET_BYTES) -> int:
    """Device bytes the streamed state's slots take at most, in the optimizer step: ``SLOTS``
    buckets, each closed by the parameter that reaches ``bucket_bytes`` (so at most that plus
    the largest parameter's state), and never more than the whole state."""
    policy = OptimizerPolicy.of(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    largest = max((policy.state_bytes([p]) for p in params), default=0)
    return min(policy.state_bytes(params), SLOTS * (bucket_bytes + largest))


class Placement(NamedTuple):
    """The plan's answer at step 0 ([Note: offloading when the step does not fit])."""

    fits: bool
    """The whole state fits beside the step's forward/backward peak and in its own step."""
    resident_bytes: int
    """State that stays on the device (all of it when ``fits``)."""


def place_state(usable_bytes: int, peak_bytes: int, step_start_bytes: int, state_bytes: int,
                temporary_fraction: float, slot_bytes: int, fragmentation_ppm: int) -> Placement:
    """Where the state goes. ``peak_bytes``: step 0's largest forward or backward peak (no
    state); ``step_start_bytes``: what is held as its optimizer step starts (shards, gradients);
    ``temporary_fraction``: the optimizer step's temporaries per byte of state it steps at once
    (foreach AdamW: one parameter-sized intermediate per two moments); ``slot_bytes``: the
    streamed state's device slots, made in the optimizer step only; ``fragmentation_ppm``: step
    0's so far. The state fits when it fits both beside the peak and in the step with its
    temporaries; else what stays is the most that fits both (in the step, beside the slots).
    Either way what is put there is charged the fragmentation ([Note: the state placed beside
    the measured fragmentation])."""
    beside_peak = beside_fragmentation(usable_bytes - peak_bytes, fragmentation_ppm)

    def in_step(free: int) -> int:  # the state whose temporaries fit too, rounded down once
        return int(free * PPM / ((PPM + fragmentation_ppm) * (1 + temporary_fraction)))

    if state_bytes <= min(beside_peak, in_step(usable_bytes - step_start_bytes)):
        return Placement(True, state_bytes)
    stays = min(state_bytes, beside_peak, in_step(usable_bytes - step_start_bytes - slot_bytes))
    return Placement(False, max(0, stays))


class OffloadChoice:
    """The optimizer's state placement for one ``zbuf.compile``: ``mode`` True (the user's: all
    of it offloaded), or None (the plan's, at step 0: ``decide``).
    ``install`` puts the offload's hooks on the optimizer; call it after the step's memory owner
    has put its own, so that at each step its decision runs before the offload's work."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 mode: Optional[bool]) -> None:
        self.optimizer = optimizer
        self.device = device
        self.mode = mode
        self.offload: Optional[StepOffload] = None
        self.chosen_by: Optional[str] = "user" if mode else None
        """"user", "plan", or None (undecided, or decided to keep the state on the device)."""
        self.why: Optional[str] = "offload_optimizer=True" if mode else None
        self.decided = bool(mode)
        self.measured: Optional[dict[str, int]] = None
        """Step 0's numbers the plan decided on."""
        self.expected: Optional[str] = None
        """Why compile time already expected the state not to fit (``expect``)."""
        self.window_sized_from: Optional[dict[str, int]] = None
        """The profiled step the window was sized from ([Note: the step's window] in
        zbuf/offload_window.py)."""

    @property
    def pending(self) -> bool:
        """The plan still has to decide at step 0."""
        return not self.decided

    @property
    def offloaded(self) -> bool:
        return self.chosen_by is not None

    def undecided_host_bytes(self) -> int:
        """Host memory step 0's decision may still take: the whole state while it is pending
        (the host arenas locked before it leave room for it: [Note: arenas locked ahead] in
        zbuf/compile/block_offload.py)."""
        return self._state_bytes() if self.pending else 0

    def _state_bytes(self) -> int:
        """The optimizer's whole state, as ``OptimizerPolicy`` counts it."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return OptimizerPolicy.of(self.optimizer).state_bytes(params)

    def install(self) -> StepOffload:
        self.offload = StepOffload(self.optimizer, self.device, bucket_bytes=BUCKET_BYTES,
                                   active=self.offloaded)
        return self.offload

    def expect(self, free_bytes: int, need_bytes: int) -> None:
        """Known at compile time: with the whole state reserved, the agreed free memory
        ``free_bytes`` cannot hold the gradients and the step's temporaries ``need_bytes``. Step
        0's graphs are planned without the state; step 0 decides how much of it stays."""
        self.expected = (f"at compile time the agreed free memory beside the optimizer's state "
                         f"({_gib(free_bytes)}) could not hold the gradients and the step's "
                         f"temporaries ({_gib(need_bytes)})")

    def decide(self, usable_bytes: int, peak_bytes: int, step_start_bytes: int,
               fragmentation_ppm: int) -> None:
        """At step 0's optimizer step, before the state exists: ``peak_bytes`` is the step's
        rank-agreed largest forward or backward peak, ``step_start_bytes`` what is held now,
        ``usable_bytes`` the limit less the margin, ``fragmentation_ppm`` the step's so far
        ([Note: offloading when the step does not fit])."""
        self.decided = True
        policy = OptimizerPolicy.of(self.optimizer)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = policy.state_bytes(params)
        fraction = policy.temporary_bytes(params) / state if state else 0.0
        place = place_state(usable_bytes, peak_bytes, step_start_bytes, state, fraction,
                            slot_estimate_bytes(self.optimizer, BUCKET_BYTES), fragmentation_ppm)
        self.measured = {"usable_bytes": usable_bytes, "peak_bytes": peak_bytes,
                         "step_start_bytes": step_start_bytes, "state_bytes": state,
                         "fragmentation_ppm": fragmentation_ppm}
        if place.fits:
            return
        self.offload.activate(place.resident_bytes)
        self.chosen_by = "plan"
        self.why = ("" if self.expected is None else self.expected + "; ") + (
                    f"step 0 peaked at {_gib(peak_bytes)} and held {_gib(step_start_bytes)} "
                    f"as its optimizer step began; the optimizer's {_gib(state)} of state does "
                    f"not fit beside both in the usable {_gib(usable_bytes)}: "
                    f"{_gib(self.offload.resident_bytes)} of it stays on the device, the rest "
                    f"in host memory")

    def plan_window(self, profile: StepProfile, usable_bytes: int,
                    fragmentation_ppm: int, link_busy_until: int = -1) -> None:
        """[Note: the step's window] in zbuf/offload_window.py."""
        off = self.offload
        if off is None or not off.active or not off.buckets:
            return
        off.window = plan_window(profile, len(off.buckets), off.slot_bytes, usable_bytes,
                                 fragmentation_ppm, min(SLOTS, len(off.buckets)),
                                 link_busy_until)
        self.window_sized_from = {"step": profile.step, "peak_bytes": profile.peak,
                                  "usable_bytes": usable_bytes,
                                  "fragmentation_ppm": fragmentation_ppm,
                                  "link_busy_until": link_busy_until}

    def at(self, point: Point) -> None:
        if self.offload is not None:
            self.offload.at(point)

    def report(self) -> dict[str, Any]:
        """For the run record: who chose, why, and what the offload moved."""
        out = {"mode": "auto" if self.mode is None else "on", "chosen_by": self.chosen_by,
               "why": self.why, "measured": self.measured,
               "window_sized_from": self.window_sized_from}
        if self.offload is not None:
            out.update(self.offload.report())
        return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
