"""The recompute planner: which candidate regions keep their activations, and how many.

A pure function over ``RegionSpec`` lists (no FX, no torch), like the gather planner
(schedule.py), so it is tested on random inputs. recompute.py reads the specs off the joint graph
and checks the plan against the partitioned graphs ([Note: budgeted recompute] there).

[Note: recompute plan]
Every candidate region (a checkpointed block) offers levels: level 0 recomputes the region in
backward as the user wrote it; higher levels keep more of its activations (``extra_bytes`` more,
held from the region's forward to its backward) and re-run less of it (``recompute_seconds``
less). The plan picks one level per region so that ``base_bytes + sum(extra_bytes)`` stays
within the budget, and spends the budget where it saves the most recompute time per byte:
1. levels that cost bytes but save no time, or lie below the line between their neighbours
   (the upper convex hull of (bytes, seconds saved)), are never chosen; the steps between the
   remaining levels save less time per byte the higher they go;
2. every step of every region, sorted by seconds saved per byte (highest first), is taken when
   the region stands at the step's lower level and its bytes fit; otherwise it is skipped;
3. what is left is filled with any upgrade that still fits and saves time (a level step 1
   dropped, e.g. "selective" when the room is too small to keep a whole block), best per byte
   first, until none fits.
So activations are kept while they fit, and what is recomputed is the cheapest to recompute per
byte. Properties (tests/test_recompute_plan.py): the modelled peak never exceeds the budget (a
budget below ``base_bytes`` is raised to it, like the gather planner's floor); when the plan
ends, no upgrade that saves time fits in what is left; a larger budget never recomputes more
(tested on random regions; for step 2 alone it follows: a step skipped for lack of room at
budget B and taken at B' > B saves more than everything B took after it, which fit into less
room at a lower rate). Ties go to later regions first: a region late in the forward is the
first that backward needs, so keeping it removes the recompute that runs at the step's memory
peak, the start of backward.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

__all__ = ["RegionLevel", "RegionSpec", "RecomputePlan", "HostLink", "CopyQueue", "NO_COPIES",
           "plan_recompute", "plan_block_levels", "copy_queue", "hull_steps", "LINK_SHARE",
           "UPLOAD_FORWARDS", "queue_speed"]


@dataclass(frozen=True)
class RegionLevel:
    """One way to treat a region in backward."""

    name: str
    """``"recompute"`` (level 0: as the user checkpointed it), ``"selective"`` (matmul and
    attention outputs kept, the rest recomputed) or ``"keep"`` (nothing recomputed)."""
    extra_bytes: int
    """Activation bytes kept for backward beyond level 0 (0 at level 0)."""
    recompute_seconds: float
    """Modelled time backward spends re-running the region's forward at this level."""
    recompute_flops: float = 0.0
    """Matmul and attention FLOPs backward re-runs at this level (reported, not planned on)."""


@dataclass(frozen=True)
class RegionSpec:
    """A candidate region and its levels."""

    key: str
    """Rank-invariant identity (the checkpoint region's id), for reports."""
    position: int
    """Order of the region in the forward (ties in the plan go to later regions)."""
    levels: tuple[RegionLevel, ...]

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError(f"region {self.key!r} has no levels")
        if self.levels[0].extra_bytes != 0:
            raise ValueError(f"region {self.key!r}: level 0 must keep 0 extra bytes, got "
                             f"{self.levels[0].extra_bytes}")
        for lv in self.levels:
            if lv.extra_bytes < 0 or lv.recompute_seconds < 0:
                raise ValueError(f"region {self.key!r} level {lv.name!r}: bytes and seconds "
                                 f"must be >= 0")


class CopyQueue(NamedTuple):
    """When the offloaded blocks' copies run ([Note: the copy queue]); positions are block calls
    in forward order."""

    positions: tuple[int, ...]
    """The offloaded calls."""
    in_flight: int
    """Offloaded calls whose bytes may be on the device at once: a call's first save waits for
    the copies of the call ``in_flight - 1`` before it."""
    drained_at: int
    """The forward waits for the last call's copies as this block begins, or, where it equals
    the number of blocks, at the model's output (no offloaded bytes on the device after it)."""
    upload_ahead: int
    """In backward, a call's upload starts as the block this many after it begins its
    backward."""


