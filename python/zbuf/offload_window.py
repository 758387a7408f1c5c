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
and early in the next forward few are made yet. So a *window* of ``slots`` device slots may
hold streamed buckets from a point late in backward (``upload_at``: the first ``slots`` buckets
are uploaded there, under the rest of backward) through the optimizer step (the buckets beyond
them pass through the same slots as before) to a point early in the next forward
(``release_at``: the compute stream waits there for the last downloads, which ran under the
forward so far, and the slots go back to the caching allocator).

The points are the step's progress marks ([Note: progress points] in zbuf/memory/progress.py):
in backward, each ``MARK_BYTES`` of gradients that arrived; in forward, the start of the forward
and of each block frame. They are the same program points in every step and on every rank.

Sized from one measured step ([Note: whole-step budget] in zbuf/memory/step.py): the first step
of the settled plan is profiled, its allocated peak between each two points read, and
``plan_window`` picks the window from those peaks, rank-agreed. The window never raises the
step's own peak (the memory the offload was asked to save stays saved): the slots fit beside
every segment they are held through, under the profiled step's largest peak and under the
usable memory charged the measured fragmentation. Of the windows that fit, the one holding the
most slots (the most buckets moved outside the step), uploading as early and releasing as late
as that many slots allow. None fits: the step keeps its two slots inside the optimizer step.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from .memory.ledger import PPM
from .memory.phases import StepProfile

__all__ = ["OffloadWindow", "plan_window"]


class OffloadWindow(NamedTuple):
    """Where a step's streamed buckets are on the device ([Note: the step's window])."""

    slots: int
    """Device slots: the first ``slots`` buckets are uploaded at ``upload_at``."""
    upload_at: int
    """The backward point the uploads start from."""
    release_at: int
    """The next forward's point where the slots go back (0: the forward's start)."""


def plan_window(profile: StepProfile, buckets: int, slot_bytes: int, usable_bytes: int,
                fragmentation_ppm: int, step_slots: int) -> Optional[OffloadWindow]:
    """The window for ``buckets`` streamed buckets of ``slot_bytes`` each, or None ([Note: the
    step's window]). ``profile``: the measured step, its optimizer step with ``step_slots``
    slots; ``usable_bytes``: the limit less the margin and what the pool holds."""
    ceiling = min(profile.peak, usable_bytes * PPM // (PPM + fragmentation_ppm))
    if buckets <= step_slots:
        return None  # every bucket already fits the step's own slots: nothing to move out
    for slots in range(buckets, step_slots, -1):
        extra = slots * slot_bytes
        if profile.optimizer + (slots - step_slots) * slot_bytes > ceiling:
            continue
        upload_at = next((j for j in range(len(profile.backward))
                          if max(profile.backward[j:]) + extra <= ceiling), None)
        if upload_at is None:
            continue
        release_at = 0
        while (release_at < len(profile.forward) - 1
               and profile.forward[release_at] + extra <= ceiling):
            release_at += 1
        return OffloadWindow(slots, upload_at, release_at)
    return None

