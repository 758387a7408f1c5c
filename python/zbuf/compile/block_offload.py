"""Block calls whose kept activations wait in host memory between their forward and their
backward: the planner's third choice beside keeping and recomputing.

[Note: offloaded blocks]
Under ``recompute="auto"`` each block call keeps its activations for backward, or some of them,
or recomputes them ([Note: block levels] in block_replan.py). Kept on the device, a block's
activations cost device memory from its forward to its backward, all of them together at the
start of backward, the step's peak; recomputed, they cost the block's forward again in
backward. A memory-bound model (qwen3-14b as rank 0 of 8 on an 80 GiB card) has room for few
kept blocks, so most of its blocks recompute (about 500 ms of a 3 s step). The host link is
idle all that while: the gathers run over NVLink, the optimizer's state stays on the device.
So a block may run at a level above 0 ("selective" or "keep") and send what it keeps to pinned
host memory in its forward, while the blocks after it compute, and take it back in backward,
while the blocks after it in forward run their backward. Its device bytes are held only on the
way: the block's own while its copy runs, the next offloaded block's while its upload waits to
be used.

The plan (``plan_block_levels`` in recompute_plan.py, pure and fuzzed): for each level above 0
and each number of calls on their way at once (two or three), with the room less that many
blocks' bytes at that level (the most the offloaded blocks hold on the device at once), the
levels are planned as before; of the blocks left at level 0, those whose copies the link runs
without ever making the compute stream wait are offloaded at that level ([Note: the copy
queue] in recompute_plan.py: the copy's time over the host link, its speed measured, [Note:
the measured host link] in zbuf/host_link.py, against the block's forward, measured too,
[Note: the measured block forward] in block_clock.py), as many as the agreed host memory
holds. The plan that saves the most modelled recompute is taken, and only when it saves more
than the plan without offload. The link decides: "selective" keeps the matmul and attention
outputs, about 56 % of "keep"'s bytes, and leaves only the elementwise recompute, so where one
block's copy at "keep" is modelled at three block forwards and at "selective" 1.75, "selective"
offloads about 75 % more blocks at most of the saving each (qwen3-14b:
tests/test_block_offload.py).
A call moves everything its level saves, what level 0 saves included (the outputs a user's
selective checkpoint policy saves, off level 0's partition:
``LevelEstimate.moved_beside_level_bytes``),
so the link, the host memory and the arenas are planned on that
(``RecomputePlan.offload_block_bytes``), and the device reserve on the level's bytes beyond
level 0 alone (level 0 holds its own saves until backward anyway). Planned on the latter, a
CPU stack under torchtitan's selective policy moved 17248 bytes a call into arenas sized for
7040 (tests/test_block_offload.py).
Only on CUDA: on the host there is no link to use.

The run (``BlockOffload``, one per model's frames), each saved tensor of the block's frame
that is not a gathered weight ([Note: two blocks live] in block_prefetch.py), nor one of the
block call's own inputs, positional or keyword (level 0 keeps those too, and a Hugging Face
layer's rotary tables are every layer's), nor a view that is not its whole storage:

* forward, when the frame saves it (``OffloadedCall.pack``: after the frame's forward ran):
  the first tensor of a call makes the compute stream wait for the copies of the offloaded
  call ``in_flight - 1`` before it (so at most ``in_flight`` calls' bytes are on the device,
  the planned reserve) and records where the compute stream stands; each tensor is then
  copied into pinned host memory on the ``down`` stream, which waits for that point; the call
  holds the device tensor until the compute stream waits for its copy (a later call's throttle,
  or the drain) and drops it right after that wait, so its memory goes back to the compute
  stream's cache in that stream's order (FSDP2's way with its own copies). With
  ``record_stream`` instead, the allocator reused such memory only once it saw the copy had
  run: with the Python thread ahead of the device, torch mapped new memory for the blocks after
  it and, at the card's limit, unmapped every free page of its cache (an allocator retry; one
  in step 25 at qwen3-14b, benches/results/onepath14.md), whatever the plan's reserve said
  (since, none in any step at either placement there);
* at the queue's drain (a block after the last offloaded call, or the model's output), the
  compute stream waits for the forward's last copies (``BlockOffload.forward_reaches``,
  ``BlockOffload.finish_forward``);
* backward, when the block ``upload_ahead`` calls after an offloaded one in forward begins its
  backward (``BlockOffload.reached``), that call's tensors
  are uploaded on the ``up`` stream into device memory allocated on the compute stream (torch's
  caching allocator keeps each stream's blocks apart, and backward frees them into compute's),
  ``up`` first waiting for the compute work queued so far, which may still use that memory; the
  frame's backward unpacks them (``OffloadedCall.unpack``), the compute stream waiting for the
  upload first. A call unpacked before it was reached uploads then (exposed, still correct).

Streams and events, each with who produces and who consumes it:
``down`` runs the downloads (producer: ``pack``); ``_saved`` is where the compute stream stood
when the frame saved (producer: the call's first ``pack``; consumer: ``down``); ``_downloaded``
is the end of the call's downloads (producer: ``pack``; consumers: the first ``pack`` of the
offloaded call ``in_flight - 1`` after it, the drain, after whose waits the call's device
tensors are dropped, and this call's upload); ``up`` runs
the uploads (producer: ``upload``); ``_uploaded`` is the end of the upload (producer:
``upload``; consumers: the first ``unpack``, and a call dropped before its backward, whose
compute stream waits for it before the memory goes back).

Rank agreement: which calls are offloaded is the plan's (rank-agreed: [Note: block levels]),
and the copies issue no collective, so a rank's offload changes nothing another rank sees but
its step time. On the host (the CPU stand-in) the tensors are copied to host memory on the one
stream there is: the same program, nothing hidden, for tests.

Limits: a call's tensors are copied in its frame's save order once the whole frame ran, so its
device bytes stay until the compute stream waited for its copies (the reserve counts the call
whose forward runs beside those on their way); the copies share the link with the optimizer
state's window when that state is offloaded too ([Note: the step's window] in
zbuf/offload_window.py), which the plan does not model; the plan's estimate of a block's bytes
sizes its arena (``unplanned_host_bytes`` in the record counts what did not fit), above what the
call moves at "keep" ([Note: budgeted recompute] in recompute.py) and where level 0 saves what
the level does not; where the offloaded blocks' level is not the shared frame's, its frame is
one more block compile at the re-plan ([Note: block levels], 1). A saved tensor that the program
changes in place after its block (which autograd refuses without hooks) is copied as the stream
has it. Measured at qwen3-14b (benches/results/onepath14.md): under ``auto`` before the uploads
came out of the compute stream's cache (two retries a step), as the default's plan after it (one
retry, in step 2), and under zbuf's expandable segments with ``record_stream`` still freeing the
downloads' memory (a retry in step 2 and one in step 25); since the downloads' memory goes back
in the compute stream's order, none (four runs, both placements).

[Note: host arenas and the first offloaded step]
Each offloaded position has one host arena ([Note: host arenas] in zbuf/host_arena.py) of the
plan's estimate of a block's bytes, reused by its call every step, most of them locked ahead of
the plan ([Note: arenas locked ahead]). ``plan`` starts page-locking the others on
``PIN_THREADS`` threads of their own, in the order the forward needs them, so that the locking
runs while the Python thread compiles the offloaded blocks' frame and runs the blocks before the
first offloaded one. The forward never waits for it: a call whose arena is still
being locked copies through ordinary (pageable) host memory, which holds the Python thread while
its copy runs but costs only that step (``unlocked_host_bytes`` in the record). Waiting cost
more: 33 GB of arenas took 25 s to lock at qwen3-14b on an H100 machine, and the first offloaded
step waited 19.6 s of it (benches/results/onepath14.md). The locking's threads (``PIN_THREADS``
arenas at once, each faulting its pages in on threads of its own) take at most a quarter of this
rank's share of the host's cores (the ranks of a host lock theirs at once): the re-plan's
compile runs beside them on the Python thread and Inductor's workers. With eight threads an
arena on a 16-core machine (32 threads) the re-plan's step ran longest where the locking took
longest: 14.0 s beside 14.7 s of locking (the sum over the arenas) against 11.6 s beside 6.1 s
at qwen3-14b on an H100, 11.7 s beside 11.2 s against 8.0 s beside 5.7 s on an H200
(benches/results/onepath14.md). With one thread an arena there (the quarter share on 16 cores) the
locking took longer, 15.8-19.5 s inside and 7.5-8.3 s at the parent placement, and the re-plan's
step did not shorten inside (11.4-13.8 s) where it did at the parent placement (8.5-9.4 s): the
inside calls ran first on fresh machines, so these calls do not separate placement from machine.
The next calls did: on one machine, the parent placement first, the locking took 7.9 s and 5.7 s
(inside) and the re-plan's step 8.3 and 7.3 s; the inside placement alone on a fresh machine
20.6 s and 12.8 s. The machine decides: its first process faults in host pages that no process
there touched before, and the lock probe (benches/lock_contention.py) holds driver calls up to
0.29 s behind each arena's registration and slows a trace by 7-10 %.
A second call at a position whose arena holds a live call's copies (two forwards
before one backward) copies through torch's pinned tensors instead.

[Note: arenas locked ahead]
Locked from the plan on, the arenas were still being locked through the first offloaded step:
at qwen3-14b at the parent placement on a fresh H100 that step took 10.1 s against a 2.86 s step,
nothing compiled, beside 23.0 s of locking (summed over 22 arenas, 38.2 GB) and 5.14 GB copied
through pageable host memory that no process had touched (benches/results/onepath14.md). The
arenas do not need the plan: a call carves its copies from whichever arena its position holds,
and every arena of a plan has the same size, the estimate's bytes of a call at the offloaded
level. So at the measured step's output, before its backward, the re-planner predicts the
default's plan with the room it cannot know yet unbounded (the link, the block's forward as
that forward took it, the host's share: the plan's own inputs, this rank's, not agreed, since
locking host memory changes nothing the ranks share; the share less what step 0's optimizer
step may still put in host memory, the optimizer's state while its place is undecided:
``OffloadChoice.undecided_host_bytes``) and ``lock_ahead`` starts locking that
many arenas, in the forward's order, on the arenas' threads, unless that plan would compile a
frame its saving does not pay for within the step so far ([Note: a re-plan's compile pays for
itself] in block_replan.py; the step only grows, and less room saves no more). The plan, made
after the backward, takes as many as its positions need (a plan offloads no more blocks than
the unbounded room allows); those not yet started are cancelled, the others dropped once
locked. The backward's
compile and run, the optimizer's step and the re-plan run beside the locking instead of the
first offloaded step. The record says how many were locked ahead and taken
(``arenas_locked_ahead``, ``arenas_taken_ahead``); ``arenas_locked_after_s`` then counts from
the locking's start. Measured at qwen3-14b on a fresh H100: at the parent placement all 22
arenas were taken, none of the first offloaded step's calls copied through pageable memory, and
that step took 2.88 s against a 2.86 s step (10.1 s before); at the inside placement the
locking (21.1 s summed) ended 5.4 s after it began, before the plan, and the cold first step
stayed 0.86x FSDP2's (benches/results/onepath14.md).
"""

