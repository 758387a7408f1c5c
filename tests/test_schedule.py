"""The gather planner (compile/schedule.py) on random graphs: dependencies, budget, determinism."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zbuf.compile.graph_model import GatherSpec, GraphSummary
from zbuf.compile.options import CompileOptions
from zbuf.compile.schedule import exposed_seconds, live_gathered_bytes, plan_schedule

MAX_EXAMPLES = int(os.environ.get("ZBUF_FUZZ_EXAMPLES", "150"))


@st.composite
def graphs(draw):
    n = draw(st.integers(1, 60))
    compute = tuple(draw(st.lists(st.floats(0, 1e-3), min_size=n, max_size=n)))
    gathers = []
    for i in range(draw(st.integers(0, 12))):
        uses = sorted(set(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=5))))
        earliest = draw(st.integers(0, uses[0]))
        gathers.append(
            GatherSpec(
                key=f"p{i}",
                nbytes=draw(st.integers(0, 1 << 12)),
                uses=tuple(uses),
                earliest=earliest,
                escapes=draw(st.booleans()) and draw(st.booleans()),
                block=draw(st.sampled_from(["", "b0", "b1"])),
            )
        )
    return GraphSummary(n, compute, tuple(gathers))


@st.composite
def options(draw):
    return CompileOptions(
        prefetch=draw(st.booleans()),
        coalesce=draw(st.booleans()),
        coalesce_min_bytes=draw(st.integers(0, 1 << 12)),
        coalesce_max_bytes=draw(st.integers(0, 1 << 13)),
        link_bytes_per_second=draw(st.sampled_from([1e3, 1e6, 1e9])),
        collective_latency_seconds=draw(st.sampled_from([0.0, 1e-5, 1e-3])),
    )


def check_schedule(summary: GraphSummary, sched, budget: int, opts: CompileOptions) -> None:
    n = summary.num_nodes
    # Budget: raised only to the floor, never exceeded anywhere.
    assert sched.budget_bytes == max(budget, sched.floor_bytes)
    profile = live_gathered_bytes(summary, sched)
    assert np.array_equal(profile, sched.profile)
    assert int(profile.max(initial=0)) == sched.peak_live_bytes <= sched.budget_bytes
    # The floor is what the nodes need at once: uses and escaping tails.
    need = np.zeros(n, dtype=np.int64)
    for g in summary.gathers:
        if g.escapes:
            need[g.uses[0]:] += g.nbytes
        else:
            need[list(g.uses)] += g.nbytes
    assert sched.floor_bytes == int(need.max(initial=0))
    assert np.all(profile >= need)

    covered = {gi: [] for gi in range(len(summary.gathers))}
    prev_start = 0
    for f in sched.fetches:
        # Data dependencies: inputs before the start, start before the wait, wait before uses.
        assert prev_start <= f.start <= f.wait
        prev_start = f.start
        assert f.wait == min(m.uses[0] for m in f.members)
        assert f.nbytes == sum(summary.gathers[m.gather].nbytes for m in f.members)
        assert len({m.gather for m in f.members}) == len(f.members)
        if not opts.prefetch:
            assert f.start == f.wait
        if len(f.members) > 1:
            assert opts.coalesce
            blocks = {summary.gathers[m.gather].block for m in f.members}
            assert len(blocks) == 1 and "" not in blocks
            assert f.nbytes <= opts.coalesce_max_bytes
        for m in f.members:
            g = summary.gathers[m.gather]
            assert g.earliest <= f.start
            assert list(m.uses) == sorted(m.uses) and set(m.uses) <= set(g.uses)
            if g.escapes:
                assert m.release_after is None and m.uses == g.uses
            else:
                # Release after the last use of the segment and before any later use.
                assert m.release_after == m.uses[-1]
            covered[m.gather].extend(m.uses)
    # Every use is served by exactly one gathered buffer.
    for gi, g in enumerate(summary.gathers):
        assert sorted(covered[gi]) == list(g.uses)
    # Segments of one gather do not overlap in time: the previous one is released first.
    spans = {}
    for f in sched.fetches:
        for m in f.members:
            spans.setdefault(m.gather, []).append((f.start, m.release_after))
    for gi, ss in spans.items():
        ss.sort()
        for (s0, r0), (s1, _) in zip(ss, ss[1:]):
            assert r0 is not None and r0 < s1 or r0 is not None and r0 <= s1


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(), options(), st.integers(1, 1 << 15))
def test_random_graphs_respect_dependencies_and_budget(summary, opts, budget):
    sched = plan_schedule(summary, budget, opts)
    check_schedule(summary, sched, budget, opts)
    # Deterministic: the same input gives the same schedule.
    again = plan_schedule(summary, budget, opts)
    assert again.fetches == sched.fetches and again.peak_live_bytes == sched.peak_live_bytes


def _chain(n_layers: int, per_layer: int, nbytes: int):
    """A forward-like chain: layer l's gathers are each read once by consecutive nodes."""
    nodes_per_layer = per_layer * 3
    n = n_layers * nodes_per_layer
    gathers = []
    for l in range(n_layers):
        for k in range(per_layer):
            gathers.append(GatherSpec(f"l{l}.w{k}", nbytes, (l * nodes_per_layer + 3 * k + 1,), 0, block=f"l{l}"))
    return GraphSummary(n, (1e-4,) * n, tuple(gathers))


