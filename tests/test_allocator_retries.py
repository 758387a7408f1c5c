"""benches/allocator_retries.py: the request behind each of torch's allocator retries, read off
an allocation history (the trace format of ``torch.cuda.memory._snapshot``)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

BENCHES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benches")


def _module():
    sys.path.insert(0, BENCHES)
    try:
        return importlib.import_module("allocator_retries")
    finally:
        sys.path.pop(0)


def _frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def test_each_release_run_names_the_request_after_it():
    retried_requests = _module().retried_requests
    user = _frame("/work/benches/plain_setup.py", 196, "_loss")
    trace = [
        {"action": "alloc", "size": 100, "stream": 0, "frames": []},
        {"action": "alloc", "size": 50, "stream": 0, "frames": []},
        {"action": "free_requested", "size": 50, "stream": 0},
        {"action": "free_completed", "size": 50, "stream": 0},
        # torch frees its whole cache, then serves the request that could not fit
        {"action": "segment_unmap", "size": 30, "stream": 0, "time_us": 7},
        {"action": "segment_unmap", "size": 20, "stream": 0, "time_us": 8},
        {"action": "segment_map", "size": 400, "stream": 0},
        {"action": "alloc", "size": 400, "stream": 3,
         "frames": [_frame("/x/site-packages/torch/nn/functional.py", 1, "cross_entropy"), user]},
        {"action": "alloc", "size": 10, "stream": 0, "frames": []},
        {"action": "segment_free", "size": 64, "stream": 0, "time_us": 9},  # empty_cache
    ]
    found = retried_requests(trace)
    assert found == [
        {"released_bytes": 50, "releases": 2, "allocated_before_bytes": 100, "time_us": 7,
         "request_bytes": 400, "stream": 3,
         "frames": ["/work/benches/plain_setup.py:196 _loss"]},
        {"released_bytes": 64, "releases": 1, "allocated_before_bytes": 510, "time_us": 9,
         "request_bytes": None, "stream": None, "frames": []},
    ]


def test_a_trace_without_releases_has_no_retries():
    retried_requests = _module().retried_requests
    trace = [{"action": "alloc", "size": 8, "stream": 0},
             {"action": "segment_map", "size": 8, "stream": 0},
             {"action": "free_completed", "size": 8, "stream": 0}]
    assert retried_requests(trace) == []


def test_the_layout_before_a_retry_is_the_last_snapshot_rewound():
    layouts_at_retries = _module().layouts_at_retries
    forward = [_frame("/work/benches/plain_setup.py", 180, "forward")]
    loss = [_frame("/work/benches/plain_setup.py", 195, "_loss")]
    trace = [
        {"action": "alloc", "addr": 100, "size": 150, "frames": forward},           # X
        {"action": "free_completed", "addr": 500, "size": 100},  # a block older than the trace
        {"action": "alloc", "addr": 700, "size": 50, "frames": forward},            # Y
        # no 400 bytes in one piece: torch unmaps every free page, maps the request's, serves it
        {"action": "segment_unmap", "addr": 300, "size": 200},
        {"action": "free_completed", "addr": 250, "size": 50},  # Z, older than the trace; one run
        {"action": "segment_unmap", "addr": 500, "size": 200},
        {"action": "segment_unmap", "addr": 750, "size": 250},
        {"action": "segment_map", "addr": 1000, "size": 400},
        {"action": "alloc", "addr": 1000, "size": 400, "frames": loss},
        {"action": "free_completed", "addr": 100, "size": 150},                     # X
    ]
    # The snapshot after the trace: one segment per mapped range, as under expandable segments.
    segments = [
        {"address": 0, "total_size": 300, "blocks": [
            {"address": 0, "size": 100, "state": "active_allocated", "frames": []},  # A, older
            {"address": 100, "size": 150, "state": "inactive"},
            {"address": 250, "size": 50, "state": "inactive"}]},
        {"address": 700, "total_size": 50, "blocks": [
            {"address": 700, "size": 50, "state": "active_allocated", "frames": forward}]},
        {"address": 1000, "total_size": 400, "blocks": [
            {"address": 1000, "size": 400, "state": "active_allocated", "frames": loss}]},
    ]
    # Before the run of unmaps: [0, 1000) mapped; A, X, Z and Y live; free [300, 700) between
    # Z and Y, and [750, 1000) between Y and the mapped range's end; Y alone has free memory on
    # both sides.
    y = {"site": "/work/benches/plain_setup.py:180 forward", "bytes": 50}
    assert layouts_at_retries(trace, segments) == [{
        "mapped_bytes": 1000, "live_bytes": 350, "free_bytes": 650, "free_ranges": 2,
        "largest_free": [
            {"bytes": 400, "below": {"site": "before the trace", "bytes": 50}, "above": y},
            {"bytes": 250, "below": y, "above": None}],
        # Y and X elsewhere, [300, 1000) would be one range: the 400-byte request's room; the
        # forward held X and Y together (200 bytes) before X was freed.
        "islands": [{"site": "/work/benches/plain_setup.py:180 forward", "bytes": 50,
                     "blocks": 1, "largest_free_without": 700, "held_at_most_bytes": 200}]}]


def test_each_retry_gets_the_layout_of_its_own_moment():
    layouts_at_retries = _module().layouts_at_retries
    site = [_frame("/work/m.py", 1, "f")]
    trace = [
        {"action": "alloc", "addr": 0, "size": 10, "frames": site},
        {"action": "segment_unmap", "addr": 10, "size": 90},
        {"action": "alloc", "addr": 200, "size": 50, "frames": site},
        {"action": "free_completed", "addr": 0, "size": 10},
        {"action": "segment_unmap", "addr": 0, "size": 10},
    ]
    segments = [{"address": 200, "total_size": 50, "blocks": [
        {"address": 200, "size": 50, "state": "active_allocated", "frames": site}]}]
    first, second = layouts_at_retries(trace, segments)
    assert (first["mapped_bytes"], first["live_bytes"]) == (150, 10)
    # [10, 100) above the first block, up to the mapped end; [200, 250) a mapped range alone.
    assert first["largest_free"] == [
        {"bytes": 90, "below": {"site": "/work/m.py:1 f", "bytes": 10}, "above": None},
        {"bytes": 50, "below": None, "above": None}]
    assert (second["mapped_bytes"], second["live_bytes"], second["free_bytes"]) == (60, 50, 10)


def test_a_kept_history_reads_the_same_on_any_machine(tmp_path):
    """The history ``recorded`` keeps is read again without a GPU (``python3
    benches/allocator_retries.py FILE``) to the same retries and layouts, torch's frames left out
    and the reading's fields kept."""
    m = _module()
    inside_torch = _frame("/x/site-packages/torch/nn/functional.py", 1, "cross_entropy")
    loss = [inside_torch, _frame("/work/benches/plain_setup.py", 195, "_loss")]
    forward = [_frame("/work/benches/plain_setup.py", 180, "forward")]
    trace = [
        {"action": "alloc", "addr": 0, "size": 100, "stream": 0, "frames": forward,
         "time_us": 1, "compile_context": "N/A", "user_metadata": ""},
        {"action": "segment_unmap", "addr": 100, "size": 300, "stream": 0, "time_us": 2},
        {"action": "segment_map", "addr": 400, "size": 500, "stream": 0, "time_us": 3},
        {"action": "alloc", "addr": 400, "size": 500, "stream": 0, "frames": loss,
         "time_us": 4},
    ]
    segments = [
        {"address": 0, "total_size": 100, "device": 0, "stream": 0, "segment_type": "large",
         "blocks": [{"address": 0, "size": 100, "requested_size": 100,
                     "state": "active_allocated", "frames": forward}]},
        {"address": 400, "total_size": 500, "device": 0, "stream": 0, "segment_type": "large",
         "blocks": [{"address": 400, "size": 500, "requested_size": 500,
                     "state": "active_allocated", "frames": loss}]},
    ]
    path = str(tmp_path / "history.json.gz")
    m.save_history(path, trace, segments)
    kept_trace, kept_segments = m.load_history(path)
    assert kept_trace[3]["frames"] == [loss[1]] and "compile_context" not in kept_trace[0]
    assert m.retries_and_layouts(kept_trace, kept_segments) == m.retries_and_layouts(trace,
                                                                             segments)
    out = subprocess.run([sys.executable, os.path.join(BENCHES, "allocator_retries.py"), path],
                         capture_output=True, text=True, check=True).stdout
    (found,) = json.loads(out)
    assert found["request_bytes"] == 500 and found["frames"] == [
        "/work/benches/plain_setup.py:195 _loss"]
    assert found["layout"]["largest_free"] == [{
        "bytes": 300, "below": {"site": "/work/benches/plain_setup.py:180 forward", "bytes": 100},
        "above": None}]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(1, 30), st.sampled_from("abc")),
                max_size=12),
       st.integers(0, 40))
