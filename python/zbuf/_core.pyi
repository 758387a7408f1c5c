"""Type stub of the Rust extension `zbuf._core` (rust/python/). Use `zbuf.pool` instead: this
is the thin layer under `GatherBufferPool`."""

from typing import Any, Sequence, final

import torch

DLPACK_VERSION: tuple[int, int]
"""DLPack ABI version of the exported capsules."""
DEFAULT_BUDGET_DIVISOR: int
"""Default budget = total device (or host) memory // this."""
DEFAULT_HARD_CAP_DIVISOR: int
"""Default hard cap = total device (or host) memory // this."""

# The pool's exceptions (rust/python/errors.rs; re-exported by zbuf.errors, whose __module__
# they carry).
class PoolError(RuntimeError): ...
class ForeignBufferError(PoolError, ValueError): ...
class DoubleReleaseError(PoolError): ...
class UnverifiableReleaseError(PoolError): ...
class PoolOutOfMemoryError(PoolError, MemoryError): ...
class NoCudaDriverError(PoolError): ...
class InvalidDeviceError(PoolError, ValueError): ...
class InvalidRequestError(PoolError, ValueError): ...
class UnsupportedDtypeError(PoolError, TypeError): ...
class PoolBackendError(PoolError): ...

def page_lock(device_index: int, ptr: int, nbytes: int,
              touch_threads: int | None = None) -> tuple[float, float]:
    """Page-locks the host range ``ptr .. ptr + nbytes`` (memory the caller keeps allocated until
    ``page_unlock``) for ``cuda:device_index``, its pages first faulted in by ``touch_threads``
    threads (default: the machine's cores, at most 8), the GIL released throughout ([Note:
    page-locked host ranges] in rust/backend/cuda.rs). Contents are unchanged. Returns the
    seconds the touching and the registration took.
    NoCudaDriverError without a driver; PoolOutOfMemoryError when the host cannot lock that
    much; InvalidRequestError for an empty range or no touch thread."""
def page_unlock(device_index: int, ptr: int) -> None:
    """Undoes ``page_lock`` at ``ptr``; every copy that used the range must have completed."""

@final
class PoolCore:
    """One gather-buffer pool over the host or CUDA backend. Errors are the classes above; the
    arguments of every method are checked here (InvalidRequestError / InvalidDeviceError)."""

    def __init__(
        self,
        device_type: str,
        index: int = 0,
        budget_bytes: int | None = None,
        hard_cap_bytes: int | None = None,
        event_log_capacity: int = 4096,
        recovery_retry_threshold: int = 3,
    ) -> None: ...
    @property
    def device(self) -> tuple[str, int]:
        """(device_type, index)."""
    def acquire(self, shape: Sequence[int] | int, dtype: torch.dtype, stream: Any = None) -> torch.Tensor:
        """Checks out a block as a contiguous tensor (zero copy). `stream`: a torch.cuda.Stream,
        a raw handle, or None for the current stream (ignored on the host)."""
    def acquire_capsule(
        self, shape: Sequence[int] | int, dtype: torch.dtype, stream: Any = None, versioned: bool = True
    ) -> Any:
        """Checks out a block as a DLPack capsule ("dltensor_versioned" or legacy "dltensor")."""
    def acquire_buffer(self, shape: Sequence[int] | int, dtype: torch.dtype, stream: Any = None) -> DLPackBuffer:
        """Checks out a block as a DLPack protocol object."""
    def release(self, tensor: torch.Tensor, stream: Any = None) -> None:
        """Returns the block of `tensor` (or of the tensor it is a view of). Raises
        ForeignBufferError, DoubleReleaseError, UnverifiableReleaseError."""
    def owns(self, tensor: torch.Tensor) -> bool: ...
    def set_budget(self, nbytes: int) -> int:
        """Sets the budget (clamped to the hard cap); returns the effective value."""
    def set_floor(self, nbytes: int) -> int:
        """Sets the floor the pressure policy never shrinks the budget below (clamped to the
        hard cap); returns the effective value. A new floor after the recovery began ends its
        hot-set admission."""
    def set_reclaim_hook(self, hook: Any) -> None:
        """`hook(nbytes)` runs (pool unlocked) when the device refuses an acquire even after the
        pool freed its idle blocks; the acquire is then retried once. None removes it."""
    def trim(self) -> int: ...
    def observe_pressure(self, num_alloc_retries: int, free_bytes: int, total_bytes: int) -> tuple[str, int]:
        """Returns (action, budget_bytes); action is "none", "shrink" or "recover"."""
    def stats(self) -> dict[str, int | bool]: ...
    def events(self) -> list[dict[str, int | str]]: ...
    def time_events(self, on: bool) -> None: ...
    def hot_set(self) -> list[tuple[int, int]]: ...
    def memory_info(self) -> tuple[int, int] | None: ...
    def capacity_for(self, nbytes: int) -> int: ...
    def _bench_core_pair(self, nbytes: int, iters: int, stream: int) -> float:
        """Mean ns of an acquire+release pair through the Rust core alone."""
    def _inject_oom(self, count: int) -> bool:
        """Testing hook: the next `count` allocations fail (host backend only)."""
    def _stale_holders(self) -> int:
        """Testing hook: explicitly released tensors whose storage is still alive."""

@final
class DLPackBuffer:
    """A checked-out block not yet handed to a consumer; exports once, returns its lease if
    dropped unexported."""

    def __dlpack_device__(self) -> tuple[int, int]: ...
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    @property
    def exported(self) -> bool: ...
