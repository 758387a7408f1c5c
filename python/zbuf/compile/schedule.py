"""The gather planner: where each all-gather starts, waits and is released.

A pure function over ``GraphSummary`` (graph_model.py): no FX, no torch, so it is tested on
random DAGs and timed on synthetic 14B-sized graphs.

[Note: rank-invariant schedule]
Collectives must be issued in the same order on every rank. The planner is deterministic (every
sort has a total key, no set or id ordering, no clocks) and its inputs (graph order, sizes from
``meta["val"]``, the cost model constants, the agreed budget) are the same on every rank, so
every rank computes the same schedule. fingerprint.py checks that this held at run time.

[Note: live gathered bytes]
A gathered buffer is taken from the pool at its fetch's start slot and returned right after the
last use of its segment (or never, inside this graph, when it escapes as a saved tensor). So a
member is live at nodes ``start .. last_use`` inclusive, and the profile is the sum of those
intervals. The planner keeps ``profile[i] <= budget`` at every node by construction and builds the
profile in four steps, each only adding bytes where the budget allows:
1. minimum: every gather live only at the nodes that read it (re-gather between uses);
2. merge: keep a gather alive across a gap between two uses instead of re-gathering (short
   gaps first), which saves a collective;
3. coalesce: one collective for adjacent small segments of the same block, members live from
   the group's first use;
4. prefetch: move each fetch's start earlier until the compute before its first use covers the
   estimated communication time; starts keep the order of first uses, so the issue order is the
   order of waits.

[Note: prefetch order]
Starts keep the order of waits (collectives complete in issue order on one NCCL stream), so a
fetch can start no earlier than the one before it. Placing each start only as early as its own
need left a large fetch pinned behind a small one that needed no prefetch (qwen3-8b: an MLP
gather of 96 MiB covered by 0.27 ms of compute for 1.04 ms of estimated communication, behind a
norm weight's gather of a few KiB): on 2x H200 those gathers ran fully exposed. So every fetch's
target is the earliest of its own and all later fetches' targets (a suffix minimum), and the
budget, applied in wait order, only ever moves a start later.
The link is serial too: two 1 ms gathers read by one node, each started 1 ms ahead, leave the
second 1 ms late. So targets are placed from the last fetch back, each finishing by its wait and
by the time the next one must begin ([Note: modelled exposure] measures what is left exposed).

[Note: prefetch deadline]
The time the next fetch must begin is a point on the compute timeline, inside some node; its
start is issued at the slot before that node. Taking the slot's start as the earlier fetch's
deadline pushes that fetch back by up to a whole node, and the one
before it again: where a block is one node (a nested compile region, an ``invoke_subgraph``) each
fetch of a block moved every earlier fetch back a whole block. On qwen3-14b as rank 0 of 8,
258 of 323 fetches started in the first slot and 21.2 GiB of the pool were live at once, against
2.1 GiB at the same modelled exposure with the deadline at the time the next fetch begins
(``begin``), which is what the serial link needs and no earlier. Prefetch so stops as soon as
the modelled exposure is zero: a start is never earlier than the latest one that hides it.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from .graph_model import GraphSummary
from .options import CompileOptions

__all__ = ["Segment", "Fetch", "Schedule", "plan_schedule", "live_gathered_bytes", "buffer_counts",
           "exposed_seconds"]


class Segment(NamedTuple):
    """A run of uses of one gather served by one gathered buffer."""

    gather: int
    """Index into ``GraphSummary.gathers``."""
    uses: tuple[int, ...]
    release_after: int | None
    """Position of the last use; the release goes right after it. ``None``: escapes the graph."""


class Fetch(NamedTuple):
    """One collective: a single gather, or several coalesced ones of the same block."""

    members: tuple[Segment, ...]
    start: int
    """Slot of the collective's start (before node ``start``)."""
    wait: int
    """Slot of the wait: the first use of any member."""
    nbytes: int


@dataclass(frozen=True)
class Schedule:
    fetches: tuple[Fetch, ...]
    """In issue order (non-decreasing ``start``; ties keep first-use order)."""
    requested_budget_bytes: int
    budget_bytes: int
    """The budget planned against: the request, raised to ``floor_bytes`` if it was below."""
    floor_bytes: int
    """Smallest feasible budget: the most gathered bytes any single node needs at once."""
    peak_live_bytes: int
    planning_seconds: float
    profile: np.ndarray = field(repr=False, compare=False)
    """Live gathered bytes at each node (int64, length ``num_nodes``)."""

    @property
    def prefetched(self) -> int:
        return sum(1 for f in self.fetches if f.start < f.wait)

    @property
    def coalesced_groups(self) -> int:
        return sum(1 for f in self.fetches if len(f.members) > 1)

    @property
    def regathers(self) -> int:
        """Segments beyond the first of each gather (extra collectives to save memory)."""
        seen: set[int] = set()
        extra = 0
        for f in self.fetches:
            for m in f.members:
                extra += m.gather in seen
                seen.add(m.gather)
        return extra


