"""One device, two allocators: the gather-buffer pool and torch's caching allocator.

[Note: one memory, two allocators]
The pool allocates its blocks with the driver, beside torch's caching allocator, and each keeps
memory the other cannot use: the pool its idle blocks, torch its cache of freed segments. An
out-of-memory error that the other side could have prevented by letting go is a zbuf bug, so
``SharedMemory`` makes each side yield to the other:

* the pool needs a block: the pool first frees its own idle blocks and retries; if the device
  still refuses, its reclaim hook empties torch's unused cache and the acquire is retried once
  ([Note: reclaim hook] in rust/python/pool.rs). Counted as ``reclaims``.
* torch needs memory: the pool's idle blocks go back to the device
  - before the optimizer step, when the step's measured need says torch will want them
    (``yield_idle``, called by ``StepMemory`` (step.py): [Note: whole-step budget] there);
  - when torch's allocator raised out-of-memory (CUDA's out-of-memory observer): torch raises
    anyway, the observer cannot turn the failure into a success, but the memory is free for the
    caller's retry and the event is counted (``torch_ooms``, and ``torch_ooms_with_idle_pool``
    when the pool held idle blocks at that moment: the case that must not happen);
  - when torch's allocator retried (``num_alloc_retries`` rose) since the last step boundary:
    the pool's pressure policy shrinks its budget (``observe_step``, rust/pressure.rs).

[Note: emulated capacity]
``zbuf bench --mem-frac F`` emulates a card with F of the memory. ``set_per_process_memory_fraction``
caps only torch's allocator, and the pool allocates beside it: so that allocator + pool never
exceed F of the card (the same total every engine gets), ``emulate_capacity`` keeps torch's
fraction at ``(capacity - what the pool may hold) / total`` and moves it whenever that changes:
lower while the pool holds its blocks, higher while they are lent to the optimizer step. What
the pool may hold is its budget, or after its one-shot recovery the hot set it may still keep
(``pool_share_bytes``). When the
pool takes its share back and torch's cache has grown into it, that cache is emptied, as the
reclaim hook would do on a real card of that size.

[Note: torch's allocator grows in place]
Left at its defaults, torch's caching allocator takes a segment from the driver per large request
and splits cached segments for later ones; what is freed inside a segment that still holds a live
tensor serves only requests that fit the hole, and never goes back to the device. A step planned
near the card's limit leaves such holes (kept, offloaded and recomputed blocks' activations, the
uploads of offloaded ones, the user's fp32 loss): at qwen3-14b as rank 0 of 8 on an 80 GiB card,
with the user's checkpoint around each block call, ``zbuf.compile(model, optimizer=opt)`` ran out
of memory in step 2 asking for the fp32 logits (9.27 GiB) with 45.8 GiB allocated and 20.4 GiB of
torch's cache free in pieces (benches/results/onepath14.md): about 60 % of what the step had
allocated beyond its start, where the plan charges what step 0 measured (23.5 % in the same
placement's earlier run). No plan can budget holes that grow so. Expandable segments
(``expandable_segments:True``: torchtitan's default, and the FSDP2 baseline's) map pages into one
growing address range per stream instead: when a request finds no hole that fits, the allocator
unmaps the free pages and maps them again where it fits (one retry), so memory free in pieces
serves any request. So ``SharedMemory``, as it begins to share a CUDA device, turns them on,
unless the user configured torch's allocator (``PYTORCH_CUDA_ALLOC_CONF`` or
``PYTORCH_ALLOC_CONF`` set: their settings stand as given, ``expandable_segments:False``
included, and the record says whose are in force: ``torch_allocator``); ``zbuf train`` and
``zbuf bench`` do the same for every engine before its first allocation, so FSDP2 and DDP run
in their best configuration beside zbuf (../shared/docs/DEVICE.md). The setting is torch's,
process-wide, and holds for the segments made after it; torch's fraction cap ([Note: emulated
capacity]) bounds the mapped pages as it bounds segments (tests/gpu/test_torch_allocator_gpu.py:
holes serve a request twice their size). Measured on an H100: that test passes, and the same 14B
placement then completed, 0.871x FSDP2's step (benches/results/onepath14.md).
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Mapping, Optional

import torch

from ..pool import GatherBufferPool
from .device import user_capacity_bytes

__all__ = ["MemoryEvents", "SharedMemory", "users_allocator_settings", "expand_torch_segments"]

ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where a user configures torch's CUDA caching allocator (the second is torch's name for every
device's allocator)."""


