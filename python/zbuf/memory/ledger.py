"""The step's memory as every rank agreed it: one ledger, one name per quantity, one margin.

[Note: the ledger]
After a measured step (step.py) the memory owner writes down, rank-agreed with one all-reduce
(``agree_extremes``: the smallest limit, the largest of the rest):

* ``limit_bytes``: what torch and the pool may use together on this device (CUDA: the
  driver's free memory plus what both hold, capped by an emulated card, [Note: emulated
  capacity] in shared.py; the CPU stand-in: the free memory ``zbuf.compile`` agreed plus the
  tracked bytes then);
* ``torch_forward_bytes`` / ``torch_backward_bytes``: what torch holds at its peak in each phase
  (the caching allocator's reserved bytes: live tensors, its cache and its fragmentation), what
  the measured step left resident added (the optimizer's state, kept gradients);
* ``torch_live_bytes``: the live tensors of torch's worse phase, the same growth added;
* ``optimizer_bytes``: what the optimizer step holds at its peak (None: no optimizer attached,
  the step then counts as backward);
* ``pool_excess_bytes``: what the pool held beyond its plans' largest live gathered bytes (it
  keeps, per block size, as many blocks as are ever live together: [Note: pool sizing] in
  compile/schedule.py);
* ``fragmentation_ppm``: [Note: fragmentation grows with the room].

From those alone follow what a plan may use: ``usable_bytes``, the limit less the one margin
(``MARGIN_DIVISOR``) and the pool's excess; ``gather_budget_bytes``, what the gathers of every
graph may hold beside torch's larger peak; ``room_bytes``, what activations and gathered weights
may share. Budget and room are quantised by the one quantiser (``stable_bytes``, [Note: stable
agreed memory] in agreement.py), so a relaunch plans the same.

[Note: fragmentation grows with the room]
The measured peaks are the allocator's reserved bytes, so the measured step's fragmentation is in
them; but what a re-plan puts into the room (``recompute="auto"``'s kept activations above all)
fragments the allocator too, in proportion. So the room is divided by one plus the measured
step's fragmentation: what it reserved beyond its allocated high-water mark, per byte it
allocated beyond its start, rank-agreed (``fragmentation_ppm``). The high-water marks, not each
phase's own: a steady step's forward starts with the cache the step before left (its backward
and optimizer peaks), which the forward's allocated peak need not reach; read per phase, that
cache counted as the forward's fragmentation (qwen3-32b's plain setup, whose backward begins
17 GiB above its forward at the fp32 loss, read the cap and sized no window for the state).
At the steady step the measured step ran the plan being judged: its kept activations and
gathered bytes, and their fragmentation, are in the measured peaks, so only the memory left
beside them (or what they lack) is divided (``measured_room``), never the fragmentation charged
twice.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.distributed as dist

from .agreement import MEASURED_BITS, agree_extremes, stable_budget, stable_bytes
from .phases import StepPhases

__all__ = ["Ledger", "MARGIN_DIVISOR", "PPM", "without_margin", "fragmentation_ppm",
           "beside_fragmentation", "measured_room"]

MARGIN_DIVISOR = 64
"""``limit / MARGIN_DIVISOR`` stays unplanned: allocations that differ from the measured step
to later steps (the measurement itself is exact for what it saw)."""


def without_margin(limit_bytes: int) -> int:
    """``limit_bytes`` less the margin."""
    return limit_bytes - limit_bytes // MARGIN_DIVISOR


PPM = 1_000_000

MAX_FRAGMENTATION_PPM = PPM
"""Above one reserved-unallocated byte per allocated byte the measurement says more about the
allocator's cache of freed blocks than about fragmentation; the room is never cut below half."""


