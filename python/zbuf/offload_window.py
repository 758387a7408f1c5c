"""When the streamed optimizer state crosses the host link: inside the optimizer step only, or
also under the end of backward and the start of the next forward.

[Note: the step's window]
``StepOffload`` moves every streamed bucket up and back once per step ([Note: optimizer state
offloaded after backward] in zbuf/optimizer_step_offload.py). Inside the optimizer step there is
no compute to hide the copies behind (fused AdamW steps 14 GiB of qwen3-14b's moments in about
15 ms), so the step lasted the whole transfer longer: 311 ms of 3462 at qwen3-14b as rank 0 of 8
(benches/results/offload14.md). Both directions carry every byte, so moving only the uploads
out of the step hides nothing: the downloads alone still take as long.

The memory the offload saves is saved at the step's peak: the end of forward and the start of
backward, where the activations are. Late in backward the checkpointed inputs are mostly freed,
and early in the next forward few are made yet. So a *window* of ``slots`` device slots reaches
out of the optimizer step on both sides:

* late in backward, bucket ``i < slots`` gets its slot and is uploaded at backward point
  ``uploads[i]``, each as early as the room after that point holds it beside the buckets
  uploaded before it: the copies run under the rest of backward;
* in the optimizer step, the ``slots`` slots are the ring the buckets beyond them pass through,
  as the step's own two slots were;
* early in the next forward, the ``t``-th slot whose last download was issued goes back to the
  caching allocator at forward point ``releases[t]`` (the compute stream waits there for that
  download, which ran under the forward so far), each as late as the room before that point
  holds it.

The points are the step's progress marks ([Note: progress points] in zbuf/memory/progress.py):
in backward, each ``MARK_BYTES`` of gradients that arrived; in forward, the start of the forward
and of each block frame. They are the same program points in every step and on every rank.

The upward link is shared: the offloaded blocks' activations ([Note: offloaded blocks] in
zbuf/compile/block_offload.py) come back early in backward, the blocks forward called last
first, and the compute stream waits for each. A bucket of state, needed only in the optimizer
step, uploaded beside them halves their speed: at qwen3-32b as rank 0 of 8 the window uploaded
15 buckets (13.5 GB) at backward point 1, among the uploads of the 12 offloaded blocks, and
backward waited 117 ms a step for those (benches/results/onepath32b.md). So no bucket is
uploaded before the point after the last at which an offloaded block's upload began in the
profiled step (``link_busy_until``, [Note: progress points] in zbuf/memory/progress.py): later in
backward the room only grows, so this costs the window no slot, only time under which the
uploads hide, of which the rest of backward has more than the state's bytes need at the
link's speed.

Sized from one measured step ([Note: whole-step budget] in zbuf/memory/step.py): the first step
of the settled plan is profiled, its allocated peak between each two points read, and
``plan_window`` sizes the window from those peaks, rank-agreed. The window never raises the
step's own peak (the memory the offload was asked to save stays saved): every segment, with the
slots held through it, fits under the profiled step's largest peak and under the usable memory
charged the measured fragmentation. Within that, more slots never cost time (a bucket uploaded
late in backward is still a bucket less to wait for in the step), so the window holds the most
slots the optimizer step and the end of backward have room for; fewer than the step's own two
fit: no window, the step keeps its slots inside the optimizer step.
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple, Optional

from .memory.ledger import PPM
from .memory.phases import StepProfile

__all__ = ["OffloadWindow", "plan_window"]


class OffloadWindow(NamedTuple):
    """Where a step's streamed buckets are on the device ([Note: the step's window])."""

    uploads: tuple[int, ...]
    """``uploads[i]``: the backward point bucket ``i`` is uploaded at (non-decreasing); one per
    slot."""
    releases: tuple[int, ...]
    """``releases[t]``: the next forward's point where the ``t``-th slot to be downloaded from
    goes back (non-decreasing; 0: the forward's start)."""

    @property
    def slots(self) -> int:
        return len(self.uploads)


def plan_window(profile: StepProfile, buckets: int, slot_bytes: int, usable_bytes: int,
                fragmentation_ppm: int, step_slots: int,
                link_busy_until: int = -1) -> Optional[OffloadWindow]:
    """The window for ``buckets`` streamed buckets of ``slot_bytes`` each, or None ([Note: the
    step's window]). ``profile``: the measured step, its optimizer step with ``step_slots``
    slots; ``usable_bytes``: the limit less the margin and what the pool holds;
    ``link_busy_until``: the profiled step's last backward point at which an offloaded block's
    upload began (-1: none), before which no bucket is uploaded."""
    ceiling = min(profile.peak, usable_bytes * PPM // (PPM + fragmentation_ppm))

    def room(peak: int) -> int:  # slots that fit beside ``peak``
        return max(0, (ceiling - peak) // slot_bytes)

    # The rest of backward after each point, and the forward up to each point.
    after = list(accumulate(reversed(profile.backward), max))[::-1]
    before = list(accumulate(profile.forward, max))
    slots = min(buckets, room(after[-1]))
    if profile.optimizer <= ceiling:
        slots = min(slots, step_slots + room(profile.optimizer))
    else:
        slots = 0
    if buckets == 0 or slots < min(step_slots, buckets):
        return None
    first = min(link_busy_until + 1, len(after) - 1)
    uploads = tuple(max(first, next(j for j, a in enumerate(after) if room(a) > i))
                    for i in range(slots))
    last = len(profile.forward) - 1  # the last block's start: its segment ends the forward
    releases = tuple(next((k for k, b in enumerate(before) if room(b) < slots - t), last)
                     for t in range(slots))
    return OffloadWindow(uploads, releases)
