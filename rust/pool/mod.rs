//! The gather-buffer pool: pure bookkeeping over a [`Backend`].
//!
//! The pool keeps raw byte blocks, never dtypes: a 96 MiB block serves a bf16 gather and later
//! an fp32 one. It is not thread safe by itself; the Python bindings wrap it in a mutex shared
//! with the DLPack deleters.
//!
//! [Note: best fit]
//! An acquire takes the idle block with the smallest capacity >= the request (capacities are
//! requests rounded up to the backend alignment). Among blocks of that capacity it prefers one
//! last released on the requesting stream (no cross-stream wait needed), then the most recently
//! released one (its pages are warm; cold blocks drift to the LRU end and are evicted first).
//!
//! [Note: budget and outside allocations]
//! `charged_bytes` = bytes of pool blocks (idle + checked out). A request becomes a new pool
//! block only if `checked_out_bytes + capacity <= budget`; idle blocks are then evicted in LRU
//! order (oldest release first) until it fits. Otherwise the request is served by an outside
//! allocation: counted as a miss, freed on release, never cached. The budget is never a reason to
//! fail; only the device refusing memory is (after one retry that frees every idle block).
//! Invariant: `charged_bytes <= budget_bytes`, or no block is idle. (A budget lowered below the
//! checked-out bytes takes effect as those blocks come back: they are freed instead of cached.)
//!
//! [Note: stream-ordered reuse]
//! A release records the block's event on the releasing stream (the last stream that used it).
//! The next acquire on a different stream enqueues `stream_wait_event` on its own stream, so the
//! new user's kernels start only after the old user's finished: no host sync, no
//! `record_stream`. Freeing a block (eviction, outside release) never blocks either: the memory
//! waits in a pending list until its event completes; only `trim` and the OOM retry synchronize.
//!
//! [Note: stale holders]
//! A torch tensor outlives its explicit `release` (compiled graphs release before the tensor
//! object dies), and its block may be re-leased to a new tensor at the same address. Releasing
//! the stale tensor again must be a `DoubleRelease`, not a release of the new lease. Holders are
//! told apart by an owner key: the address of the tensor's StorageImpl, shared by views and
//! unique among live storages. Computing it costs a pybind call (~0.3 us, as much as the rest of
//! a release), so the pool asks for it only when a stale holder could exist:
//! * An explicit release records the checkout as *stale* (with its key if the caller had it)
//!   until the lease's DLPack deleter runs (the storage died, so no tensor names it any more).
//! * A stale tensor, or a view of it, names an address inside its old block. So at checkout the
//!   pool notes whether any stale block covers the new block's start (`Cover`). While this
//!   checkout is out, new stale entries come only from releasing checkouts live alongside it,
//!   whose memory is disjoint from its block: every entry that can name the block was already
//!   there at checkout.
//! * Nothing covered it (`HolderCheck::NotNeeded`, the common case): every tensor naming the
//!   block holds this checkout; the release needs no key.
//! * Something did: the binding records the new tensor's key right after the checkout
//!   (`set_holder_key`), and a release must present the same key (`release_ptr` answers
//!   `NeedKey` first). A DLPack-protocol export has no tensor to take the key from
//!   (`HolderCheck::Unknown`): its release is accepted if the key is not a stale one, unless a
//!   stale holder with an unknown key covers the block: then the pool cannot tell and refuses
//!   (`UnverifiableHolder`, state unchanged; the tensor's deleter still returns the block).
//!
//! The stale set is empty whenever released tensors have died, which is the steady state of a
//! training step; the check is then a length test.

//! [Note: one-shot recovery]
//! Started by sustained allocator pressure (see [`crate::pressure`]), once per pool:
//! 1. remember the hot set: the capacities (with multiplicity) of the pool blocks checked out
//!    now plus the idle ones that served at least one hit, before the shrink that comes with
//!    the recovery evicts any of them;
//! 2. drain: free every idle block; mark the checked-out ones retired (freed when they return);
//! 3. while retired blocks are out, serve every request outside the pool;
//! 4. when the last retired block is back, readmit: from then on a new pool block is created
//!    only for a capacity in the hot set, at most as many as the hot set holds; anything else
//!    is served outside.
//! 5. a plan that sets a new working set afterwards (a floor that differs, `set_floor`) ends
//!    the admission: the hot set was the old plan's gathers, and the new plan's would otherwise
//!    be served outside the pool at every use. The budget and the floor bound the pool again.