def users_allocator_settings(environ: Mapping[str, str]) -> Optional[str]:
    """The user's configuration of torch's allocator, ``NAME=value`` of the first of
    ``ALLOCATOR_VARIABLES`` set to more than blanks; None when the user left it at torch's
    defaults ([Note: torch's allocator grows in place])."""
    for name in ALLOCATOR_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            return f"{name}={value}"
    return None


def expand_torch_segments() -> str:
    """Turn torch's expandable segments on unless the user configured torch's allocator ([Note:
    torch's allocator grows in place]); returns whose settings are in force, for the record.
    Idempotent; CUDA only (the host's allocator has no segments)."""
    users = users_allocator_settings(os.environ)
    if users is not None:
        return users
    torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
    return "expandable_segments:True (zbuf's)"


@dataclasses.dataclass
class MemoryEvents:
    """Cumulative counts of ``SharedMemory``'s interventions (telemetry)."""

    reclaims: int = 0
    """The pool's acquire was refused by the device and torch's cache was emptied for it."""
    yields: int = 0
    """Times the pool gave its idle blocks back for torch (before an optimizer step)."""
    yielded_bytes: int = 0
    """Bytes of idle blocks given back by those yields."""
    torch_ooms: int = 0
    """Out-of-memory errors raised by torch's caching allocator (CUDA observer)."""
    torch_ooms_with_idle_pool: int = 0
    """The subset of ``torch_ooms`` raised while the pool held idle blocks: a zbuf bug."""
    cache_releases: int = 0
    """Times torch's cache was emptied because the pool took its share back."""


