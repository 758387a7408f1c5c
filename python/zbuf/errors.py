"""Exceptions raised by the gather-buffer pool.

One class per kind of failure; every message names the problem and the fix. The classes are
defined by the Rust extension (rust/python/errors.rs, which maps each Rust error kind onto one)
and re-exported here, where users import them from (their ``__module__`` says ``zbuf.errors``):

- ``PoolError(RuntimeError)``: the base of all of them;
- ``ForeignBufferError(PoolError, ValueError)``: a released tensor was never checked out from
  this pool (or is a view or copy of one);
- ``DoubleReleaseError(PoolError)``: a tensor's buffer was already returned;
- ``UnverifiableReleaseError(PoolError)``: ``release`` cannot tell a stale alias from the holder
  (``acquire_dlpack`` buffers only; the pool is unchanged);
- ``PoolOutOfMemoryError(PoolError, MemoryError)``: the device refused the allocation even
  after the pool freed its idle blocks;
- ``NoCudaDriverError(PoolError)``: no usable NVIDIA driver;
- ``InvalidDeviceError(PoolError, ValueError)``: the device string or ordinal is not usable;
- ``InvalidRequestError(PoolError, ValueError)``: a malformed request (shape, sizes, options);
- ``UnsupportedDtypeError(PoolError, TypeError)``: the dtype cannot be exported through DLPack;
- ``PoolBackendError(PoolError)``: the driver failed in a call other than allocation.
"""

from __future__ import annotations

from zbuf._core import (
    DoubleReleaseError,
    ForeignBufferError,
    InvalidDeviceError,
    InvalidRequestError,
    NoCudaDriverError,
    PoolBackendError,
    PoolError,
    PoolOutOfMemoryError,
    UnsupportedDtypeError,
    UnverifiableReleaseError,
)

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
