//! Property-based model test: random operation sequences run against the pool (host backend,
//! traced) and against a plain reference model written from the policy notes in mod.rs. After
//! every operation the stats must equal the model's, and the invariants must hold:
//! * charged bytes = sum of live pool blocks, and <= budget unless no block is idle;
//! * no two live blocks (leases or idle) overlap; backend bytes = charged + outside + pending;
//! * the block an acquire reuses is the model's best fit; the idle set after evictions is the
//!   model's (LRU order);
//! * a block reused on another stream is handed out only after that stream waited on the
//!   block's release event (checked on the backend trace);
//! * the recovery starts at most once and afterwards the pool holds only hot-set capacities;
//! * OOM (injected) fails the request but loses no buffer.
//!
//! Cases: PROPTEST_CASES (default 256).

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::*;
use crate::backend::host::{HostBackend, HostOp};

const ALIGN: u64 = crate::backend::host::HOST_ALIGNMENT;
const HARD_CAP: u64 = 64 * ALIGN;
const THRESHOLD: u64 = 3;

#[derive(Clone, Debug)]
enum Op {
    /// `keyless`: a DLPack-protocol export (no holder key recorded after the checkout).
    Acquire { units: u64, stream: u64, keyless: bool },
    Release { pick: usize, stream: Option<u64> },
    /// Deleter path on a lease (current or stale).
    DeleterRelease { pick: usize },
    ReleaseStale { pick: usize },
    /// A stale holder's storage dies (its deleter runs).
    StaleDies { pick: usize },
    ReleaseForeign,
    SetBudget { units: u64 },
    SetFloor { units: u64 },
    Trim,
    Pressure { rise: u64, free_units: u64 },
    InjectOom { count: u64 },
    DeferEvents(bool),
    CompleteEvents,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        30 => (prop_oneof![1u64..=4, Just(8u64), Just(16u64), 1u64..=24], 0u64..3, proptest::bool::weighted(0.1))
            .prop_map(|(units, stream, keyless)| Op::Acquire { units, stream, keyless }),
        25 => (any::<usize>(), proptest::option::of(0u64..3)).prop_map(|(pick, stream)| Op::Release { pick, stream }),
        5 => any::<usize>().prop_map(|pick| Op::DeleterRelease { pick }),
        3 => any::<usize>().prop_map(|pick| Op::ReleaseStale { pick }),
        3 => any::<usize>().prop_map(|pick| Op::StaleDies { pick }),
        1 => Just(Op::ReleaseForeign),
        4 => (0u64..=80).prop_map(|units| Op::SetBudget { units }),
        2 => (0u64..=40).prop_map(|units| Op::SetFloor { units }),
        2 => Just(Op::Trim),
        4 => (0u64..3, 0u64..=128).prop_map(|(rise, free_units)| Op::Pressure { rise, free_units }),
        3 => (1u64..=2).prop_map(|count| Op::InjectOom { count }),
        2 => any::<bool>().prop_map(Op::DeferEvents),
        3 => Just(Op::CompleteEvents),
    ]
}

#[derive(Clone, Debug)]
struct MBlock {
    ptr: u64,
    cap: u64,
    outside: bool,
    /// Some(lease) when checked out.
    lease: Option<LeaseId>,
    acquire_stream: u64,
    last_release: u64,
    released_on: Option<u64>,
    hits: u64,
    retired: bool,
}

/// The reference model: the policy of mod.rs written as plainly as possible.
#[derive(Default, Debug)]
struct Model {
    blocks: Vec<MBlock>,
    budget: u64,
    floor: u64,
    tick: u64,
    fail_next: u64,
    stats: PoolStats,
    last_retries: Option<u64>,
    retries_seen: u64,
    recovery_triggered: bool,
    hot: BTreeMap<u64, u64>,
    admission: Option<BTreeMap<u64, u64>>,
    replanned_since_recovery: bool,
}

impl Model {
    fn charged(&self) -> u64 {
        self.blocks.iter().filter(|b| !b.outside).map(|b| b.cap).sum()
    }
    fn idle_bytes(&self) -> u64 {
        self.blocks.iter().filter(|b| !b.outside && b.lease.is_none()).map(|b| b.cap).sum()
    }
    fn checked_out_pool_bytes(&self) -> u64 {
        self.blocks.iter().filter(|b| !b.outside && b.lease.is_some()).map(|b| b.cap).sum()
    }