def test_a_layout_accounts_for_every_mapped_byte(spans, tail):
    """Whatever the live blocks: free and live bytes add up to what is mapped, the largest free
    range is the largest gap, and moving a site's blocks never gives less room."""
    layout_of = _module()._layout
    live, cursor = {}, 0
    for gap, size, site in spans:  # blocks laid out upward, each after a gap
        cursor += gap
        live[cursor] = (size, [_frame(f"/work/{site}.py", 1, "f")])
        cursor += size
    mapped_end = cursor + tail
    layout = layout_of([(0, mapped_end)] if mapped_end else [], live)
    assert layout["free_bytes"] + layout["live_bytes"] == layout["mapped_bytes"] == mapped_end
    gaps, cursor = [], 0
    for addr in sorted(live):
        gaps.append(addr - cursor)
        cursor = addr + live[addr][0]
    gaps.append(mapped_end - cursor)
    largest = max(gaps, default=0)
    assert [r["bytes"] for r in layout["largest_free"]][:1] == ([largest] if largest else [])
    without = {island["site"].split(":")[0]: island["largest_free_without"]
               for island in layout["islands"]}
    assert all(largest <= room <= mapped_end for room in without.values())
    for k, addr in enumerate(sorted(live)):  # an island gone joins the ranges on its two sides
        size, frames = live[addr]
        if gaps[k] and gaps[k + 1]:
            assert without[frames[0]["filename"]] >= gaps[k] + size + gaps[k + 1]
