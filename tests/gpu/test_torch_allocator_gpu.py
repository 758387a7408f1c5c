"""Memory free in pieces serves a larger request under zbuf ([Note: torch's allocator grows in
place] in zbuf/memory/shared.py): sharing the device turns torch's expandable segments on unless
the user configured torch's allocator, whose settings then stand.

The case is the 14B parent placement's step-2 failure in small: holes, each in a segment that
still holds a live tensor, together twice the request and none as large, on a card with room
for half the request beside what torch holds. Each run is a process of its own, the setting
being torch's, process-wide.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist_utils import run_distributed  # noqa: E402

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MiB = 1 << 20
PIECE = 256 * MiB
PIECES = 4


def _request_beside_holes(rank, world):
    import torch

    from zbuf.memory import SharedMemory
    from zbuf.pool import GatherBufferPool

    device = torch.device("cuda", torch.cuda.current_device())
    mem = SharedMemory(GatherBufferPool("cuda", budget_bytes=64 * MiB))
    whole = [torch.empty(2 * PIECE, dtype=torch.uint8, device=device) for _ in range(PIECES)]
    del whole  # cached: each 2-piece block is split by the next two requests
    pairs = [(torch.empty(PIECE, dtype=torch.uint8, device=device),
              torch.empty(PIECE, dtype=torch.uint8, device=device)) for _ in range(PIECES)]
    live = [b for _, b in pairs]
    del pairs  # a hole of one piece beside each live piece
    held = torch.cuda.memory_reserved(device)
    mem.emulate_capacity(held + PIECE + mem.pool_share_bytes())
    try:
        request = torch.empty(2 * PIECE, dtype=torch.uint8, device=device)
        outcome = "fits"
        del request
    except torch.OutOfMemoryError:
        outcome = "out of memory"
    del live
    return {"outcome": outcome, "torch_allocator": mem.torch_allocator, "held": held,
            "expandable": any(s.get("is_expandable") for s in torch.cuda.memory_snapshot())}


def test_memory_free_in_pieces_serves_a_larger_request():
    (default,) = run_distributed(_request_beside_holes, 1, backend="nccl", timeout=300,
                                 env={"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": ""})
    assert default["torch_allocator"] == "expandable_segments:True (zbuf's)", default
    assert default["expandable"] and default["outcome"] == "fits", default
    assert default["held"] >= 2 * PIECES * PIECE, default

    # A user's own settings stand: without expandable segments the holes serve nothing larger.
    (users,) = run_distributed(_request_beside_holes, 1, backend="nccl", timeout=300,
                               env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert users["torch_allocator"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False", users
    assert not users["expandable"] and users["outcome"] == "out of memory", users
