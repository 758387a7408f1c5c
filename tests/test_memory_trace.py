"""``both_peak`` (tests/memory_trace.py): torch's allocations and the pool's buffers read at the
same moment, which the GPU test of every checkpoint placement compares with FSDP2's peak."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memory_trace import TICK_US, both_peak, clock_offset


def alloc(t, n):
    return {"action": "alloc", "size": n, "time_us": t}


def free(t, n):
    return {"action": "free_requested", "size": n, "time_us": t}


def acquire(t, n):
    return {"kind": "hit", "nbytes": n, "time_us": t}


def release(t, n):
    return {"kind": "release", "nbytes": n, "time_us": t}


def test_peaks_apart_are_not_added_and_peaks_together_are():
    """The pool's buffer released before torch's peak: the larger of the two moments, not the
    sum; still held at it: the sum. Torch's segment events and the pool's budget changes
    count nothing."""
    trace = [alloc(100, 1000), free(200, 1000), alloc(300, 5000), free(400, 5000),
             {"action": "segment_alloc", "size": 1 << 20, "time_us": 250}]
    apart = [acquire(150, 700), release(250, 700),
             {"kind": "set_budget", "nbytes": 1 << 30, "time_us": 0}]
    assert both_peak(trace, apart, slack_us=0) == 5000
    assert both_peak(trace, [acquire(150, 700), release(350, 700)], slack_us=0) == 5700


def test_the_clocks_offset_and_slack():
    """The pool's clock ``offset_us`` behind torch's; a release within ``slack_us`` of torch's
    allocation counts as still held."""
    trace = [alloc(1000, 5000), free(2000, 5000)]
    assert both_peak(trace, [acquire(0, 700), release(990, 700)], slack_us=0) == 5000
    assert both_peak(trace, [acquire(0, 700), release(990, 700)], slack_us=20) == 5700
    assert both_peak(trace, [acquire(0, 700), release(990, 700)], offset_us=20,
                     slack_us=0) == 5700
    assert both_peak([], [], pool_start_bytes=300) == 300


@st.composite
def interleaved(draw):
    """Torch allocations and pool buffers, each freed after it is made, at distinct times."""
    n = draw(st.integers(1, 12))
    times = draw(st.lists(st.integers(0, 10_000), min_size=4 * n, max_size=4 * n,
                          unique=True))
    trace, events = [], []
    for i in range(n):
        a, b = sorted(times[4 * i:4 * i + 2])
        c, d = sorted(times[4 * i + 2:4 * i + 4])
        size, held = draw(st.integers(1, 1 << 20)), draw(st.integers(1, 1 << 20))
        trace += [alloc(a, size), free(b, size)]
        events += [acquire(c, held), release(d, held)]
    return sorted(trace, key=lambda e: e["time_us"]), sorted(events, key=lambda e: e["time_us"])


@settings(max_examples=200, deadline=None)
@given(interleaved(), st.integers(0, 100))
def test_both_peak_is_the_highest_sum_at_one_moment(logs, slack):
    """Without slack, the highest of torch's and the pool's bytes summed at each moment (read
    just after every change); never above the sum of the two peaks; more slack, never lower."""
    trace, events = logs

    def at(t):
        torch_bytes = (sum(e["size"] for e in trace if e["action"] == "alloc" and e["time_us"] <= t)
                       - sum(e["size"] for e in trace
                             if e["action"] == "free_requested" and e["time_us"] <= t))
        pool = (sum(e["nbytes"] for e in events if e["kind"] == "hit" and e["time_us"] <= t)
                - sum(e["nbytes"] for e in events if e["kind"] == "release" and e["time_us"] <= t))
        return torch_bytes, pool

    moments = [at(e["time_us"]) for e in trace + events]
    exact = max(t + p for t, p in moments)
    assert both_peak(trace, events, slack_us=0) == exact
    assert exact <= max(t for t, _ in moments) + max(p for _, p in moments)
    assert both_peak(trace, events, slack_us=slack) >= exact


@settings(max_examples=200, deadline=None)
@given(st.integers(-10**12, 10**12), st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 50),
                                                       st.integers(1, 50)), min_size=1, max_size=16),
       st.lists(st.integers(-TICK_US + 1, TICK_US - 1), min_size=48, max_size=48))
def test_the_brackets_hold_the_clocks_true_offset(offset, brackets, jitter):
    """Brackets made in order on one real clock, read off two clocks ``offset`` apart, each
    read rounded by less than a tick: the offset found is the true one within its uncertainty,
    and closer brackets leave less uncertain."""
    read, start = [], 0  # (pool acquire, torch allocation, pool release)
    for i, (gap, before, after) in enumerate(brackets):
        acquire = start + gap
        alloc, release = acquire + before, acquire + before + after
        start = release
        read.append((acquire + jitter[3 * i], alloc + offset + jitter[3 * i + 1],
                     release + jitter[3 * i + 2]))
    found = clock_offset(read)
    assert abs(found.offset_us - offset) <= found.uncertainty_us
    narrowest = min(before + after for _, before, after in brackets)
    assert found.uncertainty_us <= (narrowest + 1) // 2 + 2 * TICK_US