def test_unbounded_budget_prefetches_everything_and_tight_budget_serialises():
    summary = _chain(4, 3, 1000)
    opts = CompileOptions(coalesce=False, link_bytes_per_second=1e6, collective_latency_seconds=0.0)
    loose = plan_schedule(summary, 10**9, opts)
    # 1000 B at 1 MB/s is 1 ms per gather on a serial link, one read every 0.3 ms of compute:
    # the link is the bottleneck, so with no budget limit the exposure is the serial lower bound
    # (the link busy from the start; [Note: prefetch order]), whatever the starts.
    assert loose.fetches[0].start == 0
    bound = max((i + 1) * 1e-3 - 1e-4 * f.wait for i, f in enumerate(loose.fetches))
    assert exposed_seconds(summary, loose, opts) == pytest.approx(max(bound, 0.0))
    # Reads 1.2 ms apart: the link keeps up, each gather starts ten 0.1 ms nodes ahead (float
    # rounding may add one) or as early as the graph allows, and nothing is exposed.
    spaced = GraphSummary(60, (1e-4,) * 60, tuple(
        GatherSpec(f"w{k}", 1000, (12 * k + 11,), 0, block=f"l{k}") for k in range(5)))
    sched = plan_schedule(spaced, 10**9, opts)
    for f in sched.fetches:
        assert 10 <= f.wait - f.start <= 11 or f.start == 0
    assert exposed_seconds(spaced, sched, opts) == 0.0
    tight = plan_schedule(summary, 1000, opts)
    assert tight.peak_live_bytes == 1000 and tight.budget_bytes == 1000
    # One buffer: each start waits for the previous release (and uses the idle nodes after it).
    for prev, f in zip(tight.fetches, tight.fetches[1:]):
        assert f.start == prev.members[0].release_after + 1
    # Two buffers: each start may overlap the previous gather's use, not the one before.
    two = plan_schedule(summary, 2000, opts)
    assert two.peak_live_bytes == 2000
    for prev2, f in zip(two.fetches, two.fetches[2:]):
        assert f.start == max(prev2.members[0].release_after + 1, f.wait - 11) or 10 <= f.wait - f.start


def test_small_gather_does_not_pin_a_large_one_behind_it():
    """[Note: prefetch order]: a tiny gather that needs no lead, read just before a large one,
    still starts early enough for the large one to be covered, and starts stay in wait order."""
    n = 40
    compute = (1e-4,) * n  # 0.1 ms per node
    small = GatherSpec("norm", 8, (29,), 0, block="a")
    large = GatherSpec("mlp", 1000, (30,), 0, block="b")
    opts = CompileOptions(coalesce=False, link_bytes_per_second=1e6, collective_latency_seconds=0.0)
    sched = plan_schedule(GraphSummary(n, compute, (small, large)), 10**9, opts)
    by_key = {f.members[0].gather: f for f in sched.fetches}
    f_small, f_large = by_key[0], by_key[1]
    assert f_small.start <= f_large.start  # issue order = wait order
    assert f_large.wait - f_large.start >= 10  # 1 ms of communication, 0.1 ms nodes
    # A tight budget still wins over the lead.
    tight = plan_schedule(GraphSummary(n, compute, (small, large)), 1008, opts)
    assert tight.peak_live_bytes <= 1008