pub mod config;
pub mod error;
pub mod events;
mod holders;
mod lease;
pub mod stats;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

use crate::backend::{Backend, BackendError, EventHandle, StreamHandle};
use crate::pressure::{PressureAction, PressureTracker};
pub use config::PoolConfig;
pub use error::PoolError;
pub use events::{EventKind, EventLog, PoolEvent};
use rustc_hash::FxHashMap;
use holders::{Cover, StaleHolders};
pub use lease::{Lease, LeaseId};
pub use stats::PoolStats;

/// Spare events kept for reuse after their blocks were freed (avoids `cuEventCreate` churn).
const MAX_SPARE_EVENTS: usize = 64;

/// Whether a block belongs to the pool or only serves one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Residency {
    /// Charged to the budget, cached when idle.
    Pool,
    /// Not charged, freed on release.
    Outside,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BlockState {
    Idle,
    CheckedOut {
        lease: LeaseId,
        /// Stream given at acquire; the deleter releases on it.
        stream: StreamHandle,
        /// How a release proves it comes from this checkout's holder.
        holder: HolderCheck,
    },
}

/// What a release must prove about the releasing tensor. See [Note: stale holders].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HolderCheck {
    /// No stale holder covered the block at checkout: any tensor naming it holds this lease.
    NotNeeded,
    /// A stale holder covered it; this is the holder's owner key (`set_holder_key`).
    Key(u64),
    /// A stale holder covered it and the holder's key is unknown (DLPack-protocol exports, or
    /// the moment between checkout and `set_holder_key`).
    Unknown,
}

/// Result of [`GatherPool::release_ptr`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    Released(LeaseId),
    /// Nothing changed: the block's holder must be verified; call again with the owner key.
    NeedKey,
}

#[derive(Debug)]
struct Block {
    ptr: u64,
    capacity: u64,
    residency: Residency,
    state: BlockState,
    /// Release event. Produced by `release` (recorded on the releasing stream); consumed by the
    /// next acquire on another stream (`stream_wait_event`) and by the free path (query/sync).
    event: Option<EventHandle>,
    /// Stream `event` was last recorded on (None before the first release).
    released_on: Option<StreamHandle>,
    /// Tick of the last release: the MRU/LRU key.
    last_release: u64,
    /// Checkouts served from this block while idle.
    hits: u64,
    /// Checked out when the recovery started: freed on return.
    retired: bool,
}

#[derive(Debug, Default)]
struct Slot {
    generation: u32,
    block: Option<Block>,
}

/// Memory freed by the pool but possibly still used by queued device work.
#[derive(Debug)]
struct PendingFree {
    ptr: u64,
    nbytes: u64,
    event: Option<EventHandle>,
}

/// An idle block as seen by tests and diagnostics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdleBlock {
    pub ptr: u64,
    pub capacity: u64,
    pub last_release: u64,
    pub released_on: Option<StreamHandle>,
    pub event: Option<EventHandle>,
}

/// A live lease as seen by tests and diagnostics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseInfo {
    pub id: LeaseId,
    pub ptr: u64,
    pub capacity: u64,
    pub outside: bool,
    pub retired: bool,
    pub stream: StreamHandle,
}

/// The pool. See the module notes for the policy.
pub struct GatherPool<B: Backend> {
    backend: B,
    config: PoolConfig,
    alignment: u64,
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    /// Address -> slot, for every live block (idle or checked out, pool or outside).
    by_ptr: FxHashMap<u64, u32>,
    /// Idle blocks by (capacity, most recent release first, slot): the best-fit index.
    idle_by_size: BTreeSet<(u64, Reverse<u64>, u32)>,
    /// Idle blocks by (last release, slot): the eviction order.
    idle_lru: BTreeSet<(u64, u32)>,
    pending: Vec<PendingFree>,
    spare_events: Vec<EventHandle>,
    tick: u64,
    stats: PoolStats,
    log: EventLog,
    pressure: PressureTracker,
    /// Retired blocks still checked out (the recovery ends when this reaches 0).
    retired_outstanding: u64,
    /// Hot set recorded when the recovery started: capacity -> count.
    hot_set: BTreeMap<u64, u64>,
    /// After the recovery: pool blocks that may still be created, per capacity.
    admission: Option<BTreeMap<u64, u64>>,
    /// A new floor was set once the recovery had begun: the hot set admits nothing (step 5 of
    /// [Note: one-shot recovery]).
    replanned_since_recovery: bool,
    /// Explicitly released checkouts whose storage is still alive ([Note: stale holders]).
    stale: StaleHolders,
}