from __future__ import annotations

import collections
import enum
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, Optional

import torch

from ..host_arena import ALIGN, HostArena, span_bytes
from ..host_link import LinkSpeed
from ..memory import host_core_share
from ..stream_waits import TimedWaits
from .recompute_plan import NO_COPIES, CopyQueue, HostLink

__all__ = ["BlockOffload", "CopyWait", "OffloadedCall", "OffloadedTensor", "PIN_THREADS",
           "RANK_OWN", "arena_bytes", "touch_threads_per_arena"]


class CopyWait(enum.Enum):
    """Where the compute stream waits for the offloaded calls' copies ([Note: offloaded
    blocks]): each is time the step stood still, recorded apart so that a plan's exposed time
    says which part of the copy queue's model ([Note: the copy queue] in recompute_plan.py)
    the device did not keep to."""

    THROTTLE = "throttle"
    """In forward, a call's first save, for the call ``in_flight - 1`` before it."""
    DRAIN = "drain"
    """In forward, at the queue's drain (a block, or the model's output), for every call."""
    UPLOAD = "upload"
    """In backward, a call's first unpack, for its upload."""


RANK_OWN = ("lock_seconds", "lock_touch_seconds", "lock_register_seconds",
            "arenas_locked_after_s", "planned_in_s", "unlocked_copy_seconds",
            "arenas_locked_ahead", "arenas_taken_ahead", "host_link_probe")