NO_COPIES = CopyQueue((), 2, 0, 1)
"""The queue of a plan that offloads nothing."""


@dataclass(frozen=True)
class RecomputePlan:
    levels: tuple[int, ...]
    """Chosen level index per region (same order as the specs)."""
    requested_budget_bytes: int
    budget_bytes: int
    """The budget planned against: the request, raised to ``base_bytes`` if it was below."""
    base_bytes: int
    """Activation peak with every region at level 0 (the smallest this plan can do)."""
    kept_bytes: int
    """Sum of the chosen levels' ``extra_bytes``."""
    recompute_seconds: float
    """Modelled recompute time of the chosen levels."""
    saved_seconds: float
    """Modelled recompute time saved against every region at level 0."""
    planning_seconds: float = field(default=0.0, compare=False)
    copy_queue: CopyQueue = NO_COPIES
    """The offloaded blocks and when their copies run."""
    offload_block_bytes: int = 0
    """Bytes each offloaded block moves each way: everything its level saves, level 0's own
    saves included (a user's selective policy's: the offloaded call copies them too); the host
    memory each of its calls takes and what its copy's time is planned on."""
    offload_extra_bytes: int = 0
    """Device bytes each offloaded block call holds on its way beyond level 0: its level's
    ``extra_bytes`` (level 0 holds its own saves until backward anyway)."""
    host_link: Optional["HostLink"] = None
    """What the offloaded blocks' copies were planned with (None: none offloaded)."""
    reserve_apart: bool = False
    """The reserve was fitted apart from the step's peak, which it never meets ([Note:
    offloaded under the step's own peak] in block_replan.py), so it is not in
    ``modelled_peak_bytes``."""

    @property
    def offloaded(self) -> tuple[int, ...]:
        """Blocks (by position) at a level above 0 whose kept activations wait in host memory
        from their forward to their backward ([Note: offloaded blocks]); their bytes are not in
        ``kept_bytes``."""
        return self.copy_queue.positions

    @property
    def offload_reserve_bytes(self) -> int:
        """Device bytes the offloaded blocks hold at once at most, on their way to and from the
        host (``CopyQueue.in_flight`` blocks' worth, none when none is offloaded); in the budget
        beside ``kept_bytes`` unless apart."""
        return self.copy_queue.in_flight * self.offload_extra_bytes

    @property
    def modelled_peak_bytes(self) -> int:
        reserve = 0 if self.reserve_apart else self.offload_reserve_bytes
        return self.base_bytes + self.kept_bytes + reserve


def hull_steps(spec: RegionSpec) -> list[tuple[int, int, int, float]]:
    """The region's upgrade steps along the upper convex hull of (extra bytes, seconds saved):
    ``(from level, to level, bytes, seconds saved)``, in order, each saving less per byte than
    the one before ([Note: recompute plan], 1)."""
    base = spec.levels[0].recompute_seconds
    points = sorted(((lv.extra_bytes, base - lv.recompute_seconds, i)
                     for i, lv in enumerate(spec.levels)), key=lambda p: (p[0], -p[1], p[2]))
    hull: list[tuple[int, float, int]] = [(0, 0.0, 0)]
    for b, s, i in points:
        if i == 0 or s <= hull[-1][1]:  # no more time saved for at least as many bytes
            continue
        # Drop hull points below the line from the one before them to this one.
        while len(hull) >= 2:
            (b0, s0, _), (b1, s1, _) = hull[-2], hull[-1]
            if (s1 - s0) * (b - b0) <= (s - s0) * (b1 - b0):
                hull.pop()
            else:
                break
        hull.append((b, s, i))
    return [(hull[k][2], hull[k + 1][2], hull[k + 1][0] - hull[k][0], hull[k + 1][1] - hull[k][1])
            for k in range(len(hull) - 1)]


