"""``--profile-dir``'s device-timeline summary (``zbuf.train.profile``)."""

import pytest

from zbuf.train.profile import summarize_trace


def _k(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_exposed_comm_is_nccl_time_outside_compute():
    events = [
        _k("sm90_gemm_bf16", 0, 100),                     # compute 0-100
        _k("ncclDevKernel_AllGather_RING_LL", 50, 100),   # comm 50-150: 50 exposed
        _k("triton_poi_fused_add_0", 150, 50),            # compute 150-200
        _k("ncclDevKernel_ReduceScatter_RING", 180, 40),  # comm 180-220: 20 exposed
        _k("Memcpy DtoD", 300, 10, cat="gpu_memcpy"),     # idle 220-300
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # host: ignored
    ]
    s = summarize_trace(events, steps=2)
    assert s["span_ms_per_step"] == pytest.approx(310e-3 / 2)
    assert s["compute_ms_per_step"] == pytest.approx(160e-3 / 2)
    assert s["comm_ms_per_step"] == pytest.approx(140e-3 / 2)
    assert s["exposed_comm_ms_per_step"] == pytest.approx(70e-3 / 2)
    assert s["idle_ms_per_step"] == pytest.approx(80e-3 / 2)
    fams = {k["kernel"]: k for k in s["top_kernels_ms_per_step"]}
    assert fams["nccl:AllGather"]["calls"] == 0.5 and "gemm" in fams and "copy" in fams


def test_trace_without_device_events_says_so():
    assert "error" in summarize_trace([{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 1}], 2)


def test_named_list_tells_apart_the_functors_a_family_joins():
    copy = "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda"
    cast = "void at::native::unrolled_elementwise_kernel<at::native::bfloat16_copy_kernel_cuda"
    s = summarize_trace([_k(copy, 0, 30), _k(cast, 40, 10), _k(copy, 60, 30)], steps=1)
    fams = {k["kernel"]: k for k in s["top_kernels_ms_per_step"]}
    assert fams["void at::native::unrolled_elementwise_kernel"]["calls"] == 3
    named = {k["kernel"]: k for k in s["top_named_kernels_ms_per_step"]}
    assert named[copy]["ms"] == pytest.approx(60e-3) and named[copy]["calls"] == 2
    assert named[cast]["calls"] == 1
