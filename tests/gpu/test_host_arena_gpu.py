"""Host arenas on CUDA ([Note: host arenas] in zbuf/host_arena.py): page-locked on a thread of
their own, their tensors take asynchronous copies both ways; collected, they are unlocked once
the copies that may use them have run."""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from zbuf.host_arena import HostArena

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_an_arena_locked_in_the_background_takes_async_copies_and_unlocks_when_collected():
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    with ThreadPoolExecutor(1) as pool:
        arena = pool.submit(HostArena, 64 << 20, device, (stream,)).result()
    assert arena.touch_seconds > 0 and arena.register_seconds > 0
    assert arena.touch_seconds + arena.register_seconds <= arena.lock_seconds
    source = torch.randn(1024, 4096, device=device)
    host = arena.carve(source.t())
    assert host.is_pinned() and host.stride() == source.t().stride()
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        host.copy_(source.t(), non_blocking=True)
        back = torch.empty_like(source.t())
        back.copy_(host, non_blocking=True)
    stream.synchronize()
    assert torch.equal(back, source.t())
    del arena
    gc.collect()
    # The view keeps the bytes, no longer locked.
    assert not host.is_pinned() and torch.equal(host, source.t().cpu())


def test_the_host_link_measures_a_plausible_speed():
    """A PCIe link moves between 1 GB/s and 1 TB/s each way ([Note: the measured host link])."""
    from zbuf.host_link import measure_host_link

    device = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.memory_allocated(device)
    speed = measure_host_link(device)
    assert 1e9 < speed.down < 1e12 and 1e9 < speed.up < 1e12, speed
    assert torch.cuda.memory_allocated(device) == before


def test_the_host_link_probe_reads_what_long_copies_move():
    """The probe's speed each way is within 20 % of what 1 GiB copies that way move once the
    link is busy ([Note: the measured host link]: one timed copy after a step of compute read
    half)."""
    from zbuf.host_arena import HostArena
    from zbuf.host_link import measure_host_link

    device = torch.device("cuda", torch.cuda.current_device())
    a = torch.randn(8192, 8192, device=device)
    for _ in range(20):  # a stretch of compute with the link idle, as a step has
        a = a @ a / a.norm()
    probe = measure_host_link(device)
    nbytes = 1 << 30
    arena = HostArena(nbytes, device)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    speeds = []
    for source, target in ((arena.memory, on_device), (on_device, arena.memory)):
        target.copy_(source, non_blocking=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):
            target.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        speeds.append(4 * nbytes / (start.elapsed_time(end) / 1e3))
    up, down = speeds
    assert 0.8 * up <= probe.up <= 1.25 * up and 0.8 * down <= probe.down <= 1.25 * down, (
        probe, speeds)


def test_a_probe_that_does_not_fit_measures_no_link(monkeypatch):
    """Out of host memory for the probe: 0, which every rank's agreement turns into a plan
    without offload."""
    from zbuf import host_link
    from zbuf.errors import PoolOutOfMemoryError

    def refuse(*_args, **_kwargs):
        raise PoolOutOfMemoryError("cuMemHostRegister: the host could not page-lock that much")

    monkeypatch.setattr(host_link, "HostArena", refuse)
    assert host_link.measure_host_link(torch.device("cuda", torch.cuda.current_device())) == (
        host_link.LinkSpeed(0.0, 0.0))