def plan_recompute(specs: list[RegionSpec] | tuple[RegionSpec, ...], base_bytes: int,
                   budget_bytes: int) -> RecomputePlan:
    """Choose a level per region within ``budget_bytes`` ([Note: recompute plan])."""
    if not isinstance(budget_bytes, int) or isinstance(budget_bytes, bool) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    if not isinstance(base_bytes, int) or base_bytes < 0:
        raise ValueError(f"base_bytes must be a non-negative int, got {base_bytes!r}")
    t0 = time.perf_counter()
    budget = max(budget_bytes, base_bytes)
    steps = []
    for r, spec in enumerate(specs):
        for lo, hi, nbytes, saved in hull_steps(spec):
            rate = float("inf") if nbytes == 0 else saved / nbytes
            steps.append((-rate, -spec.position, r, hi, lo, nbytes))
    steps.sort()
    level = [0] * len(specs)
    room = budget - base_bytes
    for _, _, r, hi, lo, nbytes in steps:
        if level[r] == lo and nbytes <= room:
            level[r] = hi
            room -= nbytes
    # Fill what is left with any upgrade that saves time, best per byte first, until none fits
    # ([Note: recompute plan], 3).
    while True:
        fill = []
        for r, spec in enumerate(specs):
            cur = spec.levels[level[r]]
            for hi, lv in enumerate(spec.levels):
                gain = cur.recompute_seconds - lv.recompute_seconds
                nbytes = lv.extra_bytes - cur.extra_bytes
                if gain > 0 and nbytes <= room:
                    rate = float("inf") if nbytes <= 0 else gain / nbytes
                    fill.append((-rate, -spec.position, r, hi, level[r], max(nbytes, 0)))
        if not fill:
            break
        fill.sort()
        for _, _, r, hi, lo, nbytes in fill:
            if level[r] == lo and nbytes <= room:
                level[r] = hi
                room -= nbytes
    kept = sum(spec.levels[lv].extra_bytes for spec, lv in zip(specs, level))
    seconds = sum(spec.levels[lv].recompute_seconds for spec, lv in zip(specs, level))
    base_seconds = sum(spec.levels[0].recompute_seconds for spec in specs)
    assert base_bytes + kept <= budget, f"zbuf recompute planner bug: {base_bytes + kept} > {budget}"
    return RecomputePlan(
        levels=tuple(level), requested_budget_bytes=budget_bytes, budget_bytes=budget,
        base_bytes=base_bytes, kept_bytes=kept, recompute_seconds=seconds,
        saved_seconds=base_seconds - seconds, planning_seconds=time.perf_counter() - t0)


LINK_SHARE = 0.95
"""The share of the host link's measured speed a copy is modelled at ([Note: the copy queue])."""


UPLOAD_FORWARDS = 2
"""Block forwards an upload runs under at least: a block's backward, whose matmuls' flops are
twice its forward's ([Note: the copy queue])."""


def queue_speed(down_bytes_per_second: float, up_bytes_per_second: float) -> float:
    """The link speed the copy queue is modelled at ([Note: the copy queue]): the forward's
    copies down, each under one block forward, unless the uploads, each under
    ``UPLOAD_FORWARDS`` of them, are slower still."""
    return min(down_bytes_per_second, UPLOAD_FORWARDS * up_bytes_per_second)


