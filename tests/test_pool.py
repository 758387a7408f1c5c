"""The Python pool API on the host backend: zero copy, DLPack capsules, release contract,
errors, sizing, pressure, telemetry, threads. (Model-based fuzzing: test_pool_fuzz.py.)"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import zbuf.errors as E
from zbuf import _core
from zbuf.pool import GatherBufferPool, PoolStats, default_pool

MiB = 1 << 20


@pytest.fixture
def pool():
    return GatherBufferPool("cpu", budget_bytes=64 * MiB, hard_cap_bytes=256 * MiB)


# -- handoff ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
                                   torch.complex64])
def test_acquire_returns_contiguous_tensor_of_dtype(pool, dtype):
    t = pool.acquire((3, 5, 7), dtype)
    assert t.shape == (3, 5, 7) and t.dtype == dtype and t.device.type == "cpu"
    assert t.is_contiguous() and t.stride() == (35, 7, 1)
    assert t.data_ptr() % 256 == 0
    assert pool.owns(t)


def test_zero_copy_same_pointer_through_release_and_reacquire(pool):
    a = pool.acquire((1024,), torch.float32)
    ptr = a.data_ptr()
    a.fill_(7.0)
    pool.release(a)
    # A smaller request of another dtype fits the same block: same memory, no copy.
    b = pool.acquire((1000,), torch.bfloat16)
    assert b.data_ptr() == ptr
    # The bytes written through `a` are visible through `a` still (it aliases the block).
    b.view(torch.uint8).fill_(0)
    assert float(a[:500].abs().sum()) == 0.0 and float(a[500:].sum()) == 7.0 * 524
    s = pool.stats()
    assert (s.hits, s.misses, s.allocations) == (1, 1, 1)


def test_bf16_export_round_trip(pool):
    t = pool.acquire((4, 4), torch.bfloat16)
    ref = torch.randn(4, 4).to(torch.bfloat16)
    t.copy_(ref)
    assert torch.equal(t, ref)
    assert torch.equal(t.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("versioned", [True, False])
def test_raw_capsules_versioned_and_legacy(pool, versioned):
    cap = pool._core.acquire_capsule([8, 2], torch.bfloat16, None, versioned)
    assert type(cap).__name__ == "PyCapsule"
    assert pool.stats().checked_out == 1
    t = torch.utils.dlpack.from_dlpack(cap)
    assert t.dtype == torch.bfloat16 and t.shape == (8, 2)
    assert pool.owns(t)
    del t, cap
    gc.collect()
    assert pool.stats().checked_out == 0 and pool.stats().releases == 1


def test_dlpack_protocol_object(pool):
    np = pytest.importorskip("numpy")
    buf = pool.acquire_dlpack((4, 3), torch.float32)
    assert buf.__dlpack_device__() == (1, 0) and not buf.exported
    t = torch.from_dlpack(buf)  # negotiates a versioned capsule
    assert buf.exported and t.shape == (4, 3) and pool.owns(t)
    with pytest.raises(BufferError, match="already exported"):
        buf.__dlpack__()
    t.fill_(2.0)
    a = np.from_dlpack(pool.acquire_dlpack((5,), torch.int32))
    assert a.shape == (5,) and a.dtype == np.int32
    assert pool.stats().checked_out == 2
    del t, a
    assert pool.stats().checked_out == 0
    legacy = pool.acquire_dlpack(8, torch.bfloat16).__dlpack__()  # no max_version: legacy
    assert 'dltensor"' in repr(legacy)
    del legacy
    with pytest.raises(BufferError, match="without copying"):
        pool.acquire_dlpack(8, torch.uint8).__dlpack__(copy=True)
    with pytest.raises(BufferError, match="lives on DLPack device"):
        pool.acquire_dlpack(8, torch.uint8).__dlpack__(dl_device=(2, 0))
    unexported = pool.acquire_dlpack(8, torch.uint8)
    assert pool.stats().checked_out == 1
    del unexported
    assert pool.stats().checked_out == 0


def test_unconsumed_capsule_returns_its_lease(pool):
    cap = pool._core.acquire_capsule([16], torch.float32)
    assert pool.stats().checked_out == 1
    del cap
    assert pool.stats().checked_out == 0


def test_tensor_outlives_pool_object():
    p = GatherBufferPool("cpu", budget_bytes=MiB)
    t = p.acquire((256,), torch.float32)
    del p
    gc.collect()
    t.fill_(1.0)  # memory still valid: the export keeps the pool alive
    assert float(t.sum()) == 256.0
    del t


# -- release contract ------------------------------------------------------------------------


def test_drop_returns_block(pool):
    t = pool.acquire((1024,), torch.float32)
    del t
    s = pool.stats()
    assert (s.checked_out, s.releases, s.idle_bytes) == (0, 1, 4096)


def test_explicit_release_then_drop_returns_once(pool):
    t = pool.acquire((1024,), torch.float32)
    pool.release(t)
    u = pool.acquire((1024,), torch.float32)  # re-leases the same block
    assert u.data_ptr() == t.data_ptr()
    del t  # the stale tensor's deleter must not return u's lease
    s = pool.stats()
    assert (s.checked_out, s.releases) == (1, 1)
    assert pool.owns(u)
    del u
    assert pool.stats().releases == 2


def test_double_release_is_typed_and_changes_nothing(pool):
    t = pool.acquire((64,), torch.float32)
    pool.release(t)
    before = pool.stats()
    with pytest.raises(E.DoubleReleaseError, match="already released"):
        pool.release(t)
    assert pool.stats() == before
    # Even after the block was re-leased to another tensor.
    u = pool.acquire((64,), torch.float32)
    before = pool.stats()
    with pytest.raises(E.DoubleReleaseError):
        pool.release(t)
    assert pool.stats() == before and pool.owns(u) and not pool.owns(t)


def test_stale_views_cannot_release_a_re_leased_block(pool):
    # [Note: stale holders]: the first release needs no owner key (no stale holder exists);
    # once one does, a checkout of its block records the new holder's key and every release of
    # that block is checked against it, whichever tensor or view presents it.
    t = pool.acquire((8, 8), torch.float32)
    v = t[2:, 1:]  # data_ptr inside the block: named through its storage
    pool.release(t)
    u = pool.acquire((8, 8), torch.float32)
    assert u.data_ptr() == t.data_ptr()
    before = pool.stats()
    for stale in (t, v, t[0], t.view(torch.int32)):
        with pytest.raises(E.DoubleReleaseError):
            pool.release(stale)
    assert pool.stats() == before and pool.owns(u) and not pool.owns(v)
    pool.release(u[1:])  # the holder's view releases it
    assert pool.stats().checked_out == 0
    assert pool._core._stale_holders() == 2  # t's and u's storages live on
    del t, v, stale
    assert pool._core._stale_holders() == 1
    w = pool.acquire((8, 8), torch.float32)  # u's storage still lives: checked again
    with pytest.raises(E.DoubleReleaseError):
        pool.release(u)
    pool.release(w)
    del u, w
    assert pool._core._stale_holders() == 0
    # No stale holder left: releases need no key again, and still return exactly once.
    x = pool.acquire((8, 8), torch.float32)
    pool.release(x)
    del x
    s = pool.stats()
    assert (s.checked_out, s.releases) == (0, 4)


def test_release_accepts_tensor_subclasses(pool):
    t = pool.acquire((16,), torch.float32)
    p = torch.nn.Parameter(t, requires_grad=False)  # same storage, another Python type
    assert type(p) is not torch.Tensor
    pool.release(p)
    assert pool.stats().checked_out == 0


def test_dlpack_export_next_to_a_stale_holder_is_unverifiable(pool):
    t = pool.acquire((64,), torch.float32)
    pool.release(t)  # t stays alive: a stale holder of the block
    x = torch.from_dlpack(pool.acquire_dlpack((64,), torch.float32))  # same block, no holder key
    assert x.data_ptr() == t.data_ptr()
    before = pool.stats()
    with pytest.raises(E.UnverifiableReleaseError, match="cannot verify"):
        pool.release(x)
    with pytest.raises(E.UnverifiableReleaseError, match="cannot verify"):
        pool.release(t)
    assert pool.stats() == before and not pool.owns(x)
    del t  # the stale holder dies: x can be told apart again
    assert pool.owns(x)
    pool.release(x)
    assert pool.stats().checked_out == 0
    del x
    assert pool.stats().releases == 2


def test_foreign_buffers_are_typed_errors(pool):
    other = GatherBufferPool("cpu", budget_bytes=MiB)
    t = other.acquire((64,), torch.float32)
    before = pool.stats()
    for foreign in (torch.empty(64), t, t.clone()):
        with pytest.raises(E.ForeignBufferError, match="not checked out from this pool"):
            pool.release(foreign)
    assert pool.stats() == before
    assert not pool.owns(torch.empty(3)) and not pool.owns(t)
    with pytest.raises(E.InvalidRequestError):
        pool.release("not a tensor")


def test_release_of_views_and_empty_tensors(pool):
    t = pool.acquire((8, 8), torch.float32)
    pool.release(t[2:, 1:])  # a view with an offset names the same block
    assert pool.stats().checked_out == 0
    z = pool.acquire((0, 4), torch.float32)
    assert pool.owns(z)
    pool.release(z)
    assert pool.stats().checked_out == 0


# -- sizing ----------------------------------------------------------------------------------


def test_over_budget_is_served_outside_and_freed(pool):
    pool.set_budget(MiB)
    a = pool.acquire((MiB // 4,), torch.float32)  # exactly the budget
    b = pool.acquire((1024,), torch.float32)  # does not fit: outside, still served
    s = pool.stats()
    assert (s.outside_allocations, s.outside_bytes, s.charged_bytes) == (1, 4096, MiB)
    pool.release(b)
    pool.release(a)
    s = pool.stats()
    assert (s.outside_bytes, s.idle_bytes, s.entries) == (0, MiB, 1)


def test_lru_eviction_to_make_room():
    p = GatherBufferPool("cpu", budget_bytes=3 * 4096, hard_cap_bytes=MiB)
    ts = [p.acquire((1024,), torch.float32) for _ in range(3)]
    ptrs = [t.data_ptr() for t in ts]
    for t in ts:
        p.release(t)  # released in order: ts[0] is least recently used
    big = p.acquire((2048,), torch.float32)  # needs 8 KiB: evicts the two LRU blocks
    s = p.stats()
    assert (s.evictions, s.entries) == (2, 2)
    kept = p.acquire((1024,), torch.float32)
    assert kept.data_ptr() == ptrs[2]
    del big, kept


def test_set_budget_clamps_to_hard_cap_and_trims(pool):
    assert pool.set_budget(10 << 30) == 256 * MiB
    t = pool.acquire((MiB,), torch.float32)
    pool.release(t)
    assert pool.set_budget(0) == 0
    assert pool.stats().idle_bytes == 0 and pool.stats().evictions == 1
    with pytest.raises(E.InvalidRequestError):
        pool.set_budget(-1)


def test_trim_frees_idle_blocks(pool):
    ts = [pool.acquire((MiB // 4,), torch.float32) for _ in range(3)]
    keep = ts.pop()
    for t in ts:
        pool.release(t)
    assert pool.trim() == 2 * MiB
    s = pool.stats()
    assert (s.idle_bytes, s.charged_bytes, s.entries) == (0, MiB, 1)
    del keep


def test_defaults_derive_from_host_memory():
    p = GatherBufferPool("cpu")
    free, total = p.memory_info()
    s = p.stats()
    assert s.hard_cap_bytes == total // _core.DEFAULT_HARD_CAP_DIVISOR
    assert s.budget_bytes == total // _core.DEFAULT_BUDGET_DIVISOR
    assert 0 < free <= total


def test_capacity_rounding(pool):
    assert pool.capacity_for(0) == 256
    assert pool.capacity_for(257) == 512


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "meta", "cpu:1", 3.5])
def test_invalid_devices(device):
    with pytest.raises(E.InvalidDeviceError):
        GatherBufferPool(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA driver")
def test_cuda_without_driver_is_a_clean_error():
    with pytest.raises(E.NoCudaDriverError, match="libcuda"):
        GatherBufferPool("cuda")
    with pytest.raises(E.NoCudaDriverError):
        GatherBufferPool("cuda:1")


@pytest.mark.parametrize("kwargs", [dict(budget_bytes=-1), dict(hard_cap_bytes=0),
                                    dict(budget_bytes=2 * MiB, hard_cap_bytes=MiB),
                                    dict(budget_bytes=1.5), dict(event_log_capacity=-1),
                                    dict(recovery_retry_threshold=0)])
def test_invalid_sizes(kwargs):
    with pytest.raises(E.InvalidRequestError):
        GatherBufferPool("cpu", **kwargs)


def test_invalid_requests(pool):
    with pytest.raises(E.UnsupportedDtypeError, match="cannot be exported"):
        pool.acquire((4,), torch.float8_e4m3fn)
    with pytest.raises(E.InvalidRequestError, match="negative"):
        pool.acquire((4, -1), torch.float32)
    for bad in (("a",), "ab", None, 2.5, [1, "x"]):
        with pytest.raises(E.InvalidRequestError, match="must be an int or a sequence of ints"):
            pool.acquire(bad, torch.float32)
    with pytest.raises(E.UnsupportedDtypeError):
        pool.acquire(4, "float32")
    assert pool.acquire([2, 3], torch.float32).shape == (2, 3)
    assert pool.acquire(torch.Size([4]), torch.float32).shape == (4,)
    assert pool.acquire(5, torch.float32).shape == (5,)
    with pytest.raises(E.InvalidRequestError, match="fit in memory"):
        pool.acquire((1 << 40, 1 << 40), torch.float32)
    assert pool.stats().checked_out == 0


def test_out_of_memory_is_typed_and_consistent(pool):
    t = pool.acquire((1024,), torch.float32)
    pool.release(t)
    assert pool._inject_oom(1)
    u = pool.acquire((4096,), torch.float32)  # fails once, frees idle blocks, retries
    s = pool.stats()
    assert (s.alloc_failures, s.evictions, s.idle_bytes) == (1, 1, 0)
    pool._inject_oom(2)
    with pytest.raises(E.PoolOutOfMemoryError, match="out of memory") as ei:
        pool.acquire((4096,), torch.float32)
    assert isinstance(ei.value, MemoryError)
    s = pool.stats()
    assert (s.checked_out, s.alloc_failures, s.charged_bytes) == (1, 3, 16384)
    del u
    assert [e["kind"] for e in pool.events()].count("out_of_memory") == 3


def test_every_error_is_a_pool_error():
    for name in E.__all__:
        assert issubclass(getattr(E, name), E.PoolError)


def test_errors_are_the_extension_classes_with_their_bases():
    # The bindings raise these classes by type (rust/python/errors.rs); zbuf.errors re-exports
    # them with the bases users catch.
    bases = {"PoolError": (RuntimeError,), "ForeignBufferError": (E.PoolError, ValueError),
             "DoubleReleaseError": (E.PoolError,), "UnverifiableReleaseError": (E.PoolError,),
             "PoolOutOfMemoryError": (E.PoolError, MemoryError), "NoCudaDriverError": (E.PoolError,),
             "InvalidDeviceError": (E.PoolError, ValueError),
             "InvalidRequestError": (E.PoolError, ValueError),
             "UnsupportedDtypeError": (E.PoolError, TypeError), "PoolBackendError": (E.PoolError,)}
    assert sorted(bases) == sorted(E.__all__)
    for name, want in bases.items():
        cls = getattr(E, name)
        assert cls is getattr(_core, name)
        assert cls.__bases__ == want and (cls.__module__, cls.__qualname__) == ("zbuf.errors", name)
        assert cls.__doc__


@pytest.mark.parametrize("call", [lambda p: p.set_budget(None), lambda p: p.set_budget(True),
                                  lambda p: p.set_budget(2.0), lambda p: p.observe_pressure(-1, 0, 0),
                                  lambda p: p.set_reclaim_hook(3)])
def test_invalid_method_arguments(pool, call):
    with pytest.raises(E.InvalidRequestError):
        call(pool)


# -- pressure and recovery -------------------------------------------------------------------


def test_pressure_shrinks_then_recovers_once(pool):
    hot = pool.acquire((MiB // 4,), torch.float32)
    cold = pool.acquire((MiB // 2,), torch.float32)
    pool.release(cold)
    assert pool.observe_pressure(10, 8 * MiB, 80 * MiB) == "none"  # baseline
    assert pool.observe_pressure(11, 8 * MiB, 80 * MiB) == "shrink"
    assert pool.stats().budget_bytes == 2 * MiB
    assert pool.observe_pressure(13, 8 * MiB, 80 * MiB) == "recover"
    s = pool.stats()
    assert s.recovering and s.idle_bytes == 0 and s.pressure_events == 2
    assert pool.hot_set() == {MiB: 1}
    during = pool.acquire((MiB // 4,), torch.float32)
    assert pool.stats().outside_bytes == MiB
    del during
    pool.release(hot)
    s = pool.stats()
    assert not s.recovering and s.recovered and s.entries == 0
    # Readmission: the hot capacity is pooled again, the cold one is not.
    a = pool.acquire((MiB // 4,), torch.float32)
    b = pool.acquire((MiB // 2,), torch.float32)
    s = pool.stats()
    assert (s.entries, s.outside_bytes) == (1, 2 * MiB)
    assert pool.observe_pressure(20, 8 * MiB, 80 * MiB) == "shrink"  # never a second recovery
    kinds = [e["kind"] for e in pool.events()]
    assert kinds.count("recovery_start") == 1 and kinds.count("recovery_end") == 1
    del a, b
    with pytest.raises(E.InvalidRequestError):
        pool.observe_pressure(1, 10, 5)


def test_observe_torch_allocator_on_host_is_a_no_op(pool):
    assert pool.observe_torch_allocator() == "none"


# -- telemetry -------------------------------------------------------------------------------


def test_stats_and_bounded_event_log():
    p = GatherBufferPool("cpu", budget_bytes=MiB, event_log_capacity=5)
    for _ in range(10):
        p.release(p.acquire((16,), torch.float32))
    ev = p.events()
    assert len(ev) == 5
    assert [e["seq"] for e in ev] == list(range(15, 20))
    assert {e["kind"] for e in ev} <= {"hit", "release"}
    assert set(ev[0]) == {"seq", "kind", "nbytes", "ptr", "stream", "charged_bytes", "time_us"}
    assert {e["time_us"] for e in ev} == {0}  # untimed unless asked
    s = p.stats()
    assert isinstance(s, PoolStats) and s.high_water_bytes == 256 and s.hits == 9
    assert "GatherBufferPool(device='cpu'" in repr(p)
    p.time_events(True)
    p.release(p.acquire((16,), torch.float32))
    stamps = [e["time_us"] for e in p.events()[-2:]]
    assert 0 < stamps[0] <= stamps[1]


def test_default_pool_is_per_device_singleton():
    assert default_pool("cpu") is default_pool(torch.device("cpu"))


# -- threads ---------------------------------------------------------------------------------


def test_concurrent_acquire_release_from_threads(pool):
    errors = []
    barrier = threading.Barrier(4)

    def worker(k):
        try:
            barrier.wait()
            for i in range(500):
                t = pool.acquire((257 + (i % 5) * 64,), torch.int32)
                t.fill_(k)
                if int(t.min()) != k or int(t.max()) != k:
                    errors.append(f"thread {k}: buffer shared with another live lease")
                if i % 2:
                    pool.release(t)
                else:
                    del t
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    s = pool.stats()
    assert s.checked_out == 0 and s.releases == 2000 and s.hits + s.misses == 2000


def test_deleter_runs_on_another_thread(pool):
    ts = [pool.acquire((128,), torch.float32) for _ in range(8)]
    box = {"ts": ts}
    del ts

    def drop():
        box.clear()

    th = threading.Thread(target=drop)
    th.start()
    th.join()
    assert pool.stats().checked_out == 0


def test_deleter_runs_without_the_gil_on_a_foreign_thread(pool):
    """Calls the capsule's DLPack deleter the way a C++ consumer would: from another thread,
    through ctypes (which releases the GIL for the call), while this thread keeps using the
    pool. The lease must come back exactly once."""
    import ctypes

    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_SetName.restype = ctypes.c_int
    api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]
    deleter_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    managed = []
    for _ in range(32):
        cap = pool._core.acquire_capsule([64], torch.float32)
        ptr = api.PyCapsule_GetPointer(cap, b"dltensor_versioned")
        assert api.PyCapsule_SetName(cap, b"used_dltensor_versioned") == 0  # we own it now
        # DLManagedTensorVersioned: version (8 bytes), manager_ctx (8), deleter (8), ...
        deleter = deleter_type(ctypes.c_void_p.from_address(ptr + 16).value)
        managed.append((deleter, ptr))
        del cap
    assert pool.stats().checked_out == 32

    def run_deleters():
        for deleter, ptr in managed:
            deleter(ptr)

    th = threading.Thread(target=run_deleters)
    th.start()
    for _ in range(200):  # keep the GIL busy with pool traffic meanwhile
        pool.release(pool.acquire((128,), torch.float32))
    th.join(timeout=30)
    assert not th.is_alive(), "a deleter deadlocked"
    s = pool.stats()
    assert s.checked_out == 0 and s.releases == 232