def _comm_seconds(nbytes: int, options: CompileOptions, world_size: int | None) -> float:
    """[Note: world-aware gather cost]
    A gather over ranks receives its bytes over the link, after a collective's latency. At world
    1 nothing crosses a link: the "gather" copies the shard into its pool buffer on the device
    (a read and a write of ``nbytes``), so pricing it as a collective would make every world-1
    plan look exposed and buy prefetch (memory) that hides nothing real."""
    if world_size == 1:
        return 2 * nbytes / options.memory_bytes_per_second
    return options.collective_latency_seconds + nbytes / options.link_bytes_per_second


def plan_schedule(
    summary: GraphSummary, budget_bytes: int, options: CompileOptions | None = None
) -> Schedule:
    """Plan every gather of ``summary`` so live gathered bytes never exceed the budget.

    See [Note: live gathered bytes] for the four steps. Raises ``ValueError`` for a non-positive
    budget; a budget below the feasible floor is raised to it (``Schedule.budget_bytes``).
    """
    if not isinstance(budget_bytes, (int, np.integer)) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive int, got {budget_bytes!r}")
    options = options or CompileOptions()
    t0 = time.perf_counter()
    n = summary.num_nodes
    gathers = summary.gathers
    profile = np.zeros(n, dtype=np.int64)

    # Step 1: the minimum profile.
    for g in gathers:
        if g.escapes:
            profile[g.uses[0] :] += g.nbytes
        else:
            profile[list(g.uses)] += g.nbytes
    floor = int(profile.max()) if n else 0
    budget = max(int(budget_bytes), floor)

    # Step 2: merge gaps between consecutive uses, shortest gaps first.
    merged: list[list[bool]] = [[g.escapes] * max(len(g.uses) - 1, 0) for g in gathers]
    gaps = [
        (g.uses[j + 1] - g.uses[j] - 1, g.nbytes, gi, j)
        for gi, g in enumerate(gathers)
        if not g.escapes
        for j in range(len(g.uses) - 1)
    ]
    gaps.sort()
    for length, nbytes, gi, j in gaps:
        a, b = gathers[gi].uses[j] + 1, gathers[gi].uses[j + 1]
        if length == 0 or int(profile[a:b].max()) + nbytes <= budget:
            profile[a:b] += nbytes
            merged[gi][j] = True

    segments: list[Segment] = []
    for gi, g in enumerate(gathers):
        run = [g.uses[0]]
        for j in range(1, len(g.uses)):
            if merged[gi][j - 1]:
                run.append(g.uses[j])
            else:
                segments.append(Segment(gi, tuple(run), run[-1]))
                run = [g.uses[j]]
        segments.append(Segment(gi, tuple(run), None if g.escapes else run[-1]))
    segments.sort(key=lambda s: (s.uses[0], s.gather, s.uses))

    # Step 3: coalesce adjacent small segments of one block.
    groups: list[list[Segment]] = []
    group_bytes = 0
    for seg in segments:
        g = gathers[seg.gather]
        small = g.nbytes < options.coalesce_min_bytes
        if options.coalesce and groups and small and g.block:
            head = groups[-1][0]
            hg = gathers[head.gather]
            a_g, a_i = head.uses[0], seg.uses[0]
            if (
                hg.block == g.block
                and all(gathers[m.gather].nbytes < options.coalesce_min_bytes for m in groups[-1])
                and all(m.gather != seg.gather for m in groups[-1])
                and group_bytes + g.nbytes <= options.coalesce_max_bytes
                and g.earliest <= a_g
                and (a_i == a_g or int(profile[a_g:a_i].max()) + g.nbytes <= budget)
            ):
                profile[a_g:a_i] += g.nbytes
                groups[-1].append(seg)
                group_bytes += g.nbytes
                continue
        groups.append([seg])
        group_bytes = g.nbytes

    # Step 4: prefetch within the budget, starts in first-use order ([Note: prefetch order]).
    elapsed = np.concatenate(([0.0], np.cumsum(np.asarray(summary.compute_seconds, dtype=np.float64))))
    waits = [members[0].uses[0] for members in groups]
    earliest = [max(gathers[m.gather].earliest for m in members) for members in groups]
    sizes = [sum(gathers[m.gather].nbytes for m in members) for members in groups]
    target = list(waits)
    if options.prefetch:
        # Latest starts that still finish in time on one serial link, from the last fetch back
        # ([Note: prefetch order]): a fetch must be done by its wait and before the next one's
        # communication begins.
        deadline = float("inf")
        for i in range(len(groups) - 1, -1, -1):
            wait, lo = waits[i], earliest[i]
            finish = min(float(elapsed[wait]), deadline)
            begin = finish - _comm_seconds(sizes[i], options, summary.world_size)
            # Largest slot s with elapsed[s] <= begin: enough compute between it and the finish.
            s = int(np.searchsorted(elapsed, begin, side="right")) - 1
            target[i] = min(max(s, lo), wait)
            # The earlier fetch must be done when this one's communication begins: at ``begin``,
            # not at the start of the slot it is issued in ([Note: prefetch deadline]).
            deadline = max(begin, float(elapsed[target[i]]))
        for i in range(len(target) - 2, -1, -1):
            target[i] = min(target[i], target[i + 1])
    fetches: list[Fetch] = []
    prev_start = 0
    for members, wait, lo, nbytes, want in zip(groups, waits, earliest, sizes, target):
        s = min(max(want, lo, prev_start), wait)
        if s < wait:
            window = profile[s:wait] + nbytes > budget
            if window.any():
                s += int(np.flatnonzero(window)[-1]) + 1
            profile[s:wait] += nbytes
        fetches.append(Fetch(tuple(members), s, wait, nbytes))
        prev_start = s

    peak = int(profile.max()) if n else 0
    assert peak <= budget, f"zbuf planner bug: peak {peak} > budget {budget}"
    return Schedule(
        fetches=tuple(fetches),
        requested_budget_bytes=int(budget_bytes),
        budget_bytes=budget,
        floor_bytes=floor,
        peak_live_bytes=peak,
        planning_seconds=time.perf_counter() - t0,
        profile=profile,
    )