class HostLink(NamedTuple):
    """What moving blocks' kept activations through host memory costs ([Note: offloaded
    blocks]); every field is rank-invariant."""

    bytes_per_second: float
    """The host link's speed as the copy queue counts it (``queue_speed`` of the two directions
    measured: [Note: the measured host link] in zbuf/host_link.py)."""
    forward_seconds: float
    """One block's forward, the compute a copy runs under (measured: [Note: the measured block
    forward] in block_clock.py)."""
    host_bytes: int
    """Host memory the offloaded blocks may hold together."""
    tail_forwards: float = 1.0
    """The model's forward from its last block's start to its output (the last block, then what
    the model runs after it: the final norm and the output projection), in block forwards,
    measured with them ([Note: the measured block forward] in block_clock.py)."""

    def copy_seconds(self, nbytes: int) -> float:
        """A copy of ``nbytes`` one way, as the copy queue models it: at ``LINK_SHARE`` of the
        link's speed ([Note: the copy queue]); endless over a link that measured nothing."""
        if self.bytes_per_second <= 0:
            return math.inf
        return nbytes / (LINK_SHARE * self.bytes_per_second)


def plan_block_levels(levels: tuple[RegionLevel, ...], blocks: int, room_bytes: int,
                      link: Optional[HostLink] = None,
                      reserve_room_bytes: Optional[int] = None,
                      tail_room_bytes: Optional[int] = None,
                      moved_beside_bytes: int = 0) -> RecomputePlan:
    """A level for each of ``blocks`` block calls with the same ``levels``, in forward order,
    keeping at most ``room_bytes`` beyond level 0 ([Note: block levels] in block_replan.py, 2),
    and, given a ``link``, the blocks whose kept activations wait in host memory ([Note:
    offloaded blocks]) when that saves more recompute than keeping them on the device does:
    at the level above 0 that saves the most (its bytes decide how many calls the link's queue
    takes, [Note: the copy queue]; a tie goes to the level that moves fewer bytes, then to fewer
    calls on their way).
    ``reserve_room_bytes``: where the offloaded blocks' reserve is not live at the step's peak,
    the room it has there ([Note: offloaded under the step's own peak] in block_replan.py), and
    ``room_bytes`` is the kept blocks' alone; None: the reserve shares ``room_bytes``.
    ``tail_room_bytes``: with ``reserve_room_bytes``, the reserve's room if it stays live through
    the last block to the model's output, where the queue may then drain (None: it may not).
    ``moved_beside_bytes``: what each block call saves at level 0 (the user's own saves), which
    an offloaded call moves to the host beside its level's ``extra_bytes``."""
    on_device = _device_levels(levels, blocks, room_bytes)
    if link is None or blocks == 0:
        return on_device
    best = on_device
    for level in range(1, len(levels)):
        plan = _offloaded_at(level, levels, blocks, room_bytes, link, reserve_room_bytes,
                             tail_room_bytes, on_device, moved_beside_bytes)
        if plan is not None and plan.saved_seconds > best.saved_seconds:
            best = plan
    return best