impl<B: Backend> GatherPool<B> {
    /// Creates an empty pool. Fails only on an invalid configuration.
    pub fn new(backend: B, config: PoolConfig) -> Result<Self, PoolError> {
        let config = config.validated()?;
        let alignment = backend.alignment().max(1);
        let log = EventLog::new(config.event_log_capacity);
        let stats = PoolStats { budget_bytes: config.budget_bytes, hard_cap_bytes: config.hard_cap_bytes, ..PoolStats::default() };
        Ok(Self {
            backend,
            config,
            alignment,
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_ptr: FxHashMap::default(),
            idle_by_size: BTreeSet::new(),
            idle_lru: BTreeSet::new(),
            pending: Vec::new(),
            spare_events: Vec::new(),
            tick: 0,
            stats,
            log,
            pressure: PressureTracker::default(),
            retired_outstanding: 0,
            hot_set: BTreeMap::new(),
            admission: None,
            replanned_since_recovery: false,
            stale: StaleHolders::default(),
        })
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Block capacity serving a request of `nbytes` (rounded up to the alignment; 0 -> one unit).
    pub fn capacity_for(&self, nbytes: u64) -> Result<u64, PoolError> {
        let n = nbytes.max(1);
        n.checked_add(self.alignment - 1).map(|v| v / self.alignment * self.alignment).ok_or_else(|| {
            PoolError::InvalidArgument { detail: format!("a {nbytes}-byte request overflows the address space") }
        })
    }

    // ----------------------------------------------------------------------------- acquire

    /// Checks out a block of at least `nbytes` for use on `stream`.
    ///
    /// The block's contents are undefined. If it was last released on another stream, `stream`
    /// has been made to wait for that release before this returns (see [Note: stream-ordered
    /// reuse]).
    pub fn acquire(&mut self, nbytes: u64, stream: StreamHandle) -> Result<Lease, PoolError> {
        let capacity = self.capacity_for(nbytes)?;
        self.poll_pending();
        if !self.stats.recovering {
            if let Some(slot) = self.best_fit(capacity, stream) {
                return self.checkout_idle(slot, stream);
            }
        }
        let residency = if self.admits_pool_block(capacity) { Residency::Pool } else { Residency::Outside };
        if residency == Residency::Pool {
            let target = self.config.budget_bytes - capacity;
            self.evict_lru_until(target);
        }
        let ptr = self.allocate_with_retry(capacity)?;
        self.tick += 1;
        let slot = self.insert_block(ptr, capacity, residency);
        let s = &mut self.slots[slot as usize];
        s.generation = s.generation.wrapping_add(1);
        let id = LeaseId::new(slot, s.generation);
        let holder = self.holder_check(ptr);
        let s = &mut self.slots[slot as usize];
        s.block.as_mut().expect("just inserted").state = BlockState::CheckedOut { lease: id, stream, holder };
        self.stats.misses += 1;
        self.stats.allocations += 1;
        self.stats.checked_out += 1;
        let kind = match residency {
            Residency::Pool => {
                self.stats.checked_out_bytes += capacity;
                self.stats.entries += 1;
                if let Some(adm) = self.admission.as_mut() {
                    *adm.get_mut(&capacity).expect("admits_pool_block checked the hot set") -= 1;
                }
                EventKind::Allocate
            }
            Residency::Outside => {
                self.stats.outside_bytes += capacity;
                self.stats.outside_allocations += 1;
                EventKind::AllocateOutside
            }
        };
        self.update_high_water();
        self.log_event(kind, capacity, ptr, stream);
        Ok(Lease { id, ptr, capacity, outside: residency == Residency::Outside, hit: false, verify_holder: holder != HolderCheck::NotNeeded })
    }

    fn best_fit(&self, capacity: u64, stream: StreamHandle) -> Option<u32> {
        let &(fit, _, first) = self.idle_by_size.range((capacity, Reverse(u64::MAX), 0)..).next()?;
        let same_capacity = self.idle_by_size.range((fit, Reverse(u64::MAX), 0)..=(fit, Reverse(0), u32::MAX));
        for &(_, _, slot) in same_capacity {
            if self.block(slot).released_on == Some(stream) {
                return Some(slot);
            }
        }
        Some(first)
    }

    fn checkout_idle(&mut self, slot: u32, stream: StreamHandle) -> Result<Lease, PoolError> {
        let (ptr, capacity, last_release, released_on, event) = {
            let b = self.block(slot);
            (b.ptr, b.capacity, b.last_release, b.released_on, b.event)
        };
        if let (Some(ev), Some(prev)) = (event, released_on) {
            if prev != stream {
                // Before any state change: a failure leaves the block idle.
                self.backend.stream_wait_event(stream, ev)?;
            }
        }
        self.tick += 1;
        self.idle_by_size.remove(&(capacity, Reverse(last_release), slot));
        self.idle_lru.remove(&(last_release, slot));
        let holder = self.holder_check(ptr);
        let s = &mut self.slots[slot as usize];
        s.generation = s.generation.wrapping_add(1);
        let id = LeaseId::new(slot, s.generation);
        let b = s.block.as_mut().expect("idle index names a live block");
        b.state = BlockState::CheckedOut { lease: id, stream, holder };
        b.hits += 1;
        self.stats.idle_bytes -= capacity;
        self.stats.checked_out_bytes += capacity;
        self.stats.checked_out += 1;
        self.stats.hits += 1;
        self.update_high_water();
        self.log_event(EventKind::Hit, capacity, ptr, stream);
        Ok(Lease { id, ptr, capacity, outside: false, hit: true, verify_holder: holder != HolderCheck::NotNeeded })
    }

    /// The holder check of a checkout of the block at `ptr` ([Note: stale holders]).
    fn holder_check(&self, ptr: u64) -> HolderCheck {
        if self.stale.len() == 0 || self.stale.covering(ptr) == Cover::Nothing {
            HolderCheck::NotNeeded
        } else {
            HolderCheck::Unknown
        }
    }

    fn admits_pool_block(&self, capacity: u64) -> bool {
        if self.stats.recovering {
            return false;
        }
        if let Some(adm) = &self.admission {
            if adm.get(&capacity).copied().unwrap_or(0) == 0 {
                return false;
            }
        }
        self.stats.checked_out_bytes.saturating_add(capacity) <= self.config.budget_bytes
    }

    /// Allocates, and on OOM frees every idle block (and waits for pending frees) and retries
    /// once. Evictions made here stand even if the retry fails: the state stays consistent.
    fn allocate_with_retry(&mut self, capacity: u64) -> Result<u64, PoolError> {
        match self.backend.allocate(capacity) {
            Ok(p) => return Ok(p),
            Err(BackendError::OutOfMemory { .. }) => {
                self.stats.alloc_failures += 1;
                self.log_event(EventKind::OutOfMemory, capacity, 0, 0);
            }
            Err(e) => return Err(e.into()),
        }
        self.evict_lru_until(0);
        self.flush_pending();
        match self.backend.allocate(capacity) {
            Ok(p) => Ok(p),
            Err(e) => {
                if matches!(e, BackendError::OutOfMemory { .. }) {
                    self.stats.alloc_failures += 1;
                    self.log_event(EventKind::OutOfMemory, capacity, 0, 0);
                }
                Err(e.into())
            }
        }
    }

    fn insert_block(&mut self, ptr: u64, capacity: u64, residency: Residency) -> u32 {
        let block = Block {
            ptr,
            capacity,
            residency,
            state: BlockState::Idle,
            event: None,
            released_on: None,
            last_release: 0,
            hits: 0,
            retired: false,
        };
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot::default());
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 blocks")
            }
        };
        self.slots[slot as usize].block = Some(block);
        self.by_ptr.insert(ptr, slot);
        slot
    }

    // ----------------------------------------------------------------------------- release

    /// Returns a lease. `stream` is the last stream that used the buffer (None: the acquire
    /// stream). A stale or unknown id is a [`PoolError::DoubleRelease`]; state is unchanged.
    pub fn release(&mut self, lease: LeaseId, stream: Option<StreamHandle>) -> Result<(), PoolError> {
        match self.current_lease_slot(lease) {
            Some(slot) => self.release_slot(slot, stream),
            None => {
                let ptr = self.slots.get(lease.slot()).and_then(|s| s.block.as_ref()).map_or(0, |b| b.ptr);
                Err(PoolError::DoubleRelease { ptr })
            }
        }
    }

    /// Returns the lease whose block starts at `ptr`, on behalf of a holder with owner key `key`
    /// (None: not computed yet). `NeedKey` (state unchanged) asks for the key when a stale
    /// holder could name the block. A key of a stale holder, or one that is not the recorded
    /// holder's, is a `DoubleRelease`. See [Note: stale holders].
    pub fn release_ptr(&mut self, ptr: u64, key: Option<u64>, stream: Option<StreamHandle>) -> Result<ReleaseOutcome, PoolError> {
        let slot = *self.by_ptr.get(&ptr).ok_or(PoolError::ForeignBuffer { ptr })?;
        let (lease, holder, capacity) = match self.block(slot) {
            Block { state: BlockState::CheckedOut { lease, holder, .. }, capacity, .. } => (*lease, *holder, *capacity),
            _ => return Err(PoolError::DoubleRelease { ptr }),
        };
        if let Some(k) = key {
            if self.stale.is_stale_key(k) {
                return Err(PoolError::DoubleRelease { ptr });
            }
        }
        match (holder, key) {
            (HolderCheck::NotNeeded, _) => {}
            (_, None) => return Ok(ReleaseOutcome::NeedKey),
            (HolderCheck::Key(h), Some(k)) if h != k => return Err(PoolError::DoubleRelease { ptr }),
            (HolderCheck::Key(_), Some(_)) => {}
            (HolderCheck::Unknown, Some(_)) => {
                if self.stale.covering(ptr) == Cover::UnknownKey {
                    return Err(PoolError::UnverifiableHolder { ptr });
                }
            }
        }
        self.release_slot(slot, stream)?;
        self.stale.insert(lease, ptr, ptr.saturating_add(capacity), key);
        Ok(ReleaseOutcome::Released(lease))
    }

    /// Records the owner key of `lease`'s holder, taken right after a checkout that returned
    /// `verify_holder`. Ignored unless the lease is current and waits for it.
    pub fn set_holder_key(&mut self, lease: LeaseId, key: u64) {
        if let Some(slot) = self.current_lease_slot(lease) {
            if let BlockState::CheckedOut { holder: h @ HolderCheck::Unknown, .. } = &mut self.block_mut(slot).state {
                *h = HolderCheck::Key(key);
            }
        }
    }

    /// The deleter path: returns `lease` on its acquire stream if it is still checked out;
    /// otherwise (released explicitly before) forgets its stale holder. Returns whether it
    /// released.
    pub fn release_if_current(&mut self, lease: LeaseId) -> Result<bool, PoolError> {
        if self.stale.remove(lease) {
            return Ok(false);
        }
        match self.current_lease_slot(lease) {
            Some(slot) => self.release_slot(slot, None).map(|()| true),
            None => Ok(false),
        }
    }

    /// Whether `ptr` starts a buffer checked out from this pool to the holder with owner key
    /// `key`. False when that cannot be verified (see [Note: stale holders]).
    pub fn owns_ptr(&self, ptr: u64, key: u64) -> bool {
        let Some(&slot) = self.by_ptr.get(&ptr) else { return false };
        let BlockState::CheckedOut { holder, .. } = self.block(slot).state else { return false };
        if self.stale.is_stale_key(key) {
            return false;
        }
        match holder {
            HolderCheck::NotNeeded => true,
            HolderCheck::Key(h) => h == key,
            HolderCheck::Unknown => self.stale.covering(ptr) != Cover::UnknownKey,
        }
    }

    /// Holders released explicitly whose storage is still alive (diagnostics).
    pub fn stale_holders(&self) -> usize {
        self.stale.len()
    }

    /// Makes `stream` wait for the release that preceded `lease`'s checkout, as `acquire` did
    /// for the acquire stream: for a consumer whose first use is on another stream.
    pub fn order_stream(&mut self, lease: LeaseId, stream: StreamHandle) -> Result<(), PoolError> {
        let slot = self.current_lease_slot(lease).ok_or(PoolError::DoubleRelease { ptr: 0 })?;
        let b = self.block(slot);
        if let (Some(ev), Some(prev)) = (b.event, b.released_on) {
            if prev != stream {
                self.backend.stream_wait_event(stream, ev)?;
            }
        }
        Ok(())
    }

    fn current_lease_slot(&self, lease: LeaseId) -> Option<u32> {
        let b = self.slots.get(lease.slot())?.block.as_ref()?;
        match b.state {
            BlockState::CheckedOut { lease: l, .. } if l == lease => Some(lease.slot() as u32),
            _ => None,
        }
    }

    fn release_slot(&mut self, slot: u32, stream: Option<StreamHandle>) -> Result<(), PoolError> {
        let (ptr, capacity, residency, retired, acquire_stream) = {
            let b = self.block(slot);
            let BlockState::CheckedOut { stream, .. } = b.state else { unreachable!("caller checked") };
            (b.ptr, b.capacity, b.residency, b.retired, stream)
        };
        let stream = stream.unwrap_or(acquire_stream);
        // Record first: a driver failure leaves the lease checked out and the state unchanged.
        let event = match self.block(slot).event {
            Some(e) => e,
            None => {
                let e = self.take_event()?;
                self.block_mut(slot).event = Some(e);
                e
            }
        };
        self.backend.record_event(event, stream)?;
        self.poll_pending();
        self.tick += 1;
        self.stats.releases += 1;
        self.stats.checked_out -= 1;
        match residency {
            Residency::Outside => {
                self.stats.outside_bytes -= capacity;
                self.remove_block(slot);
                self.schedule_free(ptr, capacity, Some(event));
            }
            Residency::Pool => {
                let charged = self.stats.idle_bytes + self.stats.checked_out_bytes;
                self.stats.checked_out_bytes -= capacity;
                if retired || charged > self.config.budget_bytes {
                    self.free_pool_block(slot, ptr, capacity, Some(event));
                    if retired {
                        self.retired_outstanding -= 1;
                    }
                } else {
                    let tick = self.tick;
                    let b = self.block_mut(slot);
                    b.state = BlockState::Idle;
                    b.released_on = Some(stream);
                    b.last_release = tick;
                    self.idle_by_size.insert((capacity, Reverse(tick), slot));
                    self.idle_lru.insert((tick, slot));
                    self.stats.idle_bytes += capacity;
                }
            }
        }
        self.log_event(EventKind::Release, capacity, ptr, stream);
        if self.stats.recovering && self.retired_outstanding == 0 {
            self.end_recovery();
        }
        Ok(())
    }

    // ----------------------------------------------------------------------------- freeing

    /// Frees idle blocks in LRU order until `charged_bytes <= target` or none is idle.
    fn evict_lru_until(&mut self, target: u64) {
        while self.stats.idle_bytes + self.stats.checked_out_bytes > target {
            let Some(&(tick, slot)) = self.idle_lru.iter().next() else { break };
            let (ptr, capacity, event) = {
                let b = self.block(slot);
                (b.ptr, b.capacity, b.event)
            };
            self.idle_lru.remove(&(tick, slot));
            self.idle_by_size.remove(&(capacity, Reverse(tick), slot));
            self.stats.idle_bytes -= capacity;
            self.free_pool_block(slot, ptr, capacity, event);
        }
    }

    /// Drops a pool block (already out of the idle indices and byte totals) and frees its
    /// memory once its event completes.
    fn free_pool_block(&mut self, slot: u32, ptr: u64, capacity: u64, event: Option<EventHandle>) {
        self.remove_block(slot);
        self.stats.entries -= 1;
        self.stats.evictions += 1;
        if let Some(adm) = self.admission.as_mut() {
            if let Some(n) = adm.get_mut(&capacity) {
                *n += 1;
            }
        }
        self.schedule_free(ptr, capacity, event);
        self.log_event(EventKind::Evict, capacity, ptr, 0);
    }

    fn remove_block(&mut self, slot: u32) {
        let b = self.slots[slot as usize].block.take().expect("live block");
        self.by_ptr.remove(&b.ptr);
        self.free_slots.push(slot);
    }

    fn schedule_free(&mut self, ptr: u64, nbytes: u64, event: Option<EventHandle>) {
        self.stats.pending_free_bytes += nbytes;
        self.pending.push(PendingFree { ptr, nbytes, event });
        self.poll_pending();
    }

    /// Frees pending memory whose event has completed (non-blocking). A failing query keeps the
    /// entry; `trim` settles it.
    fn poll_pending(&mut self) {
        let mut i = 0;
        while i < self.pending.len() {
            let done = match self.pending[i].event {
                None => true,
                Some(e) => self.backend.event_complete(e).unwrap_or(false),
            };
            if done {
                let p = self.pending.swap_remove(i);
                self.free_now(p);
            } else {
                i += 1;
            }
        }
    }

    /// Waits for every pending free's event and frees the memory (host sync).
    fn flush_pending(&mut self) {
        for p in std::mem::take(&mut self.pending) {
            if let Some(e) = p.event {
                // If the device failed the memory is unusable anyway; freeing it is the best
                // we can do.
                let _ = self.backend.synchronize_event(e);
            }
            self.free_now(p);
        }
    }

    fn free_now(&mut self, p: PendingFree) {
        // SAFETY: `p` came from `allocate(p.nbytes)`, was removed from every index, and its
        // release event has completed (or the device is lost).
        unsafe { self.backend.free(p.ptr, p.nbytes) };
        self.stats.pending_free_bytes -= p.nbytes;
        if let Some(e) = p.event {
            if self.spare_events.len() < MAX_SPARE_EVENTS {
                self.spare_events.push(e);
            } else {
                self.backend.destroy_event(e);
            }
        }
    }

    fn take_event(&mut self) -> Result<EventHandle, PoolError> {
        match self.spare_events.pop() {
            Some(e) => Ok(e),
            None => Ok(self.backend.create_event()?),
        }
    }

    /// Frees every idle block and waits for pending frees. Returns the bytes given back.
    pub fn trim(&mut self) -> u64 {
        let before = self.stats.idle_bytes + self.stats.pending_free_bytes;
        self.evict_lru_until(self.stats.checked_out_bytes);
        self.flush_pending();
        before
    }

    // ----------------------------------------------------------------------------- budget

    /// Sets the budget (clamped to the hard cap) and evicts idle blocks (LRU) to fit it.
    /// Returns the effective budget.
    pub fn set_budget(&mut self, nbytes: u64) -> u64 {
        self.config.budget_bytes = nbytes.min(self.config.hard_cap_bytes);
        self.stats.budget_bytes = self.config.budget_bytes;
        self.evict_lru_until(self.config.budget_bytes);
        self.log_event(EventKind::SetBudget, self.config.budget_bytes, 0, 0);
        self.config.budget_bytes
    }

    /// Sets the floor the pressure policy never shrinks the budget below (clamped to the hard
    /// cap): the working set a memory plan sized the budget to (see [`crate::pressure`]).
    /// Returns the effective floor. It moves nothing now: the budget stays where it is.
    /// A floor that differs from the last one is a new plan's working set: once the one-shot
    /// recovery has begun, its gathers are admitted by the budget alone, not by the hot set of the
    /// plan before it ([Note: one-shot recovery], step 5).
    pub fn set_floor(&mut self, nbytes: u64) -> u64 {
        let floor = nbytes.min(self.config.hard_cap_bytes);
        if floor != self.stats.floor_bytes {
            self.replanned_since_recovery = self.stats.recovering || self.stats.recovered;
            if self.stats.recovered {
                self.admission = None;
            }
        }
        self.stats.floor_bytes = floor;
        floor
    }

    /// Feeds the caching allocator's cumulative retry counter and the device's free bytes
    /// (see [`crate::pressure`]). Returns what the pool did.
    pub fn observe_pressure(&mut self, num_alloc_retries: u64, free_bytes: u64) -> PressureAction {
        let action = self.pressure.observe(
            num_alloc_retries,
            free_bytes,
            self.config.budget_bytes,
            self.stats.checked_out_bytes,
            self.stats.floor_bytes,
            self.config.recovery_retry_threshold,
        );
        match action {
            PressureAction::None => {}
            PressureAction::Shrink { budget_bytes } | PressureAction::ShrinkAndRecover { budget_bytes } => {
                self.stats.pressure_events += 1;
                if matches!(action, PressureAction::ShrinkAndRecover { .. }) {
                    // The hot set is the working set before this shrink evicts any of it: taken
                    // after, a shrink to a quarter of a full card's free memory can leave it
                    // nearly empty, and the pool then allocates nearly every gather for good.
                    self.start_recovery();
                }
                self.config.budget_bytes = budget_bytes;
                self.stats.budget_bytes = budget_bytes;
                self.evict_lru_until(budget_bytes);
                self.log_event(EventKind::Pressure, budget_bytes, 0, 0);
            }
        }
        action
    }

    fn start_recovery(&mut self) {
        let mut hot = BTreeMap::new();
        let mut retired = 0;
        for slot in self.slots.iter_mut() {
            let Some(b) = slot.block.as_mut() else { continue };
            if b.residency != Residency::Pool {
                continue;
            }
            let checked_out = matches!(b.state, BlockState::CheckedOut { .. });
            if checked_out || b.hits > 0 {
                *hot.entry(b.capacity).or_insert(0u64) += 1;
            }
            if checked_out {
                b.retired = true;
                retired += 1;
            }
        }
        self.evict_lru_until(self.stats.checked_out_bytes);
        let hot_bytes = hot.iter().map(|(c, n)| c * n).sum();
        self.hot_set = hot;
        self.retired_outstanding = retired;
        self.stats.recovering = true;
        self.log_event(EventKind::RecoveryStart, hot_bytes, 0, 0);
        if retired == 0 {
            self.end_recovery();
        }
    }

    fn end_recovery(&mut self) {
        self.stats.recovering = false;
        self.stats.recovered = true;
        if !self.replanned_since_recovery {
            self.admission = Some(self.hot_set.clone());
        }
        self.log_event(EventKind::RecoveryEnd, 0, 0, 0);
    }

    // ----------------------------------------------------------------------------- telemetry

    /// A snapshot of the counters and byte totals.
    pub fn stats(&self) -> PoolStats {
        let mut s = self.stats.clone();
        s.charged_bytes = s.idle_bytes + s.checked_out_bytes;
        s
    }

    /// The retained telemetry events, oldest first.
    pub fn events(&self) -> impl Iterator<Item = &PoolEvent> {
        self.log.iter()
    }

    /// Whether the telemetry events from now on carry their time (off by default: a clock
    /// read an event).
    pub fn time_events(&mut self, on: bool) {
        self.log.set_timed(on);
    }

    /// The hot set recorded by the recovery (capacity -> count; empty before it).
    pub fn hot_set(&self) -> &BTreeMap<u64, u64> {
        &self.hot_set
    }

    /// Idle blocks (for invariant checks).
    pub fn idle_blocks(&self) -> Vec<IdleBlock> {
        self.idle_lru
            .iter()
            .map(|&(_, slot)| {
                let b = self.block(slot);
                IdleBlock { ptr: b.ptr, capacity: b.capacity, last_release: b.last_release, released_on: b.released_on, event: b.event }
            })
            .collect()
    }

    /// Live leases (for invariant checks).
    pub fn leases(&self) -> Vec<LeaseInfo> {
        self.slots
            .iter()
            .filter_map(|s| s.block.as_ref())
            .filter_map(|b| match b.state {
                BlockState::CheckedOut { lease, stream, .. } => Some(LeaseInfo {
                    id: lease,
                    ptr: b.ptr,
                    capacity: b.capacity,
                    outside: b.residency == Residency::Outside,
                    retired: b.retired,
                    stream,
                }),
                BlockState::Idle => None,
            })
            .collect()
    }

    fn block(&self, slot: u32) -> &Block {
        self.slots[slot as usize].block.as_ref().expect("live block")
    }

    fn block_mut(&mut self, slot: u32) -> &mut Block {
        self.slots[slot as usize].block.as_mut().expect("live block")
    }

    fn update_high_water(&mut self) {
        let charged = self.stats.idle_bytes + self.stats.checked_out_bytes;
        self.stats.high_water_bytes = self.stats.high_water_bytes.max(charged);
        self.stats.high_water_total_bytes = self.stats.high_water_total_bytes.max(charged + self.stats.outside_bytes);
    }

    fn log_event(&mut self, kind: EventKind, nbytes: u64, ptr: u64, stream: StreamHandle) {
        let charged = self.stats.idle_bytes + self.stats.checked_out_bytes;
        self.log.push(kind, nbytes, ptr, stream, charged);
    }
}

impl<B: Backend> Drop for GatherPool<B> {
    /// Frees everything the pool holds. Leases still out become dangling; the bindings keep the
    /// pool alive while any exported tensor lives, so this only happens in pure-Rust use.
    fn drop(&mut self) {
        let blocks: Vec<Block> = self.slots.iter_mut().filter_map(|s| s.block.take()).collect();
        for b in blocks {
            self.pending.push(PendingFree { ptr: b.ptr, nbytes: b.capacity, event: b.event });
            self.stats.pending_free_bytes += b.capacity;
        }
        self.flush_pending();
        for e in std::mem::take(&mut self.spare_events) {
            self.backend.destroy_event(e);
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod model_tests;
