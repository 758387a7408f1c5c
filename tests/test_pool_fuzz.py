"""Hypothesis state machine: the Python pool API against a plain-Python reference model.

The model is written from the policy notes in rust/pool/mod.rs (best fit, LRU eviction, byte
budget, outside allocations, pressure shrink and one-shot recovery, OOM retry). After every step
the pool's stats must equal the model's, the invariants must hold, and every live tensor must
still hold the stamp written at acquire (a reused or overlapping live buffer would overwrite it).

The OOM variant also injects allocation failures through the host backend's testing hook
(issue 7): failed acquires raise PoolOutOfMemoryError, no invariant breaks, no buffer is lost.

Examples per machine: ZBUF_FUZZ_EXAMPLES (default 200).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from zbuf.errors import DoubleReleaseError, ForeignBufferError, PoolOutOfMemoryError
from zbuf.pool import GatherBufferPool

ALIGN = 256
HARD_CAP = 64 * ALIGN
THRESHOLD = 3
EXAMPLES = int(os.environ.get("ZBUF_FUZZ_EXAMPLES", "200"))
DTYPES = [torch.float32, torch.bfloat16, torch.uint8, torch.int64]


@dataclass(eq=False)
class MBlock:
    ptr: int
    cap: int
    outside: bool
    leased: bool = True
    last_release: int = 0
    hits: int = 0
    retired: bool = False


@dataclass
class Model:
    """Reference model of one pool (host backend: one stream, events complete at once)."""

    budget: int
    floor: int = 0
    blocks: list[MBlock] = field(default_factory=list)
    tick: int = 0
    fail_next: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    allocations: int = 0
    outside_allocations: int = 0
    releases: int = 0
    alloc_failures: int = 0
    pressure_events: int = 0
    high_water: int = 0
    last_retries: int | None = None
    retries_seen: int = 0
    recovery_triggered: bool = False
    recovering: bool = False
    recovered: bool = False
    hot: dict[int, int] = field(default_factory=dict)
    admission: dict[int, int] | None = None
    replanned_since_recovery: bool = False

    def pool_blocks(self):
        return [b for b in self.blocks if not b.outside]

    def charged(self) -> int:
        return sum(b.cap for b in self.pool_blocks())

    def idle(self) -> int:
        return sum(b.cap for b in self.pool_blocks() if not b.leased)

    def checked_out_pool(self) -> int:
        return sum(b.cap for b in self.pool_blocks() if b.leased)

    def free_block(self, b: MBlock) -> None:
        self.blocks.remove(b)
        if not b.outside:
            self.evictions += 1
            if self.admission is not None and b.cap in self.admission:
                self.admission[b.cap] += 1

    def evict_lru_until(self, target: int) -> None:
        while self.charged() > target:
            idle = [b for b in self.pool_blocks() if not b.leased]
            if not idle:
                return
            self.free_block(min(idle, key=lambda b: b.last_release))

    def acquire(self, cap: int):
        """Returns ("hit", block) | ("new", outside) | ("oom", None); applies the effects."""
        if not self.recovering:
            fits = [b for b in self.pool_blocks() if not b.leased and b.cap >= cap]
            if fits:
                best = min(b.cap for b in fits)
                b = max((b for b in fits if b.cap == best), key=lambda b: b.last_release)
                self.tick += 1
                b.leased, b.hits = True, b.hits + 1
                self.hits += 1
                return "hit", b
        admitted = (
            not self.recovering
            and (self.admission is None or self.admission.get(cap, 0) > 0)
            and self.checked_out_pool() + cap <= self.budget
        )
        if admitted:
            self.evict_lru_until(self.budget - cap)
        if self.fail_next:
            self.fail_next -= 1
            self.alloc_failures += 1
            self.evict_lru_until(0)
            if self.fail_next:
                self.fail_next -= 1
                self.alloc_failures += 1
                return "oom", None
        self.tick += 1
        self.misses += 1
        self.allocations += 1
        if admitted:
            if self.admission is not None:
                self.admission[cap] -= 1
        else:
            self.outside_allocations += 1
        return "new", not admitted

    def release(self, b: MBlock) -> None:
        self.tick += 1
        self.releases += 1
        charged = self.charged()
        if b.outside:
            self.blocks.remove(b)
        elif b.retired or charged > self.budget:
            self.free_block(b)
            if b.retired and not any(x.retired for x in self.blocks):
                self.end_recovery()
        else:
            b.leased, b.last_release = False, self.tick

    def end_recovery(self) -> None:
        self.recovering, self.recovered = False, True
        if not self.replanned_since_recovery:
            self.admission = dict(self.hot)

    def set_budget(self, n: int) -> None:
        self.budget = min(n, HARD_CAP)
        self.evict_lru_until(self.budget)

    def set_floor(self, n: int) -> None:
        # A new plan's working set ends the recovery's admission (rust/pool/mod.rs, [Note:
        # one-shot recovery], step 5).
        floor = min(n, HARD_CAP)
        if floor != self.floor:
            self.replanned_since_recovery = self.recovering or self.recovered
            if self.recovered:
                self.admission = None
        self.floor = floor

    def pressure(self, retries: int, free: int) -> str:
        prev, self.last_retries = self.last_retries, retries
        if prev is None or retries <= prev:
            return "none"
        self.retries_seen += retries - prev
        self.pressure_events += 1
        budget = min(self.budget, max(free // 4, self.checked_out_pool(), self.floor))
        if self.recovery_triggered or self.retries_seen < THRESHOLD:
            self.budget = budget
            self.evict_lru_until(self.budget)
            return "shrink"
        self.recovery_triggered = True
        self.hot = {}
        for b in self.pool_blocks():
            if b.leased or b.hits:
                self.hot[b.cap] = self.hot.get(b.cap, 0) + 1
            if b.leased:
                b.retired = True
        self.evict_lru_until(self.checked_out_pool())
        self.recovering = True
        if not any(b.retired for b in self.blocks):
            self.end_recovery()
        self.budget = budget
        self.evict_lru_until(self.budget)
        return "recover"

    def expected_stats(self) -> dict:
        return dict(
            budget_bytes=self.budget,
            hard_cap_bytes=HARD_CAP,
            floor_bytes=self.floor,
            charged_bytes=self.charged(),
            idle_bytes=self.idle(),
            checked_out_bytes=self.checked_out_pool(),
            outside_bytes=sum(b.cap for b in self.blocks if b.outside),
            pending_free_bytes=0,
            entries=len(self.pool_blocks()),
            checked_out=sum(1 for b in self.blocks if b.leased),
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            allocations=self.allocations,
            outside_allocations=self.outside_allocations,
            releases=self.releases,
            alloc_failures=self.alloc_failures,
            pressure_events=self.pressure_events,
            recovering=self.recovering,
            recovered=self.recovered,
        )


@dataclass(eq=False)
class Live:
    tensor: torch.Tensor
    block: MBlock
    stamp: int


def _offset_view(t: torch.Tensor) -> torch.Tensor:
    """A view of `t` starting after its first element (`t` itself if it has fewer than 2)."""
    return t[1:] if t.numel() > 1 else t


class PoolMachine(RuleBasedStateMachine):
    inject_oom = False

    live = Bundle("live")
    stale = Bundle("stale")

    def __init__(self) -> None:
        super().__init__()
        self.pool: GatherBufferPool | None = None
        self.model: Model | None = None
        self.stamp = 0
        self.retries = 0
        # Items currently live / released-but-held (the bundles hold references we cannot list).
        self.live_items: list[Live] = []
        self.stale_items: list[Live] = []

    @rule(budget_units=st.integers(0, 80))
    @precondition(lambda self: self.pool is None)
    def create(self, budget_units):
        self.pool = GatherBufferPool("cpu", budget_bytes=min(budget_units * ALIGN, HARD_CAP),
                                     hard_cap_bytes=HARD_CAP, event_log_capacity=16)
        self.model = Model(budget=min(budget_units * ALIGN, HARD_CAP))

    @precondition(lambda self: self.pool is not None)
    @rule(target=live, units=st.sampled_from([1, 2, 3, 4, 8, 16, 24]),
          dtype=st.sampled_from(DTYPES), trim_bytes=st.integers(0, 255))
    def acquire(self, units, dtype, trim_bytes):
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(units * ALIGN - trim_bytes, 1)
        numel = nbytes // itemsize
        cap = max((numel * itemsize + ALIGN - 1) // ALIGN * ALIGN, ALIGN)
        kind, info = self.model.acquire(cap)
        if kind == "oom":
            with pytest.raises(PoolOutOfMemoryError):
                self.pool.acquire((numel,), dtype)
            return None
        t = self.pool.acquire((numel,), dtype)
        assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
        if kind == "hit":
            assert t.data_ptr() == info.ptr or numel == 0, "best fit differs from the model"
            block = info
        else:
            block = MBlock(ptr=t.untyped_storage().data_ptr(), cap=cap, outside=info)
            self.model.blocks.append(block)
        self.stamp += 1
        t.view(torch.uint8).fill_(self.stamp % 251)
        item = Live(t, block, self.stamp % 251)
        self.live_items.append(item)
        return item

    @rule(item=consumes(live), target=stale, via_view=st.booleans())
    def release(self, item, via_view):
        if item is None:
            return None
        # A view with an offset names the block through its storage (data_ptr is inside it).
        self.pool.release(_offset_view(item.tensor) if via_view else item.tensor)
        self.model.release(item.block)
        self.live_items.remove(item)
        self.stale_items.append(item)
        return item

    @rule(item=consumes(live))
    def drop(self, item):
        if item is None:
            return
        self.live_items.remove(item)
        del item.tensor  # the DLPack deleter returns the lease
        self.model.release(item.block)

    @rule(item=stale, via_view=st.booleans())
    def release_again(self, item, via_view):
        if item is None:
            return
        before = self.pool.stats()
        with pytest.raises((DoubleReleaseError, ForeignBufferError)):
            self.pool.release(_offset_view(item.tensor) if via_view else item.tensor)
        assert self.pool.stats() == before

    @precondition(lambda self: self.pool is not None)
    @rule()
    def release_foreign(self):
        before = self.pool.stats()
        with pytest.raises(ForeignBufferError):
            self.pool.release(torch.empty(64))
        assert self.pool.stats() == before

    @rule(item=consumes(stale))
    def forget_stale(self, item):
        """The stale tensor dies: its deleter must not return anything a second time."""
        if item is not None:
            self.stale_items.remove(item)
            del item.tensor

    @precondition(lambda self: self.pool is not None)
    @rule(units=st.integers(0, 80))
    def set_budget(self, units):
        assert self.pool.set_budget(units * ALIGN) == min(units * ALIGN, HARD_CAP)
        self.model.set_budget(units * ALIGN)

    @precondition(lambda self: self.pool is not None)
    @rule(units=st.integers(0, 40))
    def set_floor(self, units):
        assert self.pool.set_floor(units * ALIGN) == min(units * ALIGN, HARD_CAP)
        self.model.set_floor(units * ALIGN)

    @precondition(lambda self: self.pool is not None)
    @rule()
    def trim(self):
        self.pool.trim()
        self.model.evict_lru_until(self.model.checked_out_pool())

    @precondition(lambda self: self.pool is not None)
    @rule(rise=st.integers(0, 2), free_units=st.integers(0, 128))
    def pressure(self, rise, free_units):
        self.retries += rise
        got = self.pool.observe_pressure(self.retries, free_units * ALIGN, 1 << 40)
        assert got == self.model.pressure(self.retries, free_units * ALIGN)

    def teardown(self):
        # No buffer lost: once every tensor died and the pool trimmed, it holds nothing.
        if self.pool is None:
            return
        for item in self.live_items + self.stale_items:
            del item.tensor
        self.live_items.clear()
        self.stale_items.clear()
        self.pool.trim()
        s = self.pool.stats()
        assert (s.checked_out, s.charged_bytes, s.outside_bytes) == (0, 0, 0), s

    @invariant()
    def matches_model(self):
        if self.pool is None:
            return
        s = self.pool.stats()
        got = {k: getattr(s, k) for k in self.model.expected_stats()}
        assert got == self.model.expected_stats()
        assert s.charged_bytes <= s.budget_bytes or s.idle_bytes == 0
        assert s.high_water_bytes >= s.charged_bytes
        assert len(self.pool.events()) <= 16

    @invariant()
    def live_buffers_intact(self):
        for item in self.live_items:
            data = item.tensor.view(torch.uint8)
            assert bool((data == item.stamp).all()), "a live buffer was overwritten"


class PoolMachineWithOOM(PoolMachine):
    inject_oom = True

    @precondition(lambda self: self.pool is not None)
    @rule(count=st.integers(1, 2))
    def inject(self, count):
        assert self.pool._inject_oom(count)
        self.model.fail_next = count

_settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = _settings
TestPoolMachineWithOOM = PoolMachineWithOOM.TestCase
TestPoolMachineWithOOM.settings = _settings
