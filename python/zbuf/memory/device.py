"""What the device has: its free memory, a user's cap on it, the host's memory and cores.

These are this rank's own readings; what every rank plans from is their agreement
(agreement.py), and what each quantity means in a step is the ledger's (ledger.py).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["user_capacity_bytes", "host_bytes", "host_share_bytes", "host_cores",
           "host_core_share", "local_free_bytes"]


def user_capacity_bytes(device: torch.device) -> Optional[int]:
    """The cap a user set on this process's CUDA memory with
    ``torch.cuda.set_per_process_memory_fraction`` (read back through
    ``torch.cuda.get_per_process_memory_fraction``), in bytes; None without one (or on the host).

    [Note: one cap for torch and the pool]
    torch's fraction caps its caching allocator only; the pool allocates beside it, so under a
    user's fraction F torch and the pool together could hold F of the card plus the pool.
    ``SharedMemory`` takes the user's cap
    as the capacity torch and the pool share ([Note: emulated capacity]): torch's fraction
    becomes ``(F * total - what the pool may hold) / total``, and follows the pool's share."""
    if device.type != "cuda":
        return None
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction >= 1.0:
        return None
    return int(fraction * torch.cuda.get_device_properties(device).total_memory)


def host_bytes(kind: str) -> int:
    """The host's available (``"free"``) or total memory, bytes."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available if kind == "free" else vm.total)
    except ImportError:
        pages = os.sysconf("SC_AVPHYS_PAGES" if kind == "free" else "SC_PHYS_PAGES")
        return int(pages * os.sysconf("SC_PAGE_SIZE"))


def _ranks_on_this_host() -> int:
    """The ranks sharing this host (``LOCAL_WORLD_SIZE``: [Note: ranks share the host])."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def host_share_bytes() -> int:
    """This rank's share of the host's available memory ([Note: ranks share the host])."""
    return host_bytes("free") // _ranks_on_this_host()


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_core_share() -> int:
    """This rank's share of those cores, one at least: the ranks of a host share them as they
    share its memory ([Note: ranks share the host])."""
    return max(1, host_cores() // _ranks_on_this_host())


def local_free_bytes(device: torch.device) -> int:
    """Memory this rank could still allocate (CPU: its share of the available host memory).

    CUDA: the driver's free bytes plus what the caching allocator holds unused (it hands that
    out first), and no more than ``set_per_process_memory_fraction`` leaves: the driver knows
    nothing of that cap, and a budget planned past it would turn into allocator retries.

    [Note: ranks share the host]
    CPU ranks on one host allocate from the same memory, so each plans with its share of what
    is available (``LOCAL_WORLD_SIZE``, set by torchrun and zbuf's launcher): with the whole of
    it each, every rank plans memory the others take, and the kernel kills a rank mid-step
    instead of the plan being refused.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        available = free + torch.cuda.memory_reserved(device) - allocated
        cap = torch.cuda.get_per_process_memory_fraction(device) * total
        return max(0, int(min(available, cap - allocated)))
    return host_share_bytes()