def live_gathered_bytes(summary: GraphSummary, schedule: Schedule) -> np.ndarray:
    """Recompute the live-bytes profile from the fetches alone (an independent check)."""
    profile = np.zeros(summary.num_nodes, dtype=np.int64)
    for f in schedule.fetches:
        for m in f.members:
            end = summary.num_nodes - 1 if m.release_after is None else m.release_after
            profile[f.start : end + 1] += summary.gathers[m.gather].nbytes
    return profile


def buffer_counts(summary: GraphSummary, schedule: Schedule) -> dict[int, dict[int, int]]:
    """{pool id: {buffer bytes: most buffers of that size live at once}} over the graph.

    [Note: pool sizing]
    A pool that keeps, for every size, as many blocks as are ever live at once serves every
    acquire of a repeated step from an idle block of exactly that size (best fit finds it), so
    after the first step no gather allocates. That is ``sum(capacity(size) * count)``, which the
    first run of the graph passes to the pool (``zbuf::check_schedule``); it is at least the
    peak live gathered bytes and usually equal for layered models, whose layers repeat one set
    of sizes. A graph may gather from several pools (modules sharded with pools of their own):
    each pool gets the counts of its own gathers (``GatherSpec.pool``).
    """
    n = summary.num_nodes
    by_pool: dict[int, dict[int, np.ndarray]] = {}
    for f in schedule.fetches:
        for m in f.members:
            spec = summary.gathers[m.gather]
            end = n - 1 if m.release_after is None else m.release_after
            d = by_pool.setdefault(spec.pool, {}).setdefault(spec.nbytes, np.zeros(n + 1, dtype=np.int64))
            d[f.start] += 1
            d[end + 1] -= 1
    return {pool: {size: int(np.cumsum(d).max()) for size, d in sorted(by_size.items())}
            for pool, by_size in sorted(by_pool.items())}


def exposed_seconds(summary: GraphSummary, schedule: Schedule,
                    options: CompileOptions | None = None) -> float:
    """Communication time the compute stream waits for under the cost model.

    [Note: modelled exposure]
    One communication stream runs the fetches in issue order, each for ``_comm_seconds`` of its
    bytes, starting when it is issued (its start slot, on the compute timeline) and the one
    before it has finished; the compute stream runs the nodes' ``compute_seconds`` and stops at
    each wait until its fetch is done. The sum of those stops is what this returns: zero when
    every gather is hidden. The same model places the prefetches, so this measures what the
    budget, the graph's order and persistence leave exposed, not the model's accuracy.
    """
    options = options or CompileOptions()
    elapsed = np.concatenate(([0.0], np.cumsum(np.asarray(summary.compute_seconds, dtype=np.float64))))
    # (wait slot, total stall up to and including that wait), waits in non-decreasing order.
    stall_slots: list[int] = []
    stall_totals: list[float] = []
    stalled = 0.0
    comm_free = 0.0
    for f in schedule.fetches:
        before = bisect.bisect_right(stall_slots, f.start)
        issued = elapsed[f.start] + (stall_totals[before - 1] if before else 0.0)
        done = max(issued, comm_free) + _comm_seconds(f.nbytes, options, summary.world_size)
        comm_free = done
        stop = done - (elapsed[f.wait] + stalled)
        if stop > 0:
            stalled += stop
        stall_slots.append(f.wait)
        stall_totals.append(stalled)
    return stalled