"""The keys of ``BlockOffload.report`` that are this rank's own: its host wall times, its link
as its probe read it, and the arenas it locked ahead from that link ([Note: arenas locked
ahead]); every other one the ranks share (the plan and the bytes are agreed)."""

PIN_THREADS = 4
"""Arenas page-locked at once: each lock mostly waits in the kernel, so several overlap."""

PIN_CORES_SHARE = 4
"""The locking's threads together take at most 1/``PIN_CORES_SHARE`` of this rank's share of the
host's cores ([Note: host arenas and the first offloaded step])."""


def touch_threads_per_arena(cores: int) -> int:
    """Threads that fault in one arena's pages, of ``cores``: ``PIN_THREADS`` arenas at once
    within the locking's share, one at least."""
    return max(1, cores // (PIN_CORES_SHARE * PIN_THREADS))

ARENA_SLACK = 64
"""A position's arena holds the plan's estimate of a block's bytes, 1/``ARENA_SLACK`` more, and
``ARENA_SLACK`` tensors' alignment."""


def arena_bytes(block_bytes: int) -> int:
    """The arena of a call the plan estimates at ``block_bytes``."""
    return block_bytes + block_bytes // ARENA_SLACK + ARENA_SLACK * ALIGN


class OffloadedTensor(NamedTuple):
    """What a frame's autograd saves in place of an offloaded tensor."""

    call: "OffloadedCall"
    index: int


class OffloadedCall:
    """One block call's saved activations in host memory ([Note: offloaded blocks])."""

    __slots__ = ("owner", "position", "inputs", "nbytes", "_host", "_arena", "_pageable",
                 "_on_the_way", "_device", "_saved", "_copy_began",
                 "_downloaded", "_uploaded", "_compute", "_unpacks_left", "__weakref__")

    def __init__(self, owner: "BlockOffload", position: int, inputs: frozenset[int]) -> None:
        self.owner = owner
        self.position = position
        """The call's place in the forward (the plan's block position)."""
        self.inputs = inputs
        """Storages of the call's own tensor inputs, which stay where they are."""
        self.nbytes = 0
        """Bytes of the host copies (producer: ``pack``)."""
        self._host: list[torch.Tensor] = []
        """The saved tensors' host copies, in save order (producer: ``pack``)."""
        self._arena: Optional[HostArena | bool] = None
        """Where the host copies are carved from: the position's arena, False when it has none
        free (producer: the call's first ``pack``, from ``BlockOffload.arena_for``)."""
        self._pageable = False
        """Without an arena: the copies go to pageable host memory, the arena being still
        locked ([Note: host arenas and the first offloaded step]; producer: the first
        ``pack``)."""
        self._on_the_way: list[torch.Tensor] = []
        """The device tensors whose copies ``down`` may still be running, held so that their
        memory goes back to the compute stream only after it waited for those copies (producer:
        ``pack``; consumer: ``BlockOffload._wait_for_copies``, which drops them after the
        wait)."""
        self._device: Optional[list[torch.Tensor]] = None
        """Their uploads (producer: ``upload``; consumer: ``unpack``, which drops the list once
        each was unpacked)."""
        self._saved: Optional[torch.cuda.Event] = None
        self._copy_began: Optional[torch.cuda.Event] = None
        """On ``down``, after the wait for ``_saved``: where the call's copies begin (producer:
        the first ``pack``; consumer: ``BlockOffload._wait_for_copies``, which times them to
        ``_downloaded``)."""
        self._downloaded: Optional[torch.cuda.Event] = None
        """On ``down``, after the call's last copy so far: one event, recorded again by each
        ``pack`` (producer); every wait on it comes after the call's last pack (consumers: the
        later calls' throttle, the drain, ``upload``)."""
        self._uploaded: Optional[torch.cuda.Event] = None
        self._compute: Optional[torch.cuda.Stream] = None
        """The stream the upload's memory was allocated on (producer: ``upload``; consumer:
        ``__del__``)."""
        self._unpacks_left = 0

    def __del__(self) -> None:
        # A graph dropped after its upload began and before its backward: the compute stream
        # may reuse the upload's memory only once the copy into it has run.
        if self._uploaded is not None and self._compute is not None:
            self._compute.wait_event(self._uploaded)

    def pack(self, t: torch.Tensor) -> Any:
        """Send ``t`` to host memory, or keep it: an input of the call, a tensor not on the device,
        or a view that is not its whole storage (its base may live on; copying it would free
        nothing)."""
        storage = t.untyped_storage()
        if (t.device != self.owner.device or storage.data_ptr() in self.inputs
                or t.storage_offset() != 0 or t.numel() * t.element_size() != storage.nbytes()):
            return t
        owner = self.owner
        if self._arena is None:
            self._arena = owner.arena_for(self) or False
            self._pageable = not self._arena and owner.locking(self.position)
        nbytes = span_bytes(t)
        copy = self._arena.carve(t) if self._arena else None
        if copy is None:
            copy = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu",
                                       pin_memory=owner.down is not None and not self._pageable)
            if self._pageable:
                owner.unlocked_host_bytes += nbytes
            else:
                owner.unplanned_host_bytes += nbytes
        if owner.down is None:
            copy.copy_(t)
        else:
            if self._saved is None:
                owner.wait_for_previous(self)
                self._saved = torch.cuda.current_stream(owner.device).record_event()
                owner.down.wait_event(self._saved)
                self._copy_began = torch.cuda.Event(enable_timing=True)
                self._copy_began.record(owner.down)
                self._downloaded = torch.cuda.Event(enable_timing=True)
            # Only a copy into pageable memory holds the thread (until it ran): only it is timed.
            start = time.perf_counter() if self._pageable else None
            with torch.cuda.stream(owner.down):
                copy.copy_(t, non_blocking=True)
            if start is not None:
                owner.unlocked_copy_seconds += time.perf_counter() - start
            self._on_the_way.append(t)
            self._downloaded.record(owner.down)  # moved to this copy: every wait comes later
        self._host.append(copy)
        self._unpacks_left += 1
        self.nbytes += nbytes
        owner.moved_down += nbytes
        return OffloadedTensor(self, len(self._host) - 1)

    def upload(self) -> None:
        """Bring the tensors back to the device (once per backward)."""
        if self._device is not None or not self._host:
            return
        owner = self.owner
        if owner.up is None:
            self._device = [h.clone() for h in self._host]
        else:
            # On the compute stream (see the Note): allocated on ``up``, the uploads took
            # segments of their own and torch's allocator retried twice a step at qwen3-14b
            # (benches/results/onepath14.md).
            compute = torch.cuda.current_stream(owner.device)
            self._device = [torch.empty_strided(h.size(), h.stride(), dtype=h.dtype,
                                                device=owner.device) for h in self._host]
            owner.up.wait_stream(compute)
            owner.up.wait_event(self._downloaded)
            with torch.cuda.stream(owner.up):
                for d, h in zip(self._device, self._host):
                    d.copy_(h, non_blocking=True)
            self._uploaded = owner.up.record_event()
            self._compute = compute
        owner.moved_up += self.nbytes
        for observe in owner.upload_observers:
            observe()

    @staticmethod
    def unpack(saved: OffloadedTensor) -> torch.Tensor:
        call = saved.call
        owner = call.owner
        if call._device is None:
            owner.late_uploads += 1  # no block after it told ``reached``: uploaded on demand
            owner.reached(call.position)  # and the calls before it, as its own reach would
            call.upload()  # (a later forward's call may hold its position)
        t = call._device[saved.index]
        if call._uploaded is not None:  # the call's first unpack: later work queues after it
            owner.waits[CopyWait.UPLOAD].wait(torch.cuda.current_stream(owner.device),
                                              call._uploaded)
            call._uploaded = None
        call._unpacks_left -= 1
        if call._unpacks_left <= 0:
            # Every tensor is backward's now; a second backward (retain_graph) uploads again.
            call._unpacks_left = len(call._host)
            call._device = None
            call._uploaded = None
        return t


