"""One device, two allocators on CUDA ([Note: one memory, two allocators] in
zbuf/memory/shared.py): the pool takes torch's unused cache back when the device refuses it a
block, and torch's out-of-memory observer makes the pool give its idle blocks back. Skips cleanly
without a GPU.

Each test fills the device on purpose; it frees everything it took before it ends.
"""

from __future__ import annotations

import gc

import pytest
import torch

import zbuf.errors as E
from zbuf.memory import SharedMemory
from zbuf.pool import GatherBufferPool

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GiB = 1 << 30


@pytest.fixture
def clean_device():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _fill_torch_cache(leave_free: int) -> int:
    """Make torch reserve all but ``leave_free`` bytes of the device, then free the tensor: the
    memory stays in torch's cache, unused. Returns the cached bytes."""
    free, _ = torch.cuda.mem_get_info()
    big = torch.empty(free - leave_free, dtype=torch.uint8, device="cuda")
    del big
    return torch.cuda.memory_reserved()


def test_the_pool_takes_torch_unused_cache_back(clean_device):
    total = torch.cuda.get_device_properties(0).total_memory
    pool = GatherBufferPool("cuda", budget_bytes=8 * GiB, hard_cap_bytes=total // 2)
    mem = SharedMemory(pool)
    cached = _fill_torch_cache(leave_free=1 * GiB)
    assert cached > 4 * GiB
    # 2 GiB do not fit the 1 GiB the driver has left: the pool's own retry frees nothing (no idle
    # blocks), the reclaim hook empties torch's cache, the retry succeeds.
    t = pool.acquire((2 * GiB,), torch.uint8)
    t.fill_(7)
    assert mem.events.reclaims == 1 and torch.cuda.memory_reserved() < cached
    pool.release(t)
    pool.trim()
    # Without the hook, the same request fails with the pool's error.
    pool.set_reclaim_hook(None)
    _fill_torch_cache(leave_free=1 * GiB)
    with pytest.raises(E.PoolOutOfMemoryError):
        pool.acquire((2 * GiB,), torch.uint8)


def test_a_torch_out_of_memory_makes_the_pool_give_its_idle_blocks_back(clean_device):
    free, total = torch.cuda.mem_get_info()
    pool = GatherBufferPool("cuda", budget_bytes=total // 2, hard_cap_bytes=total // 2)
    mem = SharedMemory(pool)
    blocks = [pool.acquire((GiB,), torch.uint8) for _ in range(int(0.4 * free) // GiB)]
    for b in blocks:
        pool.release(b)
    del blocks
    idle = pool.stats().idle_bytes
    assert idle >= 0.3 * free
    want = torch.cuda.mem_get_info()[0] + idle // 2  # fits only if the pool lets go
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(want, dtype=torch.uint8, device="cuda")
    assert (mem.events.torch_ooms, mem.events.torch_ooms_with_idle_pool) == (1, 1)
    assert pool.stats().idle_bytes == 0
    x = torch.empty(want, dtype=torch.uint8, device="cuda")  # the caller's retry now fits
    del x
