"""Torch-facing gather-buffer pool.

`GatherBufferPool` hands out torch tensors that are zero-copy views of byte blocks owned by the
Rust pool (`zbuf._core.PoolCore`, see rust/pool/mod.rs for the policy notes). It adds what only
Python knows: torch dtypes and devices, the current CUDA stream, and the caching allocator's
telemetry.

[Note: release contract]
A tensor from `acquire` goes back to the pool exactly once, whichever comes first:
* `pool.release(t)`: the block is reusable at once (stream-ordered: the next user on another
  stream waits for this release on the device), even though `t` still exists. Compiled graphs
  rely on this. `t` (and its views) must not be used afterwards: its memory belongs to the next
  acquirer.
* the last reference to `t`'s storage dying (the DLPack deleter), for tensors never released.
The deleter releases on the acquire stream: a tensor used on other streams must be released
explicitly with the last stream that used it (the pool never calls `record_stream`).
Releasing twice raises `DoubleReleaseError`, releasing a tensor from elsewhere
`ForeignBufferError`; both leave the pool unchanged (a stale tensor is recognised even after
its block was re-leased: rust/pool/mod.rs, [Note: stale holders]). `release` takes the tensor
`acquire` returned or any view of it. The stale-tensor check costs a torch call only while a
released tensor is still alive; the rest of the time a release costs one `data_ptr()` call
plus the pool's bookkeeping. (A buffer from `acquire_dlpack` records no holder: releasing it
explicitly while a released tensor of the same memory lives raises
`UnverifiableReleaseError`, pool unchanged; dropping it always works.)
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Sequence

import torch
from torch.profiler import record_function

from ._core import DLPackBuffer, PoolCore
from .devices import current_cuda
from .errors import InvalidDeviceError, InvalidRequestError
from .kept_weights import KeptWeights

__all__ = ["GatherBufferPool", "PoolStats", "default_pool"]

@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's accounting.

    A *pool block* is memory the pool owns and caches (charged to the budget); an *outside*
    allocation serves a request the budget cannot hold and is freed on release.
    """

    budget_bytes: int
    """Bytes the pool may keep in its own blocks (after pressure shrinks and `set_budget`)."""
    hard_cap_bytes: int
    """The budget never exceeds this."""
    floor_bytes: int
    """The pressure policy never shrinks the budget below this (`set_floor`)."""
    charged_bytes: int
    """Bytes of pool blocks, idle + checked out."""
    idle_bytes: int
    """Bytes of idle pool blocks, cached for reuse."""
    checked_out_bytes: int
    """Bytes of checked-out pool blocks."""
    outside_bytes: int
    """Bytes of checked-out outside allocations."""
    pending_free_bytes: int
    """Bytes freed by the pool that wait for their release event before going back to the device."""
    high_water_bytes: int
    """Highest `charged_bytes` so far."""
    high_water_total_bytes: int
    """Highest `charged_bytes + outside_bytes` so far."""
    entries: int
    """Number of pool blocks (idle + checked out)."""
    checked_out: int
    """Number of live leases (pool blocks and outside allocations)."""
    hits: int
    """Acquires served by an idle block."""
    misses: int
    """Acquires served by a new allocation (pool block or outside)."""
    evictions: int
    """Pool blocks freed: LRU eviction, budget shrink, `trim`, retired blocks returning."""
    allocations: int
    """Successful device allocations (pool blocks + outside)."""
    outside_allocations: int
    """The subset of `allocations` made outside the pool."""
    releases: int
    """Leases returned (explicitly or by a tensor's deleter)."""
    alloc_failures: int
    """Allocations the device refused (each acquire retries once after freeing idle blocks)."""
    pressure_events: int
    """Pressure observations that saw the allocator's retry counter rise."""
    recovering: bool
    """The one-shot recovery is draining the blocks checked out when it started."""
    recovered: bool
    """The recovery has finished; only the recorded hot set is admitted to the pool."""