class BlockOffload:
    """The offloaded block calls of one model's frames ([Note: offloaded blocks])."""

    def __init__(self, device: torch.device) -> None:
        cuda = device.type == "cuda"
        if cuda and device.index is None:  # the arenas are built on a thread of their own
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.down = torch.cuda.Stream(device) if cuda else None
        """Copies to host memory (see the Note for each stream's and event's producer)."""
        self.up = torch.cuda.Stream(device) if cuda else None
        """Copies back to the device."""
        self.order: dict[int, int] = {}
        """id(block) -> its position in the forward, of every block (producer: the re-planner;
        consumers: ``start``, and the frames in backward, which tell ``reached``)."""
        self.offloaded: frozenset[int] = frozenset()
        """id(block) of the blocks whose calls are offloaded: those at the queue's positions
        (producer: ``plan``; consumer: ``start``)."""
        self.queue = NO_COPIES
        """When the copies run: the calls on their way at once, the block where the forward
        waits for the last, how far ahead backward uploads (producer: the re-planner: [Note:
        the copy queue] in recompute_plan.py)."""
        self.moved_down = 0
        """Bytes sent to host memory so far (producer: ``OffloadedCall.pack``)."""
        self.moved_up = 0
        """Bytes brought back so far (producer: ``OffloadedCall.upload``)."""
        self.upload_observers: list = []
        """Called as each call's upload is issued (producer: ``OffloadedCall.upload``; consumer:
        the step's progress, so that the streamed optimizer state's window uploads after them
        on the shared upward link: [Note: the step's window] in zbuf/offload_window.py)."""
        self.late_uploads = 0
        """Calls whose backward began before their upload did (producer:
        ``OffloadedCall.unpack``)."""
        self.waits = {wait: TimedWaits() for wait in CopyWait}
        """The compute stream's waits for the copies, by where it waits (producers:
        ``wait_for_previous``, the drain, ``OffloadedCall.unpack``; consumer:
        ``finish_forward``, which reads those the device has passed)."""
        self.exposed_ms = dict.fromkeys(CopyWait, 0.0)
        """Milliseconds the compute stream stood still in those waits, read so far."""
        self.copies = TimedWaits()
        """Each call's copies to host memory on ``down``, from its first to its last (producer:
        ``_wait_for_copies``; consumer: ``finish_forward``)."""
        self.copied_ms = 0.0
        """Milliseconds ``down`` spent on the calls' copies, read so far."""
        self.copied_bytes = 0
        """The bytes of the calls in ``copies``, read or not (producer: ``_wait_for_copies``)."""
        self.copied_calls = 0
        """Those calls."""
        self.forwards = 0
        """Forwards that offloaded a call (producer: ``start``)."""
        self._counted = False
        """This forward is in ``forwards`` (producer: ``start``; consumer: ``finish_forward``,
        which clears it)."""
        self._calls: weakref.WeakValueDictionary[int, OffloadedCall] = (
            weakref.WeakValueDictionary())
        """Position -> the latest forward's offloaded call there, while its graph lives
        (producer: ``start``; consumer: ``reached``)."""
        self._pending: collections.deque[OffloadedCall] = collections.deque()
        """The forward's offloaded calls whose copies no one waited for yet, oldest first
        (producer: ``wait_for_previous``; consumers: the later calls' ``wait_for_previous``,
        and ``forward_reaches`` or ``finish_forward`` at the queue's drain)."""
        self.block_bytes = 0
        """The plan's estimate of an offloaded call's bytes (producer: ``plan``)."""
        self.link: Optional[HostLink] = None
        """What the plan's queue came from (producer: ``plan``; consumer: ``report``)."""
        self.unplanned_host_bytes = 0
        """Bytes copied to host memory outside the arenas (producer: ``OffloadedCall.pack``):
        a call's tensors beyond its arena, or a second live call at one position."""
        self.link_probe: Optional[LinkSpeed] = None
        """The host link measured each way (producer: the re-planner's probe, the last one;
        consumer: ``report``), None where none ran."""
        self.declined_for_compile: Optional[dict[str, Any]] = None
        """The default's plan of offloaded blocks the re-plan declined, its frame's compile not
        paid for by the recompute it saves: blocks offloaded, modelled saving a step, the first
        step's time, the payback horizon, the blocks at each level above 0 ([Note: a re-plan's
        compile pays for itself] in block_replan.py; producer: the re-planner; consumer:
        ``report``)."""
        self.unlocked_host_bytes = 0
        """Bytes copied through pageable host memory, their arena still being page-locked
        (producer: ``OffloadedCall.pack``)."""
        self.unlocked_copy_seconds = 0.0
        """Seconds the Python thread waited for those copies (producer: ``OffloadedCall.pack``):
        a pageable copy waits for the compute stream to reach the block, then runs."""
        self.planned_in_seconds: Optional[float] = None
        """The re-plan's own wall time: the host link's probe, the agreements, the plan
        (producer: the re-planner; consumer: ``report``)."""
        self._planned_at = 0.0
        """When the last plan's arenas began locking, 0 before any plan (producer: ``plan``;
        consumers: ``report``, which times the last arena's locking from it, and
        ``lock_ahead``)."""
        self._arenas: dict[int, Future[HostArena]] = {}
        """Position -> the host arena of its offloaded calls, built on ``_pinning`` (producer:
        ``plan``; consumer: ``arena_for``)."""
        self._arena_bytes = 0
        """The size of each of ``_arenas`` (producer: ``plan``)."""
        self._holders: dict[int, weakref.ref[OffloadedCall]] = {}
        """Position -> the call whose host copies are in its arena now (producer and consumer:
        ``arena_for``)."""
        self._pinning: Optional[ThreadPoolExecutor] = None
        """The thread that builds the arenas, while the Python thread goes on (the re-plan's
        compile, the step's first blocks)."""
        self._ahead: list[Future[HostArena]] = []
        """Arenas locked before any plan, for the first plan's positions ([Note: arenas locked
        ahead]; producer: ``lock_ahead``; consumer: ``plan``, which takes what it needs and
        drops the rest)."""
        self._ahead_bytes = 0
        """The size of each of ``_ahead`` (producer: ``lock_ahead``)."""
        self._ahead_at = 0.0
        """When ``lock_ahead`` started their locking (consumer: ``plan``)."""
        self.locked_ahead = 0
        """Arenas ``lock_ahead`` asked for (producer: ``lock_ahead``)."""
        self.taken_ahead = 0
        """Of them, the arenas a plan took (producer: ``plan``)."""

    def plan(self, order: dict[int, int], queue: CopyQueue, block_bytes: int = 0,
             link: Optional[HostLink] = None) -> None:
        """Offload the calls at ``queue``'s positions of ``order`` (``block_bytes`` each, the
        plan's estimate, over ``link``), their copies run as ``queue`` says; their host arenas
        start being page-locked now ([Note: host arenas and the first offloaded step])."""
        self.order, self.queue = order, queue
        self.offloaded = frozenset(b for b, p in order.items() if p in queue.positions)
        self.block_bytes, self.link = block_bytes, link
        nbytes = arena_bytes(block_bytes)
        positions = list(queue.positions) if block_bytes > 0 else []
        # The arenas of positions still offloaded are kept, unless the calls' bytes changed.
        arenas = self._arenas if nbytes == self._arena_bytes else {}
        self._arena_bytes = nbytes
        self._planned_at = time.perf_counter()
        # Arenas locked ahead serve, in order, where they are as large (a call carves what it
        # needs); the rest are cancelled (not started: never locked) or dropped once locked.
        ahead, self._ahead = self._ahead, []
        fits = self._ahead_bytes >= nbytes
        self._arenas, took = {}, 0
        for p in positions:
            arena = arenas.get(p)
            if arena is None and fits and ahead:
                arena, took = ahead.pop(0), took + 1
            self._arenas[p] = arena or self._pin(nbytes)
        for future in ahead:
            future.cancel()
        if took:  # this plan's arenas began locking before it
            self.taken_ahead += took
            self._planned_at = self._ahead_at
        self._holders = {p: h for p, h in self._holders.items() if p in self._arenas}

    def lock_ahead(self, block_bytes: int, count: int) -> None:
        """Start page-locking ``count`` arenas for calls of ``block_bytes`` now, before any plan
        ([Note: arenas locked ahead]); once only, and only before the first plan."""
        if self.locked_ahead or self._planned_at or count <= 0 or block_bytes <= 0:
            return
        self.locked_ahead = count
        self._ahead_at = time.perf_counter()
        self._ahead_bytes = arena_bytes(block_bytes)
        self._ahead = [self._pin(self._ahead_bytes) for _ in range(count)]

    def _pin(self, nbytes: int) -> Future[HostArena]:
        """An arena of ``nbytes``, page-locked on the arenas' thread."""
        if self._pinning is None:
            self._pinning = ThreadPoolExecutor(PIN_THREADS, thread_name_prefix="zbuf-pin")
            weakref.finalize(self, self._pinning.shutdown, wait=False)
        return self._pinning.submit(HostArena, nbytes, self.device,
                                    tuple(s for s in (self.down, self.up) if s),
                                    touch_threads_per_arena(host_core_share()))

    def arena_for(self, call: OffloadedCall) -> Optional[HostArena]:
        """The arena ``call``'s host copies go to: its position's, unless it is still being
        locked or another live call's copies are in it (two forwards before a backward)."""
        pinning = self._arenas.get(call.position)
        if pinning is None or not pinning.done():
            return None
        arena = pinning.result()
        holder = self._holders.get(call.position)
        if holder is not None and holder() not in (None, call):
            return None
        self._holders[call.position] = weakref.ref(call)
        arena.reset()
        return arena

    def locking(self, position: int) -> bool:
        """Whether the arena of ``position`` is still being page-locked."""
        pinning = self._arenas.get(position)
        return pinning is not None and not pinning.done()

    def start(self, block: int, args: tuple, kwargs: dict) -> Optional[OffloadedCall]:
        """The call of ``block`` now starting its forward with ``args`` and ``kwargs``, if it is
        offloaded."""
        if block not in self.offloaded:
            return None
        position = self.order[block]
        # Hugging Face layers take the rotary tables as a keyword (a tuple): every layer's.
        inputs = frozenset(t.untyped_storage().data_ptr()
                           for t in torch.utils._pytree.tree_leaves((args, kwargs))
                           if isinstance(t, torch.Tensor))
        call = OffloadedCall(self, position, inputs)
        if not self._counted:
            self.forwards, self._counted = self.forwards + 1, True
        self._calls[position] = call
        return call

    def _wait_for_copies(self, calls: list[OffloadedCall], where: CopyWait) -> None:
        """The compute stream waits for the copies of ``calls`` to the host (the ``down`` stream
        runs them in order: the last one issued covers them all); then their device tensors go
        back to the compute stream's cache, in its order."""
        last = next((c._downloaded for c in reversed(calls) if c._downloaded is not None), None)
        if last is not None:
            self.waits[where].wait(torch.cuda.current_stream(self.device), last)
        for call in calls:
            call._on_the_way.clear()
            if call._copy_began is not None and call._downloaded is not None:
                self.copies.add(call._copy_began, call._downloaded)
                self.copied_bytes += call.nbytes
                self.copied_calls += 1
                call._copy_began = None

    def _drain(self) -> None:
        """The compute stream waits for every pending call's copies."""
        self._wait_for_copies(list(self._pending), CopyWait.DRAIN)
        self._pending.clear()

    def wait_for_previous(self, call: OffloadedCall) -> None:
        """The compute stream waits for the copies of the call ``in_flight - 1`` before
        ``call``, and of every call before it: at most ``in_flight`` calls' bytes on their way to
        the host."""
        waited = []
        while len(self._pending) > self.queue.in_flight - 2:
            waited.append(self._pending.popleft())
        self._wait_for_copies(waited, CopyWait.THROTTLE)
        self._pending.append(call)

    def forward_reaches(self, block: int) -> None:
        """``block``'s forward begins (an offloaded plan is in force): at the queue's drain the
        compute stream waits for the forward's last copies, so that no offloaded bytes are on
        the device after it ([Note: offloaded under the step's own peak] in block_replan.py)."""
        position = self.order.get(block)
        if position is not None and position >= self.queue.drained_at:
            self._drain()

    def finish_forward(self) -> None:
        """The model's output: where the queue drains if no block did ([Note: the copy queue]
        in recompute_plan.py)."""
        self._drain()
        self._counted = False
        self._read(done_only=True)

    def _read(self, *, done_only: bool) -> None:
        """Add the waits and copies read now to the totals: those the device has passed with
        ``done_only``, else all (waiting for the device)."""
        for where, waits in self.waits.items():
            if waits:
                self.exposed_ms[where] += waits.read_ms(done_only=done_only)
        self.copied_ms += self.copies.read_ms(done_only=done_only)

    def reached_block(self, block: int) -> None:
        """Backward begins ``block``'s backward (``reached``)."""
        position = self.order.get(block)
        if position is not None and self.offloaded:
            self.reached(position)

    def reached(self, position: int) -> None:
        """Backward begins the block at ``position``: upload the offloaded calls at most
        ``upload_ahead`` blocks before it."""
        for p in range(position - self.queue.upload_ahead, position + 1):
            call = self._calls.get(p)
            if call is not None:
                call.upload()

    def report(self) -> dict[str, Any]:
        self._read(done_only=False)

        def per_step(ms: float) -> Optional[float]:
            return ms / self.forwards if self.forwards else None

        arenas = [f.result() for f in self._arenas.values() if f.done() and not f.exception()]
        return {"blocks": sorted(self.order[b] for b in self.offloaded),
                "in_flight": self.queue.in_flight, "drained_at": self.queue.drained_at,
                "drained_at_output": bool(self.order) and self.queue.drained_at == len(
                    self.order),
                "upload_ahead": self.queue.upload_ahead, "forwards": self.forwards,
                "moved_down_bytes": self.moved_down, "moved_up_bytes": self.moved_up,
                "late_uploads": self.late_uploads,
                "planned_block_bytes": self.block_bytes,
                "host_link_bytes_per_second": (None if self.link is None
                                               else self.link.bytes_per_second),
                "host_link_probe": (None if self.link_probe is None
                                    else self.link_probe._asdict()),
                "planned_copy_ms": (None if self.link is None
                                    else 1e3 * self.link.copy_seconds(self.block_bytes)),
                "planned_block_forward_ms": (None if self.link is None
                                             else 1e3 * self.link.forward_seconds),
                "planned_tail_forwards": None if self.link is None else self.link.tail_forwards,
                "host_arena_bytes": sum(a.nbytes for a in arenas),
                "lock_seconds": sum(a.lock_seconds for a in arenas),
                "lock_touch_seconds": sum(a.touch_seconds for a in arenas),
                "lock_register_seconds": sum(a.register_seconds for a in arenas),
                # From the plan (or the locking ahead of it) to its last arena locked (the
                # arenas kept from an earlier plan count from this one).
                "arenas_locked_after_s": max((max(0.0, a.locked_at - self._planned_at)
                                              for a in arenas), default=None),
                "planned_in_s": self.planned_in_seconds,
                "arenas_locked_ahead": self.locked_ahead,
                "arenas_taken_ahead": self.taken_ahead,
                "unlocked_host_bytes": self.unlocked_host_bytes,
                "unlocked_copy_seconds": self.unlocked_copy_seconds,
                "unplanned_host_bytes": self.unplanned_host_bytes,
                "exposed_ms_per_step": per_step(sum(self.exposed_ms.values())),
                "exposed_ms_per_step_by_wait": {w.value: per_step(ms)
                                                for w, ms in self.exposed_ms.items()},
                # What the copy queue's model took (planned_copy_ms, at LINK_SHARE of the
                # measured link) against what the device ran.
                "measured_copy_ms": (self.copied_ms / self.copied_calls if self.copied_calls
                                     else None),
                "measured_copy_bytes_per_second": (1e3 * self.copied_bytes / self.copied_ms
                                                   if self.copied_ms > 0 else None),
                "declined_for_compile": self.declined_for_compile}