# [Note: the copy queue]
# An offloaded block call's kept activations go to host memory over the host link while the
# blocks after it compute ([Note: offloaded blocks] in block_offload.py). The copies run one
# after another on one stream, so which calls can be offloaded without the compute stream ever
# waiting is a queue, modelled in block forwards (block ``p``'s forward runs from ``p`` to
# ``p + 1``; one copy takes ``copies`` of them):
# 1. a call's bytes are ready as its block's forward ends; its copy starts then, or when the
#    copy before it ends, whichever is later;
# 2. with ``in_flight`` calls on their way at most, a call's first save waits for the copies
#    of the call ``in_flight - 1`` before it: a call is offloaded only if those have ended;
# 3. the drain, the first block that begins after the last copy ends (and after the last
#    call), is where the forward waits for them all; it must be a block of the forward, so no
#    offloaded bytes meet the step's peak after the last block ([Note: offloaded under the
#    step's own peak] in block_replan.py), unless the reserve fits under that peak through
#    the last block and the model's own ops after it too (``tail``): then the drain may be the
#    model's output, ``tail`` block forwards after the last block begins (3.5 at qwen3-14b
#    on an H200, the output projection's matmul most of it: one or two copies more,
#    benches/results/onepath14.md).
# ``copy_queue`` takes the calls greedily from the first, then shifts them as late as the
# drain allows (later calls are backward's first, and the model does not change when
# shifted). The last block is never offloaded: its backward comes first, with no block's
# backward before it for its upload to run under.
# With two calls on their way a copy of 1.7 forwards offloads every other block and leaves the
# link idle 15 % of the time; with three the link runs without a gap, taking a block
# in 1.7 on average: at qwen3-14b on an H200 (a 31.1 ms copy, an 18.05 ms forward), 22 blocks
# where two offloaded 19 (benches/results/onepath14.md). The plan tries both (``IN_FLIGHT``): a
# third call costs one more block's bytes of reserve. The plan the H200 ran before this model
# drained one block too early for its last copy: 12.5 ms a step exposed.
# Backward needs no model of its own: a call's upload starts ``upload_ahead`` blocks before its
# block's backward, each block's backward at least twice its forward (its matmuls' flops), and
# the uploads ask for at most one forward's worth of link per block (the forward's rate), so
# the link's upward direction may run at half the downward's (``queue_speed``: a slower one
# slows the model's link to twice its speed); the plan only checks that no ``upload_ahead + 1``
# blocks in a row hold more than ``in_flight`` offloaded calls, the device bytes the uploads
# wait in.
# With three calls on their way the queue runs the link without a gap from the first call to the
# drain, so the plan has no slack of its own: a copy a few percent slower than modelled is
# exposed at every throttle and at the drain. The model's speed is one probe's fastest copy
# ([Note: the measured host link] in zbuf/host_link.py), and a call's copies are several tensors
# of many sizes. So a copy is modelled at ``LINK_SHARE`` of the link's speed. At qwen3-14b on an
# H100 (benches/results/onepath14.md) the link measured 53.0 GB/s, 22 blocks were offloaded and
# 0.21 ms a step were exposed; measured at 55.0 GB/s in a later call (whose throttle also waited
# for every released call's copies, [Note: offloaded blocks] in block_offload.py), the plan took
# a 23rd block and 14.3 ms a step were exposed.


IN_FLIGHT = (2, 3)
"""The calls on their way the planner tries ([Note: the copy queue]): a third lets the link run
without a gap where one copy takes a fraction more than a whole number of block forwards."""


def copy_queue(copies: float, candidates: int, blocks: int, in_flight: int,
               most: int, tail: Optional[float] = None) -> Optional[CopyQueue]:
    """The most offloaded calls among the first ``candidates`` of ``blocks`` (at most ``most``)
    whose copies, ``copies`` block forwards each, never make the compute stream wait with
    ``in_flight`` calls on their way ([Note: the copy queue]); None if none fits. ``tail``: the
    block forwards from the last block's start to the model's output, where the queue may
    drain (None: it drains at a block)."""
    last = min(candidates, blocks - 1) - 1  # the last block's upload has nothing to hide under
    # A copy longer than the whole forward and its tail drains nowhere; past that bound the sums
    # below would overflow (a copy of 1e308 forwards is finite).
    if last < 0 or most <= 0 or not copies <= blocks + (tail or 0.0):
        return None
    output = -math.inf if tail is None else blocks - 1 + tail  # when the model's output comes

    def drain(last_call: int, last_end: float) -> Optional[int]:
        """Where the forward waits for copies that end at ``last_end``: a block, the output
        (``blocks``), or None if neither comes after them."""
        at = max(last_call + 1, math.ceil(last_end - 1e-9))
        if at <= blocks - 1:
            return at
        return blocks if last_end <= output + 1e-9 else None

    positions: list[int] = []
    ends: list[float] = []
    for p in range(last + 1):
        if len(positions) == most:
            break
        waited = len(positions) - (in_flight - 1)
        if waited >= 0 and ends[waited] > p + 1:
            continue  # its first save would wait for that call's copies
        positions.append(p)
        ends.append(max(p + 1.0, ends[-1] if ends else 0.0) + copies)
    while positions and drain(positions[-1], ends[-1]) is None:
        positions.pop()
        ends.pop()
    if not positions:
        return None
    # Later calls are backward's first ([Note: recompute plan]); the model is the same shifted.
    shift = last - positions[-1]
    while (drained_at := drain(positions[-1] + shift, ends[-1] + shift)) is None:
        shift -= 1
    positions = [p + shift for p in positions]
    # An upload has ``upload_ahead`` blocks' backward to run under, each at least twice that
    # block's forward (its matmuls' flops), while at most ``in_flight`` uploads wait.
    def crowded(ahead: int) -> bool:  # more than ``in_flight`` calls in ``ahead + 1`` blocks
        return any(bisect.bisect_right(positions, p + ahead) - i > in_flight
                   for i, p in enumerate(positions))

    needed = max(1, math.ceil(copies / 2 - 1e-9))
    ahead = max(needed, math.ceil(copies - 1e-9))
    while ahead > needed and crowded(ahead):
        ahead -= 1
    if crowded(ahead):
        return None
    return CopyQueue(tuple(positions), in_flight, drained_at, ahead)