def fragmentation_ppm(row: StepPhases) -> int:
    """The allocator's fragmentation in the measured step, parts per million of what the step
    allocated beyond its start ([Note: fragmentation grows with the room]): what it reserved
    beyond its allocated high-water mark. 0 on the CPU stand-in, which reserves exactly what it
    allocates."""
    grown = row.allocated_peak_bytes - row.start_bytes
    over = row.reserved_peak_bytes - row.allocated_peak_bytes
    if grown <= 0 or over <= 0:
        return 0
    return min(over * PPM // grown, MAX_FRAGMENTATION_PPM)


def beside_fragmentation(nbytes: int, frag_ppm: int) -> int:
    """What may be put into ``nbytes`` of memory when each byte put there fragments the
    allocator as the measured step did: ``nbytes`` divided by one plus the fragmentation
    ([Note: fragmentation grows with the room]), rounded down."""
    return nbytes * PPM // (PPM + frag_ppm)


def measured_room(usable_bytes: int, reserved: dict[str, int], activations: dict[str, int],
                  held_bytes: Optional[int], frag_ppm: int) -> int:
    """What activations and gathered weights may share, rounded ([Note: stable agreed memory]
    in agreement.py; [Note: fragmentation grows with the room]): the smallest over the
    phases of ``reserved`` (torch's measured reserved peak of each). ``activations`` are the
    current plans' projected activations in each phase, ``held_bytes`` the gathered bytes they
    hold at most. Before a new plan (the grow: ``held_bytes`` None) all the memory beside step 0's
    peaks is divided by one plus the fragmentation, step 0's plan being replaced whole. Measured
    under the plan being judged (the settle), what it holds counts at face value, its
    fragmentation being in ``reserved`` already: only what is left beside it is divided and
    rounded down, or what it lacks divided and rounded up, so a plan measured to fit gets a room
    it fits, whatever the rounding."""
    rooms = []
    for phase, peak in reserved.items():
        own = activations.get(phase, 0)
        free = usable_bytes - (peak - own)
        if held_bytes is None:
            rooms.append(stable_budget(beside_fragmentation(free, frag_ppm)))
            continue
        face = held_bytes + own
        spare = beside_fragmentation(free - face, frag_ppm)
        if spare >= 0:
            rooms.append(face + stable_bytes(spare, bits=MEASURED_BITS))
        else:
            quantum = 1 << max(0, (-spare).bit_length() - 1 - MEASURED_BITS)
            rooms.append(max(1, face - -(spare // quantum) * quantum))
    return min(rooms)


@dataclasses.dataclass(frozen=True)
class Ledger:
    """One measured step's memory, rank-agreed ([Note: the ledger])."""

    limit_bytes: int
    """What torch and the pool may use together (smallest over the ranks)."""
    torch_forward_bytes: int
    """Torch's reserved forward peak, the measured step's resident growth added (largest)."""
    torch_backward_bytes: int
    """Torch's reserved backward peak, likewise (without an optimizer: backward and optimizer)."""
    torch_live_bytes: int
    """Torch's live tensors in its worse phase, the growth added (largest)."""
    optimizer_bytes: Optional[int]
    """Torch's reserved optimizer-step peak (largest); None without an optimizer attached."""
    pool_excess_bytes: int
    """What the pool held beyond its plans' largest live gathered bytes (largest)."""
    fragmentation_ppm: int
    """[Note: fragmentation grows with the room] (largest)."""

    @classmethod
    def agreed(cls, group: Optional[dist.ProcessGroup], device: torch.device, *,
               limit_bytes: int, torch_forward_bytes: int, torch_backward_bytes: int,
               torch_live_bytes: int, optimizer_bytes: Optional[int], pool_excess_bytes: int,
               fragmentation_ppm: int) -> "Ledger":
        """This rank's readings agreed over ``group`` with one all-reduce: the smallest limit,
        the largest of the rest. Every rank of ``group`` calls it at the same program point."""
        (limit,), (fw, bw, opt, excess, live, frag) = agree_extremes(
            group, device, smallest=[limit_bytes],
            largest=[torch_forward_bytes, torch_backward_bytes, optimizer_bytes or 0,
                     pool_excess_bytes, torch_live_bytes, fragmentation_ppm])
        return cls(limit, fw, bw, live, None if optimizer_bytes is None else opt, excess,
                   frag)

    @property
    def usable_bytes(self) -> int:
        """What torch and the plans' gathers may use: the limit less the margin and the
        pool's excess."""
        return without_margin(self.limit_bytes) - self.pool_excess_bytes

    @property
    def gather_budget_bytes(self) -> int:
        """What every graph's gathers may hold beside torch's larger peak (quantised)."""
        return stable_budget(self.usable_bytes
                             - max(self.torch_forward_bytes, self.torch_backward_bytes))

    def room_bytes(self, activations: dict[str, int], held_bytes: Optional[int]) -> int:
        """What activations and gathered weights may share (``measured_room``): ``activations``
        the plans' projected activations by phase, ``held_bytes`` the gathered bytes of the plan
        that was measured (None before a new plan)."""
        return measured_room(self.usable_bytes, {"forward": self.torch_forward_bytes,
                                                 "backward": self.torch_backward_bytes},
                             activations, held_bytes, self.fragmentation_ppm)