def _parse_device(device: Any) -> tuple[str, int]:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidDeviceError(
            f"device {device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'"
        ) from e
    if dev.type == "cpu":
        return "cpu", 0 if dev.index is None else dev.index  # the core refuses cpu:N, N > 0
    if dev.type == "cuda":
        if dev.index is not None:
            return "cuda", dev.index
        return "cuda", current_cuda().index if torch.cuda.is_available() else 0
    raise InvalidDeviceError(
        f"device {device!r} is not supported by the gather-buffer pool: use 'cpu', 'cuda' or 'cuda:N'"
    )


class GatherBufferPool:
    """A per-device pool of gather buffers (see the module notes).

    Args:
        device: "cpu" (host backend), "cuda" (the current CUDA device) or "cuda:N".
        budget_bytes: bytes the pool may keep in its own blocks. None: total device memory / 32
            (host RAM / 32 on "cpu"), clamped to the hard cap. The scheduler usually resets it
            from its plan with `set_budget`.
        hard_cap_bytes: upper bound of the budget. None: total device memory / 4 (host RAM / 4).
        event_log_capacity: telemetry events kept (oldest dropped first); 0 disables the log.
        recovery_retry_threshold: allocator retries (seen by `observe_*`) that start the one-shot
            recovery.
    """

    # [Note: hot-path methods]
    # `acquire` and `release` are the Rust methods themselves, bound per instance into slots:
    # a Python wrapper around them cost about 0.5 us per acquire+release pair (measured with
    # benches/pool_bench.py when the wrapper existed), a fifth of the whole path then.
    # Arguments are validated in Rust, as are those of the other methods that reach the core
    # (one layer checks). (No `record_function` here either:
    # it would cost more than the call; the custom ops that call them carry the labels.)
    # Their docs:
    #
    # acquire(shape, dtype, stream=None) -> torch.Tensor
    #     A contiguous tensor of `shape` (int or sequence of ints) and `dtype` backed by a pool
    #     block: zero copy, a fresh lease, contents undefined. `stream` (a torch.cuda.Stream or
    #     raw handle; default the current stream) is where it is used first: if the block was
    #     last released on another stream, that stream now waits for the release on the device
    #     (no host sync). Raises UnsupportedDtypeError, InvalidRequestError,
    #     PoolOutOfMemoryError.
    # release(tensor, stream=None) -> None
    #     Returns the block of `tensor` (or of the tensor it is a view of) now; see [Note:
    #     release contract]. `stream`: the last stream that used it (default: the current
    #     stream). Raises ForeignBufferError / DoubleReleaseError (UnverifiableReleaseError for
    #     `acquire_dlpack` buffers, see the note), leaving the pool unchanged.
    __slots__ = ("_core", "device", "acquire", "release", "_budget_observer", "kept",
                 "gather_stream", "__weakref__")
    acquire: Callable[..., torch.Tensor]
    release: Callable[..., None]

    def __init__(
        self,
        device: str | torch.device = "cpu",
        budget_bytes: int | None = None,
        hard_cap_bytes: int | None = None,
        *,
        event_log_capacity: int = 4096,
        recovery_retry_threshold: int = 3,
    ) -> None:
        kind, index = _parse_device(device)
        # The core checks the sizes and options (InvalidRequestError), once.
        self._core = PoolCore(
            kind, index, budget_bytes, hard_cap_bytes, event_log_capacity, recovery_retry_threshold
        )
        self.device = torch.device(kind, index) if kind == "cuda" else torch.device("cpu")
        self.acquire = self._core.acquire  # [Note: hot-path methods]
        self.release = self._core.release
        self._budget_observer: Callable[[int], object] | None = None
        self.kept = KeptWeights()
        """The gathered weights forward keeps for backward, and the buffers it holds for them
        ([Note: weights kept at run time] in kept_weights.py)."""
        self.gather_stream = torch.cuda.Stream(self.device) if kind == "cuda" else None
        """The stream a block's gather fills this pool's buffers on: its shards' copy-in and
        the collective's issue (producer: ``launch_block_gather``, after waiting for the
        current stream and for each buffer's last release; consumer: ``InFlightGather.wait``,
        where the current stream waits for the gather's event; [Note: the gather stream] in
        compile/block_gather.py). None on the host."""
        if kind == "cuda":
            self._core.set_reclaim_hook(_release_torch_cache)

    def __repr__(self) -> str:
        s = self._core.stats()
        return (
            f"GatherBufferPool(device={str(self.device)!r}, budget_bytes={s['budget_bytes']}, "
            f"charged_bytes={s['charged_bytes']}, checked_out={s['checked_out']})"
        )

    # -- other consumers ---------------------------------------------------------------------

    def acquire_dlpack(
        self, shape: Sequence[int] | int, dtype: torch.dtype, stream: Any = None
    ) -> DLPackBuffer:
        """Like `acquire`, but returns a DLPack protocol object (`__dlpack__`,
        `__dlpack_device__`) for any consumer: `torch.from_dlpack`, `numpy.from_dlpack`, CuPy.

        It exports once (versioned capsule if the consumer accepts DLPack 1.x, legacy
        otherwise), makes the consumer's stream wait for the block's previous release, and
        returns the lease if dropped unexported. The consumer's tensor returns it when freed.
        """
        return self._core.acquire_buffer(shape, dtype, stream)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` (or the tensor it is a view of) is a buffer currently checked out
        from this pool to it: False for a released tensor even after its block was re-leased
        (and for an `acquire_dlpack` buffer the pool cannot verify; see [Note: release
        contract])."""
        return self._core.owns(tensor) if isinstance(tensor, torch.Tensor) else False

    # -- sizing -----------------------------------------------------------------------------

    def set_budget(self, nbytes: int) -> int:
        """Sets the byte budget, clamped to the hard cap; evicts idle blocks (LRU) to fit.

        Returns the effective budget. A budget below the checked-out bytes takes effect as those
        blocks come back (they are freed instead of cached).
        """
        with record_function("zbuf::pool::set_budget"):
            effective = self._core.set_budget(nbytes)
        if self._budget_observer is not None:
            self._budget_observer(effective)
        return effective

    def set_floor(self, nbytes: int) -> int:
        """The pressure policy never shrinks the budget below ``nbytes`` (clamped to the hard
        cap): the working set a memory plan sized the budget to, whose gathers need those bytes
        at once whatever the budget says (rust/pressure.rs, [Note: pressure policy]). Moves
        nothing now; returns the effective floor. A floor that differs from the last, set once
        the one-shot recovery began, ends the recovery's hot-set admission: a new plan's gathers
        are pooled within the budget (rust/pool/mod.rs, [Note: one-shot recovery])."""
        return self._core.set_floor(nbytes)

    def set_budget_observer(self, observer: Callable[[int], object] | None) -> None:
        """``observer(effective_budget)`` runs after every ``set_budget`` (e.g. the schedule
        sizing the pool on a graph's first run); ``zbuf.memory`` uses it to keep an emulated
        card's split between torch and the pool current. None removes it."""
        if observer is not None and not callable(observer):
            raise InvalidRequestError(
                f"the budget observer must be callable, got {type(observer).__name__}")
        self._budget_observer = observer

    def trim(self) -> int:
        """Frees every idle block (waiting for their release events); returns the bytes freed."""
        with record_function("zbuf::pool::trim"):
            return self._core.trim()

    # -- allocator pressure -----------------------------------------------------------------

    def set_reclaim_hook(self, hook: Callable[[int], object] | None) -> None:
        """What the pool does when the device refuses it a block even after it freed its own idle
        blocks: ``hook(nbytes)`` runs (pool unlocked) and the acquire is retried once; an
        exception from the hook propagates. CUDA pools start with a hook that empties torch's
        caching allocator (its unused cache must not starve the pool: [Note: reclaim hook] in
        rust/python/pool.rs); host pools with none. None removes the hook."""
        self._core.set_reclaim_hook(hook)

    def observe_pressure(self, num_alloc_retries: int, free_bytes: int, total_bytes: int) -> str:
        """Feeds the caching allocator's cumulative retry counter and the device's free/total bytes.

        The first call sets the baseline. A rising counter shrinks the budget to
        min(budget, max(free / 4, checked-out bytes, floor)); once 3 retries (the configured
        threshold) have been seen, the one-shot recovery starts (rust/pool/mod.rs, [Note:
        one-shot recovery]). Returns "none", "shrink" or "recover".
        """
        action, _budget = self._core.observe_pressure(num_alloc_retries, free_bytes, total_bytes)
        return action

    def observe_torch_allocator(self) -> str:
        """Reads `torch.cuda.memory_stats` and `torch.cuda.mem_get_info` and feeds them to
        `observe_pressure`. When the recovery starts it also empties torch's cache, so the memory
        the pool drained goes back to the device. On the host backend (no caching allocator) it
        only reports "none"."""
        if self.device.type != "cuda":
            return "none"
        with record_function("zbuf::pool::observe_torch_allocator"):
            stats = torch.cuda.memory_stats(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            action = self.observe_pressure(int(stats.get("num_alloc_retries", 0)), free, total)
            if action == "recover":
                torch.cuda.empty_cache()
            return action

    # -- telemetry --------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        """A snapshot of the counters and byte totals."""
        return PoolStats(**self._core.stats())

    def events(self) -> list[dict[str, Any]]:
        """The retained telemetry events, oldest first: dicts with seq, kind ("hit",
        "allocate", "allocate_outside", "release", "evict", "out_of_memory", "pressure",
        "recovery_start", "recovery_end", "set_budget"), nbytes, ptr, stream, charged_bytes,
        time_us (microseconds since the Unix epoch, the clock of torch's allocation history,
        while ``time_events`` is on; else 0)."""
        return self._core.events()

    def time_events(self, on: bool) -> None:
        """Whether the events from now on carry their time (off by default: a clock read an
        event costs about half of the core's acquire and release pair)."""
        self._core.time_events(on)

    def hot_set(self) -> dict[int, int]:
        """{block capacity: count} recorded when the recovery started (empty before)."""
        return dict(self._core.hot_set())

    def memory_info(self) -> tuple[int, int] | None:
        """(free_bytes, total_bytes) of the device as the backend sees it (None if unknown)."""
        return self._core.memory_info()

    def capacity_for(self, nbytes: int) -> int:
        """Block capacity that serves a request of `nbytes` (rounded up to the alignment)."""
        return self._core.capacity_for(nbytes)

    def _inject_oom(self, count: int) -> bool:
        """Testing hook: the next `count` device allocations fail with out-of-memory (host
        backend only; returns False on CUDA)."""
        return self._core._inject_oom(count)


def _release_torch_cache(nbytes: int) -> None:
    """The CUDA pools' reclaim hook: hand torch's unused cached blocks back to the device."""
    torch.cuda.empty_cache()


_default_pools: dict[torch.device, GatherBufferPool] = {}
_default_lock = threading.Lock()


def default_pool(device: str | torch.device = "cpu") -> GatherBufferPool:
    """The process-wide pool of `device`, created on first use with the default sizes."""
    kind, index = _parse_device(device)
    key = torch.device(kind, index) if kind == "cuda" else torch.device("cpu")
    pool = _default_pools.get(key)
    if pool is not None:
        return pool
    with _default_lock:
        pool = _default_pools.get(key)
        if pool is None:
            pool = _default_pools[key] = GatherBufferPool(key)
        return pool