def _offloaded_at(level: int, levels: tuple[RegionLevel, ...], blocks: int, room_bytes: int,
                  link: HostLink, reserve_room_bytes: Optional[int],
                  tail_room_bytes: Optional[int],
                  on_device: RecomputePlan,
                  moved_beside_bytes: int = 0) -> Optional[RecomputePlan]:
    """The plan that offloads blocks at ``level``, or None if none saves time; each call moves
    ``moved_beside_bytes`` (level 0's saves) beside the level's extra bytes."""
    extra_bytes = levels[level].extra_bytes
    if extra_bytes <= 0:
        return None
    block_bytes = extra_bytes + moved_beside_bytes
    apart = reserve_room_bytes is not None
    copy_seconds = link.copy_seconds(block_bytes)
    copies = copy_seconds / link.forward_seconds if link.forward_seconds > 0 else math.inf
    gain_each = levels[0].recompute_seconds - levels[level].recompute_seconds
    best: Optional[RecomputePlan] = None
    for in_flight in IN_FLIGHT:
        reserve = in_flight * extra_bytes
        if (reserve_room_bytes if apart else room_bytes) < reserve:
            break
        beside = on_device if apart else _device_levels(levels, blocks, room_bytes - reserve)
        # Apart, the reserve may stay to the model's output where it fits there too; sharing
        # the room, it is in the budget at the step's peak anyway.
        tail = (link.tail_forwards if not apart or (tail_room_bytes or 0) >= reserve
                else None)
        # The blocks left at level 0 are the first ones (the levels ascend).
        queue = copy_queue(copies, beside.levels.count(0), blocks, in_flight,
                           link.host_bytes // block_bytes, tail)
        if queue is None:
            continue
        gain = len(queue.positions) * gain_each
        if beside.saved_seconds + gain <= max(on_device.saved_seconds, (
                best.saved_seconds if best is not None else -math.inf)):
            continue
        chosen = list(beside.levels)
        for b in queue.positions:
            chosen[b] = level
        best = dataclasses.replace(
            beside, levels=tuple(chosen), recompute_seconds=beside.recompute_seconds - gain,
            saved_seconds=beside.saved_seconds + gain, copy_queue=queue,
            offload_block_bytes=block_bytes, offload_extra_bytes=extra_bytes, host_link=link,
            reserve_apart=apart, requested_budget_bytes=max(1, room_bytes),
            budget_bytes=max(1, room_bytes))
    return best


def _device_levels(levels: tuple[RegionLevel, ...], blocks: int,
                   room_bytes: int) -> RecomputePlan:
    specs = [RegionSpec(f"block {i}", i, levels) for i in range(blocks)]
    plan = plan_recompute(specs, 0, max(1, room_bytes))
    # The blocks are alike, so any order of the chosen levels keeps as many bytes and recomputes
    # as long: ascending, later blocks keep at least as much as earlier ones (backward reaches
    # them first, at the step's peak), whatever order the planner's fill took them in.
    return dataclasses.replace(plan, levels=tuple(sorted(plan.levels)))
