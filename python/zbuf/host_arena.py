"""Host memory for the device's asynchronous copies: one allocation of exactly the bytes asked
for, page-locked once, carved into the copies' tensors.

[Note: host arenas]
An asynchronous copy between the device and host memory needs that memory page-locked. A pinned
tensor of its own (``pin_memory=True``) comes from torch's caching host allocator, which rounds
it up to a power of two and pins it with ``cudaHostAlloc`` on the calling thread: at qwen3-14b
the first step that sent blocks' activations to the host pinned about 40 GiB for 23.7 GiB moved,
and took 30.7 s (benches/results/onepath14.md). A ``HostArena`` is one host allocation of the
size asked for, page-locked by zbuf's extension ([Note: page-locked host ranges] in
rust/backend/cuda.rs: its pages faulted in by several threads, then registered, with the GIL
released, so it can be pinned on a background thread while Python works) and carved into
tensors of any size and stride, each at an ``ALIGN``-byte boundary. ``reset`` hands the same
bytes out again: a user of the arena that copies the same tensors every step pins once.

Its owner says which streams' copies may use it (``streams``): before the memory is unlocked
(when the arena is collected) the host waits for them, so no copy still in flight reads or
writes memory that is no longer locked. Tensors carved from it keep its bytes allocated after
that, as ordinary host memory. On the host (the CPU stand-in) nothing is locked: the same
carving, for tests.
"""

from __future__ import annotations

import time
import weakref
from typing import Iterable, Optional

import torch

from ._core import page_lock, page_unlock

__all__ = ["ALIGN", "HostArena", "aligned", "span_bytes"]

ALIGN = 256
"""Byte alignment of each carved tensor (what CUDA's copies like best)."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def span_bytes(like: torch.Tensor) -> int:
    """Bytes a tensor of ``like``'s size, stride and dtype spans."""
    if like.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(like.shape, like.stride()))) * like.element_size()


def _unlock(index: int, ptr: int, streams: tuple[torch.cuda.Stream, ...],
            _memory: torch.Tensor) -> None:
    """Wait for the copies that may use the arena, then unlock it (``_memory`` stays allocated
    until then: the finalizer holds it)."""
    for stream in streams:
        stream.synchronize()
    page_unlock(index, ptr)


class HostArena:
    """``nbytes`` of host memory, page-locked for ``device`` when it is a CUDA device (without
    an index: the calling thread's current one), its pages faulted in by ``touch_threads``
    threads (None: the extension's default) ([Note: host arenas])."""

    def __init__(self, nbytes: int, device: torch.device,
                 streams: Iterable[torch.cuda.Stream] = (),
                 touch_threads: Optional[int] = None) -> None:
        self.memory = torch.empty(nbytes, dtype=torch.uint8)
        self.used = 0
        """Bytes handed out since the last ``reset`` (their ends aligned up)."""
        self.lock_seconds = 0.0
        """Wall time the page-locking took (on whichever thread built the arena)."""
        self.touch_seconds = 0.0
        """Of it, faulting the pages in: what holds up the host's memory map (the page faults
        of every thread, the Python thread's among them)."""
        self.register_seconds = 0.0
        """Of it, registering them with the device: what holds up the driver's calls from
        other threads (benches/lock_contention.py)."""
        if device.type == "cuda" and nbytes > 0:
            index = torch.cuda.current_device() if device.index is None else device.index
            start = time.perf_counter()
            self.touch_seconds, self.register_seconds = page_lock(
                index, self.memory.data_ptr(), nbytes, touch_threads)
            self.lock_seconds = time.perf_counter() - start
            weakref.finalize(self, _unlock, index, self.memory.data_ptr(), tuple(streams),
                             self.memory)
        self.locked_at = time.perf_counter()
        """When the locking ended (``time.perf_counter``)."""

    @property
    def nbytes(self) -> int:
        return self.memory.numel()

    def carve(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        """A host tensor with ``like``'s size, stride and dtype from the bytes not handed out
        yet, or None when they are too few."""
        nbytes = span_bytes(like)
        start = aligned(self.used)
        if start + nbytes > self.nbytes:
            return None
        self.used = start + nbytes
        return (self.memory[start:start + nbytes].view(like.dtype)
                .as_strided(like.shape, like.stride()))

    def reset(self) -> None:
        """Hand the arena's bytes out again from its start."""
        self.used = 0
