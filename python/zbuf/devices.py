"""One name per device: ``torch.device("cuda")`` names whichever CUDA device is current when it is
used, so everything zbuf keeps or compares carries the index.

A shard's device carries its index (``torch.device("cuda", i)``), and ``torch.device("cuda") !=
torch.device("cuda", 0)``: an offload given the unindexed name once matched no parameter and
streamed nothing. So every place that takes a device from a user, or makes one for the current
CUDA device, names it through ``indexed``.
"""

from __future__ import annotations

import torch

__all__ = ["indexed", "current_cuda"]


def indexed(device: torch.device | str) -> torch.device:
    """``device`` with its index: an unindexed CUDA device is the current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return current_cuda()
    return device


def current_cuda() -> torch.device:
    """The current CUDA device, indexed."""
    return torch.device("cuda", torch.cuda.current_device())