    fn free_block(&mut self, i: usize) {
        let b = self.blocks.remove(i);
        if !b.outside {
            self.stats.entries -= 1;
            self.stats.evictions += 1;
            if let Some(adm) = self.admission.as_mut() {
                if let Some(n) = adm.get_mut(&b.cap) {
                    *n += 1;
                }
            }
        }
    }

    fn evict_lru_until(&mut self, target: u64) {
        while self.charged() > target {
            let lru = self
                .blocks
                .iter()
                .enumerate()
                .filter(|(_, b)| !b.outside && b.lease.is_none())
                .min_by_key(|(_, b)| b.last_release)
                .map(|(i, _)| i);
            match lru {
                Some(i) => self.free_block(i),
                None => break,
            }
        }
    }

    /// Predicted acquire: Ok(Some(ptr)) = hit on ptr; Ok(None) = new allocation (pool or outside
    /// per the bool); Err = OOM.
    fn best_fit(&self, cap: u64, stream: u64) -> Option<usize> {
        let fit = self
            .blocks
            .iter()
            .filter(|b| !b.outside && b.lease.is_none() && b.cap >= cap)
            .map(|b| b.cap)
            .min()?;
        let cands: Vec<usize> =
            (0..self.blocks.len()).filter(|&i| { let b = &self.blocks[i]; !b.outside && b.lease.is_none() && b.cap == fit }).collect();
        let same: Vec<usize> = cands.iter().copied().filter(|&i| self.blocks[i].released_on == Some(stream)).collect();
        let pool = if same.is_empty() { cands } else { same };
        pool.into_iter().max_by_key(|&i| self.blocks[i].last_release)
    }

    fn admits(&self, cap: u64) -> bool {
        if self.stats.recovering {
            return false;
        }
        if let Some(adm) = &self.admission {
            if adm.get(&cap).copied().unwrap_or(0) == 0 {
                return false;
            }
        }
        self.checked_out_pool_bytes() + cap <= self.budget
    }

    /// Applies a successful-or-failed allocation attempt sequence; returns whether it succeeded.
    fn allocation_succeeds(&mut self) -> bool {
        if self.fail_next == 0 {
            return true;
        }
        self.fail_next -= 1;
        self.stats.alloc_failures += 1;
        self.evict_lru_until(0);
        if self.fail_next == 0 {
            return true;
        }
        self.fail_next -= 1;
        self.stats.alloc_failures += 1;
        false
    }

    fn release(&mut self, i: usize, stream: Option<u64>) {
        self.tick += 1;
        self.stats.releases += 1;
        self.stats.checked_out -= 1;
        let stream = stream.unwrap_or(self.blocks[i].acquire_stream);
        let charged = self.charged();
        let b = &self.blocks[i];
        if b.outside {
            self.stats.outside_bytes -= b.cap;
            self.blocks.remove(i);
        } else if b.retired || charged > self.budget {
            let retired = b.retired;
            self.free_block(i);
            if retired && !self.blocks.iter().any(|b| b.retired) {
                self.end_recovery();
            }
        } else {
            let tick = self.tick;
            let b = &mut self.blocks[i];
            b.lease = None;
            b.last_release = tick;
            b.released_on = Some(stream);
        }
    }

    fn end_recovery(&mut self) {
        self.stats.recovering = false;
        self.stats.recovered = true;
        if !self.replanned_since_recovery {
            self.admission = Some(self.hot.clone());
        }
    }

    fn set_floor(&mut self, nbytes: u64) {
        let floor = nbytes.min(HARD_CAP);
        if floor != self.floor {
            self.replanned_since_recovery = self.stats.recovering || self.stats.recovered;
            if self.stats.recovered {
                self.admission = None;
            }
        }
        self.floor = floor;
    }

    fn pressure(&mut self, retries: u64, free: u64) {
        let prev = self.last_retries.replace(retries);
        let rise = match prev {
            Some(p) if retries > p => retries - p,
            _ => return,
        };
        self.retries_seen += rise;
        self.stats.pressure_events += 1;
        let budget = self.budget.min((free / 4).max(self.checked_out_pool_bytes()).max(self.floor));
        if !self.recovery_triggered && self.retries_seen >= THRESHOLD {
            self.recovery_triggered = true;
            self.hot.clear();
            for b in self.blocks.iter_mut().filter(|b| !b.outside) {
                if b.lease.is_some() || b.hits > 0 {
                    *self.hot.entry(b.cap).or_insert(0) += 1;
                }
                if b.lease.is_some() {
                    b.retired = true;
                }
            }
            let co = self.checked_out_pool_bytes();
            self.evict_lru_until(co);
            self.stats.recovering = true;
            if !self.blocks.iter().any(|b| b.retired) {
                self.end_recovery();
            }
        }
        self.budget = budget;
        self.evict_lru_until(self.budget);
    }
}