class SharedMemory:
    """Arbitrates one device's memory between ``pool`` and torch's caching allocator ([Note: one
    memory, two allocators]). One per pool; it installs the pool's reclaim hook (and on CUDA an
    out-of-memory observer) that refer to it weakly, so dropping it undoes its effect."""

    def __init__(self, pool: GatherBufferPool) -> None:
        self.pool = pool
        self.device = pool.device
        self.events = MemoryEvents()
        self._capacity: Optional[int] = None
        self._lent = False
        self.torch_allocator: Optional[str] = None
        """Whose settings torch's caching allocator runs under, for the record ([Note: torch's
        allocator grows in place]); None on the host."""
        ref = weakref.ref(self)

        def reclaim(nbytes: int) -> None:
            me = ref()
            if me is not None:
                me._reclaim(nbytes)
            elif pool.device.type == "cuda":
                torch.cuda.empty_cache()

        pool.set_reclaim_hook(reclaim)

        def budget_moved(_budget: int) -> None:
            me = ref()
            if me is not None:
                me._apply_capacity()

        pool.set_budget_observer(budget_moved)
        if self.device.type == "cuda":
            def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
                me = ref()
                if me is not None and device == me.device.index:
                    me._on_torch_oom()

            # Attached per device allocator, which exist only once CUDA is initialised. torch has
            # no way to detach an observer; this one is inert once ``self`` is gone.
            torch.cuda.init()
            torch._C._cuda_attach_out_of_memory_observer(observer)
            self.torch_allocator = expand_torch_segments()
            # [Note: one cap for torch and the pool]: a user's fraction is the shared capacity.
            self.emulate_capacity(user_capacity_bytes(self.device))

    # -- the pool asks ------------------------------------------------------------------------

    def _reclaim(self, nbytes: int) -> None:
        self.events.reclaims += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- torch asks ---------------------------------------------------------------------------

    def _on_torch_oom(self) -> None:
        self.events.torch_ooms += 1
        if self.pool.stats().idle_bytes > 0:
            self.events.torch_ooms_with_idle_pool += 1
        self.pool.trim()
        self._apply_capacity()

    def yield_idle(self) -> int:
        """Give every idle pool block back to the device now (the pool keeps its budget and
        allocates again on its next misses); returns the bytes freed. Until ``take_back``,
        torch's emulated share includes them."""
        freed = self.pool.trim()
        self._lent = True
        if freed:
            self.events.yields += 1
            self.events.yielded_bytes += freed
        self._apply_capacity()
        return freed

    def take_back(self) -> None:
        """End of the lending that ``yield_idle`` started: the pool's budget counts again (and
        the emulated capacity follows the pool's share, which its first runs may have moved)."""
        self._lent = False
        self._apply_capacity()

    def observe_step(self) -> str:
        """Step boundary: feed torch's retry counter and free memory to the pool's pressure
        policy (CUDA; "none" on the host)."""
        return self.pool.observe_torch_allocator()

    # -- what the device holds ----------------------------------------------------------------

    def pool_share_bytes(self) -> int:
        """Bytes the pool may hold now: what it holds, or what it may keep in its own blocks if
        that is more (while it lends its idle blocks: what it holds). It may keep its budget;
        once its one-shot recovery ran, no more than the hot set it remembered ([Note: one-shot
        recovery] in rust/pool/mod.rs): beyond that it allocates outside and frees on release,
        so the rest of the budget is torch's on a real card, and the emulated one gives it to
        torch too (qwen3-32b's pool held 84-126 MB from step 4 on, its budget 3.82 GB at the end,
        benches/results/onepath32b.md)."""
        s = self.pool.stats()
        held = s.charged_bytes + s.outside_bytes + s.pending_free_bytes
        if self._lent or s.recovering:  # recovering: every request is served outside
            return held
        keep = s.budget_bytes
        if s.recovered:
            keep = min(keep, sum(capacity * n for capacity, n in self.pool.hot_set().items()))
        return max(held, keep)

    def limit_bytes(self) -> Optional[int]:
        """Bytes torch and the pool may use together on this device (CUDA: the driver's free
        memory plus what both hold, capped by the emulated capacity); None on the host, which
        has no device limit to measure."""
        if self.device.type != "cuda":
            return None
        free, _total = torch.cuda.mem_get_info(self.device)
        s = self.pool.stats()
        held = torch.cuda.memory_reserved(self.device) + s.charged_bytes + s.outside_bytes \
            + s.pending_free_bytes
        limit = free + held
        return limit if self._capacity is None else min(limit, self._capacity)

    # -- emulated capacity --------------------------------------------------------------------

    def emulate_capacity(self, capacity_bytes: Optional[int]) -> None:
        """Emulate a card of ``capacity_bytes`` shared by torch and the pool ([Note: emulated
        capacity]); None stops managing torch's fraction. CUDA only."""
        if capacity_bytes is not None and self.device.type != "cuda":
            raise ValueError("emulate_capacity caps CUDA memory (torch.cuda."
                             "set_per_process_memory_fraction); this pool is on the host")
        self._capacity = capacity_bytes
        self._apply_capacity()

    def _apply_capacity(self) -> None:
        if self._capacity is None:
            return
        total = torch.cuda.get_device_properties(self.device).total_memory
        allowed = max(self._capacity - self.pool_share_bytes(), total // 100)
        torch.cuda.set_per_process_memory_fraction(allowed / total, self.device)
        if torch.cuda.memory_reserved(self.device) > allowed:
            # torch's cache grew into the pool's share while it was lent: hand it back now, as
            # the pool's reclaim hook would on a card of this size.
            self.events.cache_releases += 1
            torch.cuda.empty_cache()

    def capacity_fraction(self) -> Optional[dict]:
        """The emulated capacity and torch's current share of it (for the run record)."""
        if self._capacity is None:
            return None
        total = torch.cuda.get_device_properties(self.device).total_memory
        return {"capacity_bytes": self._capacity, "device_total_bytes": total,
                "pool_share_bytes": self.pool_share_bytes(),
                "allocator_fraction": (self._capacity - self.pool_share_bytes()) / total}