def test_modelled_exposure():
    """[Note: modelled exposure]: what the compute stream waits for, with one serial
    communication stream."""
    opts = CompileOptions(coalesce=False, link_bytes_per_second=1e6, collective_latency_seconds=0.0)
    compute = (1e-4,) * 40  # 0.1 ms per node
    # Read by the first node: nothing to hide behind, the whole 1 ms is exposed.
    first = GraphSummary(40, compute, (GatherSpec("w", 1000, (0,), 0),))
    assert exposed_seconds(first, plan_schedule(first, 10**9, opts), opts) == pytest.approx(1e-3)
    # Read by node 30 and free to start at 0: fully hidden; without prefetch, fully exposed.
    late = GraphSummary(40, compute, (GatherSpec("w", 1000, (30,), 0),))
    assert exposed_seconds(late, plan_schedule(late, 10**9, opts), opts) == 0.0
    no_prefetch = dataclasses.replace(opts, prefetch=False)
    assert exposed_seconds(late, plan_schedule(late, 10**9, no_prefetch), opts) == pytest.approx(1e-3)
    # Two gathers of 1 ms each needed at 1.5 ms: the link is serial, so 0.5 ms is exposed (the
    # second finishes at 2 ms), and a stall delays everything after it.
    pair = GraphSummary(40, compute, (GatherSpec("a", 1000, (15,), 0), GatherSpec("b", 1000, (15,), 0)))
    assert exposed_seconds(pair, plan_schedule(pair, 10**9, opts), opts) == pytest.approx(5e-4)


@given(summary=graphs(), opts=options(), budget=st.integers(1, 1 << 14))
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_modelled_exposure_is_bounded(summary, opts, budget):
    # Never negative, never more than all communication run back to back with no overlap.
    sched = plan_schedule(summary, budget, opts)
    exposed = exposed_seconds(summary, sched, opts)
    serial = sum(opts.collective_latency_seconds + f.nbytes / opts.link_bytes_per_second
                 for f in sched.fetches)
    assert 0.0 <= exposed <= serial * (1 + 1e-9) + 1e-12