fn check_invariants(pool: &GatherPool<HostBackend>, model: &Model, recovery_starts: usize) {
    let s = pool.stats();
    let leases = pool.leases();
    let idle = pool.idle_blocks();
    let pool_bytes: u64 = leases.iter().filter(|l| !l.outside).map(|l| l.capacity).sum::<u64>()
        + idle.iter().map(|b| b.capacity).sum::<u64>();
    assert_eq!(s.charged_bytes, pool_bytes, "charged = sum of live pool blocks");
    assert!(s.charged_bytes <= s.budget_bytes || s.idle_bytes == 0, "over budget with idle blocks: {s:?}");
    assert!(s.budget_bytes <= s.hard_cap_bytes);
    let mut ranges: Vec<(u64, u64)> =
        leases.iter().map(|l| (l.ptr, l.ptr + l.capacity)).chain(idle.iter().map(|b| (b.ptr, b.ptr + b.capacity))).collect();
    ranges.sort();
    for w in ranges.windows(2) {
        assert!(w[0].1 <= w[1].0, "live blocks overlap: {w:?}");
    }
    assert_eq!(
        pool.backend().live_bytes(),
        s.charged_bytes + s.outside_bytes + s.pending_free_bytes,
        "every byte the backend holds is charged, outside or pending"
    );
    assert!(recovery_starts <= 1, "the recovery is one-shot");
    if s.recovered && !model.replanned_since_recovery {
        let mut caps: BTreeMap<u64, u64> = BTreeMap::new();
        for c in leases.iter().filter(|l| !l.outside).map(|l| l.capacity).chain(idle.iter().map(|b| b.capacity)) {
            *caps.entry(c).or_insert(0) += 1;
        }
        for (c, n) in caps {
            assert!(n <= pool.hot_set().get(&c).copied().unwrap_or(0), "block of {c} bytes outside the hot set");
        }
    }
    // Stats equal the model's.
    let mut expected = model.stats.clone();
    expected.budget_bytes = model.budget;
    expected.hard_cap_bytes = HARD_CAP;
    expected.floor_bytes = model.floor;
    expected.charged_bytes = model.charged();
    expected.idle_bytes = model.idle_bytes();
    expected.checked_out_bytes = model.checked_out_pool_bytes();
    expected.pending_free_bytes = s.pending_free_bytes;
    expected.high_water_bytes = s.high_water_bytes;
    expected.high_water_total_bytes = s.high_water_total_bytes;
    assert_eq!(s, expected, "stats differ from the reference model");
    assert!(s.high_water_bytes >= s.charged_bytes);
    let mut real_idle: Vec<u64> = idle.iter().map(|b| b.ptr).collect();
    let mut model_idle: Vec<u64> = model.blocks.iter().filter(|b| !b.outside && b.lease.is_none()).map(|b| b.ptr).collect();
    real_idle.sort();
    model_idle.sort();
    assert_eq!(real_idle, model_idle, "idle set (LRU eviction choice) differs from the model");
}

