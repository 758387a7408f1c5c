"""Exceptions raised by the gather-buffer pool.

One class per kind of failure; every message names the problem and the fix. The Rust core
(`zbuf._core`) raises these classes by name, so renaming one here is a breaking change.
"""

from __future__ import annotations

__all__ = [
    "PoolError",
    "ForeignBufferError",
    "DoubleReleaseError",
    "UnverifiableReleaseError",
    "PoolOutOfMemoryError",
    "NoCudaDriverError",
    "InvalidDeviceError",
    "InvalidRequestError",
    "UnsupportedDtypeError",
    "PoolBackendError",
]


class PoolError(RuntimeError):
    """Base class of every gather-buffer pool error."""


class ForeignBufferError(PoolError, ValueError):
    """A released tensor was never checked out from this pool (or is a view or copy of one)."""


class DoubleReleaseError(PoolError):
    """A tensor's buffer was already returned (by `release` or by the tensor being freed)."""


class UnverifiableReleaseError(PoolError):
    """`release` cannot tell whether the tensor holds its block or is a stale alias of it.

    Only for buffers from `acquire_dlpack` (which records no holder) while a tensor released
    earlier from the same memory is still alive; the pool is unchanged, and dropping the tensor
    still returns the block."""


class PoolOutOfMemoryError(PoolError, MemoryError):
    """The device refused the allocation even after the pool freed all its idle blocks.

    The pool's state is consistent afterwards; the request simply failed."""


class NoCudaDriverError(PoolError):
    """A CUDA pool was requested on a machine without a usable NVIDIA driver."""


class InvalidDeviceError(PoolError, ValueError):
    """The device string or ordinal is not usable (malformed, or no such GPU)."""


class InvalidRequestError(PoolError, ValueError):
    """A malformed request: negative or overflowing shape, bad sizes or options."""


class UnsupportedDtypeError(PoolError, TypeError):
    """The dtype cannot be exported through DLPack by the pool."""


class PoolBackendError(PoolError):
    """The device driver failed in a call other than allocation (e.g. recording an event)."""