@st.composite
def blocks_as_nodes(draw):
    """A graph whose blocks are one node each (blocks compiled once: the block's body is one
    ``invoke_subgraph`` node that reads every gathered weight of the block), node 0 an
    embedding with nothing to gather. Each block's communication fits in the compute of the
    node before it, so one block ahead hides everything."""
    blocks = draw(st.integers(2, 12))
    per_block = draw(st.integers(1, 6))
    compute = tuple(draw(st.lists(st.floats(1.1e-3, 2e-3), min_size=blocks + 1,
                                  max_size=blocks + 1)))
    gathers = tuple(
        GatherSpec(f"b{b}.w{k}", draw(st.integers(1, 1000 // per_block)), (b + 1,), 0,
                   block=f"b{b}")
        for b in range(blocks) for k in range(per_block))
    return GraphSummary(blocks + 1, compute, gathers)


def _block_bytes(summary: GraphSummary) -> dict[int, int]:
    out: dict[int, int] = {}
    for g in summary.gathers:
        out[g.uses[0]] = out.get(g.uses[0], 0) + g.nbytes
    return out


@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks_as_nodes())
def test_prefetch_of_blocks_as_nodes_stops_one_block_ahead(summary):
    """[Note: prefetch deadline]: with an unbounded budget and nothing exposed, a block's fetches
    start in the node before it, never further back: the peak is two blocks' weights at the same
    (zero) modelled exposure. Up to 4fed11d each fetch pushed every earlier one back a whole
    node, and most started in the first slot."""
    opts = CompileOptions(coalesce=False, link_bytes_per_second=1e6, collective_latency_seconds=0.0)
    sched = plan_schedule(summary, 10**12, opts)
    check_schedule(summary, sched, 10**12, opts)
    assert exposed_seconds(summary, sched, opts) == 0.0
    for f in sched.fetches:
        assert f.start == f.wait - 1, (f.start, f.wait)
    per_block = _block_bytes(summary)
    two = max(per_block.get(i, 0) + per_block.get(i + 1, 0) for i in range(summary.num_nodes))
    assert sched.peak_live_bytes <= two


def test_budget_below_floor_is_raised_and_reported():
    g = (GatherSpec("a", 700, (1,), 0), GatherSpec("b", 500, (1, 3), 0))
    sched = plan_schedule(GraphSummary(5, (0.0,) * 5, g), 100)
    assert sched.requested_budget_bytes == 100 and sched.floor_bytes == sched.budget_bytes == 1200


def test_tight_budget_regathers_between_distant_uses():
    # A tied weight read at both ends of the graph, with other gathers in between.
    g = [GatherSpec("tied", 1000, (0, 9), 0)] + [GatherSpec(f"w{i}", 1000, (i,), 0) for i in range(1, 9)]
    summary = GraphSummary(10, (0.0,) * 10, tuple(g))
    opts = CompileOptions(coalesce=False, prefetch=False)
    assert plan_schedule(summary, 1000, opts).regathers == 1
    assert plan_schedule(summary, 2000, opts).regathers == 0


def test_coalesces_small_gathers_of_one_block():
    summary = _chain(2, 4, 1000)
    sched = plan_schedule(summary, 10**9, CompileOptions(coalesce_min_bytes=4096, coalesce_max_bytes=1 << 20))
    assert sched.coalesced_groups == 2 and len(sched.fetches) == 2
    assert [len(f.members) for f in sched.fetches] == [4, 4]
    capped = plan_schedule(summary, 10**9, CompileOptions(coalesce_min_bytes=4096, coalesce_max_bytes=2000))
    assert [len(f.members) for f in capped.fetches] == [2, 2, 2, 2]
    big = plan_schedule(summary, 10**9, CompileOptions(coalesce_min_bytes=1000))
    assert big.coalesced_groups == 0


def test_invalid_inputs_are_rejected():
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_schedule(GraphSummary(1, (0.0,), ()), 0)
    with pytest.raises(ValueError, match="sorted"):
        GatherSpec("x", 1, (3, 1), 0)
    with pytest.raises(ValueError, match="earliest"):
        GatherSpec("x", 1, (1,), 2)
    with pytest.raises(ValueError, match="no uses"):
        GatherSpec("x", 1, (), 0)


def _synthetic_14b(fw: bool) -> GraphSummary:
    """qwen3-14b sized: 40 layers x 10 gathers, 150 nodes per layer (6,000 in all)."""
    layers, per_layer, nodes_per_layer = 40, 10, 150
    n = layers * nodes_per_layer + 20
    sizes = [5120 * 5120 * 2, 1024 * 5120 * 2, 1024 * 5120 * 2, 5120 * 5120 * 2, 17408 * 5120 * 2,
             17408 * 5120 * 2, 17408 * 5120 * 2, 5120 * 2, 128 * 2, 128 * 2]
    gathers = [GatherSpec("embed", 151936 * 5120 * 2, (1,) if fw else (n - 2,), 0)]
    for l in range(layers):
        base = 10 + l * nodes_per_layer
        for k in range(per_layer):
            uses = (base + 10 * k + 2,) if fw else (base + 10 * k + 2, base + 10 * k + 60)
            gathers.append(GatherSpec(f"layers.{l}.{k}", sizes[k], uses, 0, block=f"layers.{l}"))
    gathers.append(GatherSpec("norm", 5120 * 2, (n - 5,), 0))
    rng = np.random.default_rng(0)
    return GraphSummary(n, tuple(rng.uniform(1e-5, 1e-3, n).tolist()), tuple(gathers))


@pytest.mark.parametrize("fw", [True, False])
def test_plans_a_14b_sized_graph_in_well_under_a_second(fw):
    summary = _synthetic_14b(fw)
    largest = max(g.nbytes for g in summary.gathers)
    total = sum(g.nbytes for g in summary.gathers)
    for budget in (largest, 4 * largest, total):
        t0 = time.perf_counter()
        sched = plan_schedule(summary, budget)
        took = time.perf_counter() - t0
        check_schedule(summary, sched, budget, CompileOptions())
        assert took < 1.0, f"planning took {took:.3f}s"