fn run(ops: Vec<Op>, initial_budget_units: u64) {
    let cfg = PoolConfig {
        budget_bytes: initial_budget_units * ALIGN,
        hard_cap_bytes: HARD_CAP,
        event_log_capacity: 100_000,
        recovery_retry_threshold: THRESHOLD,
    };
    let mut backend = HostBackend::new();
    backend.enable_trace();
    let mut pool = GatherPool::new(backend, cfg).unwrap();
    let mut model = Model { budget: (initial_budget_units * ALIGN).min(HARD_CAP), ..Model::default() };
    let mut released: Vec<(LeaseId, u64)> = Vec::new(); // stale leases and their ptrs
    let mut retries = 0u64;
    // Simulated owner keys (StorageImpl addresses): one per checkout, unique; kept while the
    // checkout's storage lives (until its deleter runs).
    let mut next_key = 1u64;
    let mut keys: HashMap<LeaseId, u64> = HashMap::new();
    let mut keyless: std::collections::HashSet<LeaseId> = Default::default();

    for op in ops {
        match op {
            Op::Acquire { units, stream, keyless: no_key } => {
                let nbytes = units * ALIGN - (units % 7); // not always aligned
                let cap = pool.capacity_for(nbytes).unwrap();
                assert_eq!(cap, units * ALIGN);
                let fit = if model.stats.recovering { None } else { model.best_fit(cap, stream) };
                let expected_wait = fit.and_then(|i| {
                    let b = &model.blocks[i];
                    b.released_on.filter(|&r| r != stream).map(|_| b.ptr)
                });
                let idle_events: HashMap<u64, Option<EventHandle>> = pool.idle_blocks().iter().map(|b| (b.ptr, b.event)).collect();
                pool.backend_mut().take_trace();
                let result = pool.acquire(nbytes, stream);
                let trace = pool.backend_mut().take_trace();
                if let Ok(lease) = &result {
                    // The binding's protocol ([Note: stale holders]).
                    let covered = released.iter().any(|(l, p)| keys.contains_key(l) && *p == lease.ptr);
                    assert!(lease.verify_holder || !covered, "a stale holder names the block but no key is asked for");
                    keys.insert(lease.id, next_key);
                    if lease.verify_holder && !no_key {
                        pool.set_holder_key(lease.id, next_key);
                    }
                    if no_key {
                        keyless.insert(lease.id);
                    }
                    next_key += 1;
                }
                model.tick += 1;
                match fit {
                    Some(i) => {
                        let lease = result.expect("a hit never fails");
                        assert!(lease.hit);
                        assert_eq!(lease.ptr, model.blocks[i].ptr, "best fit differs from the model");
                        let b = &mut model.blocks[i];
                        b.lease = Some(lease.id);
                        b.acquire_stream = stream;
                        b.hits += 1;
                        model.stats.hits += 1;
                        model.stats.checked_out += 1;
                        match expected_wait {
                            Some(ptr) => {
                                let ev = idle_events[&ptr].expect("released block has an event");
                                assert!(
                                    trace.contains(&HostOp::Wait { stream, event: ev }),
                                    "cross-stream reuse without waiting on the release event: {trace:?}"
                                );
                            }
                            None => assert!(!trace.iter().any(|o| matches!(o, HostOp::Wait { .. }))),
                        }
                    }
                    None => {
                        let to_pool = model.admits(cap);
                        if to_pool {
                            let target = model.budget - cap;
                            model.evict_lru_until(target);
                        }
                        if model.allocation_succeeds() {
                            let lease = result.expect("model predicts success");
                            assert!(!lease.hit);
                            assert_eq!(lease.outside, !to_pool, "pool/outside decision differs");
                            model.stats.misses += 1;
                            model.stats.allocations += 1;
                            model.stats.checked_out += 1;
                            if to_pool {
                                model.stats.entries += 1;
                                if let Some(adm) = model.admission.as_mut() {
                                    *adm.get_mut(&cap).unwrap() -= 1;
                                }
                            } else {
                                model.stats.outside_allocations += 1;
                                model.stats.outside_bytes += cap;
                            }
                            model.blocks.push(MBlock {
                                ptr: lease.ptr,
                                cap,
                                outside: !to_pool,
                                lease: Some(lease.id),
                                acquire_stream: stream,
                                last_release: 0,
                                released_on: None,
                                hits: 0,
                                retired: false,
                            });
                        } else {
                            model.tick -= 1; // the pool ticks only on success
                            assert!(matches!(result, Err(PoolError::OutOfMemory { .. })), "{result:?}");
                        }
                    }
                }
            }
            Op::Release { pick, .. } | Op::DeleterRelease { pick } if model.blocks.iter().any(|b| b.lease.is_some()) => {
                let live: Vec<usize> = (0..model.blocks.len()).filter(|&i| model.blocks[i].lease.is_some()).collect();
                let i = live[pick % live.len()];
                let (lease, ptr) = (model.blocks[i].lease.unwrap(), model.blocks[i].ptr);
                if let Op::Release { stream, .. } = op {
                    let key = keys[&lease];
                    let r = match pool.release_ptr(ptr, None, stream) {
                        Ok(ReleaseOutcome::NeedKey) => pool.release_ptr(ptr, Some(key), stream),
                        r => r,
                    };
                    match r {
                        Ok(ReleaseOutcome::Released(l)) => assert_eq!(l, lease),
                        Err(PoolError::UnverifiableHolder { .. }) if keyless.contains(&lease) => {
                            check_invariants(&pool, &model, pool.events().filter(|e| e.kind == EventKind::RecoveryStart).count());
                            continue;
                        }
                        r => panic!("the holder's release failed: {r:?}"),
                    }
                    model.release(i, stream);
                } else {
                    assert_eq!(pool.release_if_current(lease), Ok(true));
                    keys.remove(&lease); // the storage died
                    model.release(i, None);
                }
                released.push((lease, ptr));
            }
            Op::ReleaseStale { pick } if !released.is_empty() => {
                let (lease, ptr) = released[pick % released.len()];
                let before = pool.stats();
                assert!(matches!(pool.release(lease, None), Err(PoolError::DoubleRelease { .. })));
                if let Some(&key) = keys.get(&lease) {
                    // The stale holder still lives: it must never release what is at its address now.
                    let r = match pool.release_ptr(ptr, None, None) {
                        Ok(ReleaseOutcome::NeedKey) => pool.release_ptr(ptr, Some(key), None),
                        r => r,
                    };
                    assert!(
                        matches!(r, Err(PoolError::DoubleRelease { .. } | PoolError::ForeignBuffer { .. } | PoolError::UnverifiableHolder { .. })),
                        "a stale holder's release was accepted: {r:?}"
                    );
                }
                assert_eq!(pool.stats(), before, "a rejected release changed the pool");
            }
            Op::StaleDies { pick } if released.iter().any(|(l, _)| keys.contains_key(l)) => {
                let alive: Vec<LeaseId> = released.iter().map(|(l, _)| *l).filter(|l| keys.contains_key(l)).collect();
                let lease = alive[pick % alive.len()];
                let before = pool.stats();
                assert_eq!(pool.release_if_current(lease), Ok(false));
                assert_eq!(pool.stats(), before, "a stale holder's deleter changed the pool");
                keys.remove(&lease);
            }
            Op::ReleaseForeign => {
                let before = pool.stats();
                assert_eq!(pool.release_ptr(8, None, None), Err(PoolError::ForeignBuffer { ptr: 8 }));
                assert_eq!(pool.stats(), before);
            }
            Op::SetBudget { units } => {
                let b = pool.set_budget(units * ALIGN);
                model.budget = (units * ALIGN).min(HARD_CAP);
                assert_eq!(b, model.budget);
                let budget = model.budget;
                model.evict_lru_until(budget);
            }
            Op::SetFloor { units } => {
                model.set_floor(units * ALIGN);
                assert_eq!(pool.set_floor(units * ALIGN), model.floor);
            }
            Op::Trim => {
                pool.trim();
                let co = model.checked_out_pool_bytes();
                model.evict_lru_until(co);
                assert_eq!(pool.stats().pending_free_bytes, 0);
            }
            Op::Pressure { rise, free_units } => {
                retries += rise;
                pool.observe_pressure(retries, free_units * ALIGN);
                model.pressure(retries, free_units * ALIGN);
            }
            Op::InjectOom { count } => {
                pool.backend_mut().inject_oom(count);
                model.fail_next = count;
            }
            Op::DeferEvents(d) => pool.backend_mut().set_defer_events(d),
            Op::CompleteEvents => pool.backend_mut().complete_all_events(),
            _ => {}
        }
        let starts = pool.events().filter(|e| e.kind == EventKind::RecoveryStart).count();
        check_invariants(&pool, &model, starts);
    }
    // Everything comes back: release what is out, trim, and the backend holds nothing.
    for l in pool.leases() {
        pool.release(l.id, None).unwrap();
    }
    for (lease, _) in &released {
        if keys.remove(lease).is_some() {
            assert_eq!(pool.release_if_current(*lease), Ok(false));
        }
    }
    assert_eq!(pool.stale_holders(), 0, "stale holders outlive their storage");
    pool.trim();
    assert_eq!(pool.backend().live_bytes(), 0, "a buffer was lost");
    assert!(pool.backend().live_events() <= MAX_SPARE_EVENTS, "events leak: {}", pool.backend().live_events());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256), ..ProptestConfig::default() })]

    #[test]
    fn pool_matches_reference_model(ops in proptest::collection::vec(op_strategy(), 1..160), budget in 0u64..=80) {
        run(ops, budget);
    }
}
