"""The measured block forward on CUDA ([Note: the measured block forward] in
zbuf/compile/block_clock.py): the median gap between block starts is one block's device time,
whatever one slow gap (a compile, an allocation) held."""

from __future__ import annotations

import time

import pytest
import torch

from zbuf.compile.block_clock import BlockClock

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _block(x: torch.Tensor) -> torch.Tensor:
    for _ in range(8):
        x = x @ x
        x = x / x.norm()
    return x


def test_a_block_forward_is_the_median_gap_between_block_starts_of_the_last_forward():
    """... and the forward's tail, from the last block's start to the model's output (here the
    last block and two blocks' work after it), is three of them."""
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(2048, 2048, device=device)
    _block(x)
    one_start, one_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    one_start.record()
    _block(x)
    one_end.record()
    one_end.synchronize()
    expected = one_start.elapsed_time(one_end) / 1e3
    clock = BlockClock(device)
    assert clock.block_seconds() is None
    for forward in range(2):
        for block in range(7):
            clock.block_started()
            if forward == 1 and block == 2:
                torch.cuda.synchronize()
                time.sleep(0.2)  # the host held back once, as a compile would: the device idles
            _block(x)
        _block(_block(x))  # the model's own ops after its last block
        clock.forward_finished()
    measured = clock.block_seconds()
    assert 0.7 * expected <= measured <= 1.5 * expected, (measured, expected)
    assert 2.4 <= clock.tail_forwards() <= 3.6, clock.tail_forwards()
    clock.block_started()  # a forward that has begun leaves the last one's measurement alone
    assert clock.block_seconds() == measured

