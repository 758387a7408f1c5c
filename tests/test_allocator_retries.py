"""benches/allocator_retries.py: the request behind each of torch's allocator retries, read off
an allocation history (the trace format of ``torch.cuda.memory._snapshot``)."""

from __future__ import annotations

import importlib
import os
import sys

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
