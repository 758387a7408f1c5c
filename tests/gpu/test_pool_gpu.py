"""The gather-buffer pool on CUDA (cudarc backend): DLPack round trip, stream-ordered reuse
without host syncs, device memory accounting. Skips cleanly without a GPU."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import zbuf.errors as E
from zbuf.pool import GatherBufferPool

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MiB = 1 << 20
GiB = 1 << 30
# GPU cycles for torch.cuda._sleep: long enough (~0.5 s at ~2 GHz) that an unordered write on
# another stream lands before the delayed reader runs.
SLEEP_CYCLES = 1_000_000_000


@pytest.fixture
def pool():
    torch.cuda.init()
    p = GatherBufferPool("cuda", budget_bytes=4 * GiB, hard_cap_bytes=8 * GiB)
    yield p
    torch.cuda.synchronize()


def test_dlpack_round_trip(pool):
    t = pool.acquire((1024, 1024), torch.bfloat16)
    assert t.device == torch.device("cuda", torch.cuda.current_device())
    assert t.dtype == torch.bfloat16 and t.is_contiguous() and t.data_ptr() % 512 == 0
    ref = torch.randn(1024, 1024, device="cuda").to(torch.bfloat16)
    t.copy_(ref)
    assert torch.equal(t, ref)
    assert pool.owns(t)
    ptr = t.data_ptr()
    pool.release(t)
    u = pool.acquire((512, 1024), torch.float32)  # same bytes, other dtype: same block
    assert u.data_ptr() == ptr
    for versioned in (True, False):
        cap = pool._core.acquire_capsule([4, 4], torch.float32, None, versioned)
        v = torch.utils.dlpack.from_dlpack(cap)
        assert v.is_cuda and v.shape == (4, 4)
        v.fill_(3.0)
        assert float(v.sum()) == 48.0
        del v, cap
    del u
    gc.collect()
    torch.cuda.synchronize()
    assert pool.stats().checked_out == 0


def test_dlpack_protocol_orders_the_consumer_stream(pool):
    n = 4 * MiB
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    a = pool.acquire((n,), torch.float32, stream=side)
    ptr = a.data_ptr()
    result = _delayed_consumer(a, side)
    pool.release(a, stream=side)  # no host sync: the consumer is still sleeping
    # [Note: release contract] in pool.py: a DLPack export records no holder key, so an explicit
    # release of its import is verifiable only once no released tensor of the same memory lives.
    # Drop the stale `a` first (the steady state of a training step); the kernels already queued
    # on `side` keep their ordering through the release event, not through `a`.
    del a
    # Acquired for `side`, consumed on `other`: __dlpack__(stream=other) makes `other` wait.
    buf = pool.acquire_dlpack((n,), torch.float32, stream=side)
    with torch.cuda.stream(other):
        b = torch.from_dlpack(buf)
        assert b.data_ptr() == ptr
        b.fill_(5.0)
    torch.cuda.synchronize()
    assert float(result) == float(n), "the DLPack consumer wrote before the previous user ran"
    pool.release(b, stream=other)
    assert pool.stats().checked_out == 0


def test_dlpack_import_release_with_a_stale_tensor_alive(pool):
    """The other half of the contract: while a released tensor of the same memory lives, an
    explicit release of a DLPack import cannot tell the two apart and is refused, pool
    unchanged; dropping the import returns the block."""
    n = 1 * MiB
    a = pool.acquire((n,), torch.float32)
    pool.release(a)
    b = torch.from_dlpack(pool.acquire_dlpack((n,), torch.float32))
    assert b.data_ptr() == a.data_ptr()
    with pytest.raises(E.UnverifiableReleaseError, match="cannot verify"):
        pool.release(b)
    assert pool.stats().checked_out == 1
    del b
    gc.collect()
    assert pool.stats().checked_out == 0


def _delayed_consumer(buf: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    """On `stream`: fill `buf` with 1, sleep on the GPU, then sum it (the delayed reader)."""
    with torch.cuda.stream(stream):
        buf.fill_(1.0)
        torch.cuda._sleep(SLEEP_CYCLES)
        return buf.sum()


def test_stream_ordered_reuse_without_sync(pool):
    n = 4 * MiB
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    a = pool.acquire((n,), torch.float32, stream=side)
    result = _delayed_consumer(a, side)
    pool.release(a, stream=side)  # no host sync: the consumer is still sleeping
    with torch.cuda.stream(other):
        b = pool.acquire((n,), torch.float32)  # reuses the block on another stream...
        assert b.data_ptr() == a.data_ptr()
        b.fill_(5.0)  # ...so this write must wait for the consumer on the device
    torch.cuda.synchronize()
    assert float(result) == float(n), "the reused block was overwritten before its consumer ran"
    pool.release(b, stream=other)


def test_stream_test_has_teeth(pool):
    """Control: the same race without the pool's ordering corrupts the consumer's result, so
    the test above would fail if acquire did not make the new stream wait."""
    n = 4 * MiB
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    a = pool.acquire((n,), torch.float32, stream=side)
    result = _delayed_consumer(a, side)
    with torch.cuda.stream(other):
        a.fill_(5.0)  # unordered write on another stream
    torch.cuda.synchronize()
    assert float(result) != float(n)
    pool.release(a, stream=side)


def test_deleter_release_is_stream_ordered(pool):
    n = 4 * MiB
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    a = pool.acquire((n,), torch.float32, stream=side)
    ptr = a.data_ptr()
    result = _delayed_consumer(a, side)
    del a  # the deleter releases on the acquire stream (side)
    with torch.cuda.stream(other):
        b = pool.acquire((n,), torch.float32)
        assert b.data_ptr() == ptr
        b.fill_(5.0)
    torch.cuda.synchronize()
    assert float(result) == float(n)
    del b


def test_stale_holders_on_cuda(pool):
    # rust/pool/mod.rs [Note: stale holders] with device pointers and a non-default stream.
    t = pool.acquire((256, 1024), torch.float32)
    v = t[1:]
    pool.release(t)  # no stale holder existed: released without an owner key
    u = pool.acquire((256, 1024), torch.float32)  # same block, new holder's key recorded
    assert u.data_ptr() == t.data_ptr()
    before = pool.stats()
    for stale in (v, t):
        with pytest.raises(E.DoubleReleaseError):
            pool.release(stale)
    assert pool.stats() == before
    side = torch.cuda.Stream()
    pool.release(u[2:], stream=side)
    assert pool.stats().checked_out == 0
    del t, v, u, stale
    assert pool._core._stale_holders() == 0
    torch.cuda.synchronize()


def test_pool_memory_visible_in_mem_get_info_and_freed_by_trim(pool):
    torch.cuda.synchronize()
    free0, total = pool.memory_info()
    t = pool.acquire((GiB,), torch.uint8)
    free1, _ = pool.memory_info()
    assert free0 - free1 >= GiB, (free0, free1)
    torch_free, torch_total = torch.cuda.mem_get_info()
    assert torch_total == total and torch_free <= free0 - GiB + 64 * MiB
    pool.release(t)
    assert pool.stats().idle_bytes == GiB  # cached, still held
    assert free0 - pool.memory_info()[0] >= GiB
    assert pool.trim() == GiB
    free2, _ = pool.memory_info()
    assert free2 >= free0 - 64 * MiB, (free0, free2)
    assert pool.stats().charged_bytes == 0


def test_cross_thread_deleter(pool):
    ts = [pool.acquire((MiB,), torch.float32) for _ in range(8)]
    box = {"ts": ts}
    del ts
    th = threading.Thread(target=box.clear)
    th.start()
    th.join()
    assert pool.stats().checked_out == 0


def test_observe_torch_allocator(pool):
    assert pool.observe_torch_allocator() == "none"  # first call: baseline
    assert pool.observe_torch_allocator() in ("none", "shrink", "recover")


def test_errors_on_cuda(pool):
    n = torch.cuda.device_count()
    with pytest.raises(E.InvalidDeviceError, match="does not exist"):
        GatherBufferPool(f"cuda:{n}")
    assert pool._inject_oom(1) is False  # fault injection is a host-backend feature
    total = pool.memory_info()[1]
    big = GatherBufferPool("cuda", budget_bytes=0, hard_cap_bytes=total)
    with pytest.raises(E.PoolOutOfMemoryError):
        big.acquire((2 * total,), torch.uint8)
    assert big.stats().checked_out == 0
    with pytest.raises(E.ForeignBufferError):
        pool.release(torch.empty(16, device="cuda"))
    with pytest.raises(E.InvalidRequestError, match="not a torch.cuda.Stream"):
        pool.acquire(4, torch.float32, stream="side")
    t = pool.acquire(4, torch.float32, stream=torch.cuda.current_stream().cuda_stream)
    pool.release(t, stream=torch.cuda.current_stream())
