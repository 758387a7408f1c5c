//! Deterministic unit tests of the pool policy (the property-based model test is in
//! `model_tests.rs`).

use super::*;
use crate::backend::host::HostBackend;
use crate::backend::{Backend, BackendError, EventHandle, StreamHandle};

fn pool(budget: u64) -> GatherPool<HostBackend> {
    let cfg = PoolConfig { budget_bytes: budget, hard_cap_bytes: 1 << 30, event_log_capacity: 64, recovery_retry_threshold: 3 };
    GatherPool::new(HostBackend::new(), cfg).unwrap()
}

#[test]
fn hit_reuses_same_block() {
    let mut p = pool(1 << 20);
    let a = p.acquire(1000, 0).unwrap();
    assert_eq!(a.capacity, 1024);
    p.release(a.id, None).unwrap();
    let b = p.acquire(900, 0).unwrap();
    assert!(b.hit);
    assert_eq!(a.ptr, b.ptr);
    assert_ne!(a.id, b.id);
    assert_eq!(p.release(a.id, None), Err(PoolError::DoubleRelease { ptr: a.ptr }));
    let s = p.stats();
    assert_eq!((s.hits, s.misses, s.allocations, s.checked_out), (1, 1, 1, 1));
}

#[test]
fn over_budget_goes_outside_and_is_freed_on_release() {
    let mut p = pool(4096);
    let a = p.acquire(4096, 0).unwrap();
    let b = p.acquire(256, 0).unwrap();
    assert!(!a.outside && b.outside);
    assert_eq!(p.stats().outside_bytes, 256);
    p.release(b.id, None).unwrap();
    assert_eq!(p.backend().live_bytes(), 4096);
    assert_eq!(p.stats().entries, 1);
}

#[test]
fn foreign_and_stale_pointers_are_rejected() {
    use ReleaseOutcome::{NeedKey, Released};
    let mut p = pool(1 << 20);
    assert_eq!(p.release_ptr(0x1234, None, None), Err(PoolError::ForeignBuffer { ptr: 0x1234 }));
    let a = p.acquire(10, 0).unwrap();
    assert!(!a.verify_holder);
    // No stale holder can name the block: released without a key.
    assert_eq!(p.release_ptr(a.ptr, None, None), Ok(Released(a.id)));
    assert_eq!(p.release_ptr(a.ptr, None, None), Err(PoolError::DoubleRelease { ptr: a.ptr }));
    assert_eq!(p.stale_holders(), 1);
    // Re-leased while the stale holder lives: the new holder's key must be recorded.
    let b = p.acquire(10, 0).unwrap();
    assert!(b.ptr == a.ptr && b.verify_holder);
    p.set_holder_key(b.id, 88);
    assert_eq!(p.release_ptr(a.ptr, None, None), Ok(NeedKey));
    assert_eq!(p.release_ptr(a.ptr, Some(77), None), Err(PoolError::DoubleRelease { ptr: a.ptr }));
    assert!(p.owns_ptr(b.ptr, 88) && !p.owns_ptr(b.ptr, 77));
    assert_eq!(p.stats().checked_out, 1, "rejected releases changed nothing");
    // The stale holder dies: later checkouts need no key again.
    assert_eq!(p.release_if_current(a.id), Ok(false));
    assert_eq!(p.stale_holders(), 0);
    assert_eq!(p.release_ptr(b.ptr, Some(88), None), Ok(Released(b.id)));
    // b was released with its key: a stale key is a double release even before the check.
    let c = p.acquire(10, 0).unwrap();
    assert!(c.verify_holder);
    assert_eq!(p.release_ptr(c.ptr, Some(88), None), Err(PoolError::DoubleRelease { ptr: c.ptr }));
    assert_eq!(p.release_if_current(b.id), Ok(false));
    assert_eq!(p.release_if_current(c.id), Ok(true));
    assert_eq!(p.release_if_current(c.id), Ok(false));
    assert_eq!((p.stale_holders(), p.stats().checked_out), (0, 0));
}

#[test]
fn stale_holder_covers_blocks_reallocated_inside_its_memory() {
    // An outside block is freed at release; its memory comes back inside a later block. A stale
    // view pointing into the old memory must not release the new lease.
    let mut p = pool(0);
    let a = p.acquire(4096, 0).unwrap();
    assert!(a.outside);
    assert_eq!(p.release_ptr(a.ptr, None, None), Ok(ReleaseOutcome::Released(a.id)));
    p.trim();
    let b = p.acquire(4096, 0).unwrap();
    if b.ptr >= a.ptr && b.ptr < a.ptr + 4096 {
        assert!(b.verify_holder, "a block inside stale memory must verify its holder");
    }
    let far = p.acquire(1 << 16, 0).unwrap();
    assert_eq!(far.verify_holder, far.ptr >= a.ptr && far.ptr < a.ptr + 4096);
}

#[test]
fn holder_of_a_keyless_export_is_unverifiable_next_to_an_unknown_stale_key() {
    let mut p = pool(1 << 20);
    let a = p.acquire(10, 0).unwrap();
    p.release_ptr(a.ptr, None, None).unwrap(); // stale, key never computed
    let b = p.acquire(10, 0).unwrap(); // a DLPack-protocol export: no set_holder_key
    assert!(b.verify_holder);
    assert_eq!(p.release_ptr(b.ptr, None, None), Ok(ReleaseOutcome::NeedKey));
    assert_eq!(p.release_ptr(b.ptr, Some(5), None), Err(PoolError::UnverifiableHolder { ptr: b.ptr }));
    assert!(!p.owns_ptr(b.ptr, 5));
    assert_eq!(p.stats().checked_out, 1);
    // Once the stale holder is gone the release is accepted.
    p.release_if_current(a.id).unwrap();
    assert!(p.owns_ptr(b.ptr, 5));
    assert_eq!(p.release_ptr(b.ptr, Some(5), None), Ok(ReleaseOutcome::Released(b.id)));
    // With only known stale keys, a keyless export's release is checked against them.
    let c = p.acquire(10, 0).unwrap();
    assert!(c.verify_holder); // b (key 5) is stale and alive
    assert_eq!(p.release_ptr(c.ptr, Some(5), None), Err(PoolError::DoubleRelease { ptr: c.ptr }));
    assert_eq!(p.release_ptr(c.ptr, Some(6), None), Ok(ReleaseOutcome::Released(c.id)));
}

#[test]
fn cross_stream_reuse_waits_on_release_event() {
    let mut p = pool(1 << 20);
    p.backend_mut().enable_trace();
    let a = p.acquire(256, 1).unwrap();
    p.release(a.id, Some(1)).unwrap();
    let b = p.acquire(256, 1).unwrap();
    p.release(b.id, Some(1)).unwrap();
    let c = p.acquire(256, 2).unwrap();
    let trace = p.backend_mut().take_trace();
    let waits: Vec<_> = trace.iter().filter(|op| matches!(op, crate::backend::host::HostOp::Wait { .. })).collect();
    assert_eq!(waits.len(), 1, "{trace:?}");
    assert!(matches!(waits[0], crate::backend::host::HostOp::Wait { stream: 2, .. }));
    p.release(c.id, None).unwrap();
}

#[test]
fn oom_retry_frees_idle_blocks() {
    let mut p = pool(1 << 20);
    p.backend_mut().set_limit_bytes(Some(2048));
    let a = p.acquire(1024, 0).unwrap();
    p.release(a.id, None).unwrap();
    let b = p.acquire(2048, 0).unwrap();
    assert_eq!(p.stats().alloc_failures, 1);
    assert_eq!(p.stats().evictions, 1);
    let err = p.acquire(256, 0).unwrap_err();
    assert!(matches!(err, PoolError::OutOfMemory { .. }));
    p.release(b.id, None).unwrap();
    assert_eq!(p.stats().checked_out, 0);
}

#[test]
fn pending_frees_wait_for_events() {
    let mut p = pool(1024);
    p.backend_mut().set_defer_events(true);
    let a = p.acquire(1024, 0).unwrap();
    let b = p.acquire(512, 0).unwrap();
    p.release(b.id, None).unwrap();
    assert_eq!(p.stats().pending_free_bytes, 512);
    assert_eq!(p.backend().live_bytes(), 1536);
    p.backend_mut().complete_all_events();
    p.release(a.id, None).unwrap();
    assert_eq!(p.stats().pending_free_bytes, 0);
    assert_eq!(p.trim(), 1024);
    assert_eq!(p.backend().live_bytes(), 0);
}

#[test]
fn recovery_is_one_shot_and_readmits_hot_set() {
    let mut p = pool(1 << 20);
    let a = p.acquire(1024, 0).unwrap();
    let cold = p.acquire(4096, 0).unwrap();
    p.release(cold.id, None).unwrap();
    assert_eq!(p.observe_pressure(0, 1 << 30), PressureAction::None);
    assert!(matches!(p.observe_pressure(3, 1 << 30), PressureAction::ShrinkAndRecover { .. }));
    let s = p.stats();
    assert!(s.recovering && s.idle_bytes == 0);
    let during = p.acquire(1024, 0).unwrap();
    assert!(during.outside);
    p.release(during.id, None).unwrap();
    p.release(a.id, None).unwrap();
    let s = p.stats();
    assert!(!s.recovering && s.recovered && s.entries == 0);
    assert_eq!(p.hot_set().iter().map(|(c, n)| (*c, *n)).collect::<Vec<_>>(), vec![(1024, 1)]);
    let hot = p.acquire(1024, 0).unwrap();
    assert!(!hot.outside);
    let hot2 = p.acquire(1024, 0).unwrap();
    assert!(hot2.outside, "only one 1024-byte block is in the hot set");
    assert!(p.acquire(4096, 0).unwrap().outside);
    assert!(matches!(p.observe_pressure(100, 1 << 30), PressureAction::Shrink { .. }));
    assert!(!p.stats().recovering);
}

#[test]
fn recovery_remembers_the_hot_blocks_its_own_shrink_evicts() {
    let mut p = pool(1 << 20);
    let a = p.acquire(1024, 0).unwrap();
    p.release(a.id, None).unwrap();
    let again = p.acquire(1024, 0).unwrap();
    p.release(again.id, None).unwrap(); // a hit: the block is hot, and idle
    assert_eq!(p.observe_pressure(0, 1 << 30), PressureAction::None);
    // No free memory: the shrink takes the budget to 0, evicting every idle block.
    assert_eq!(p.observe_pressure(3, 0), PressureAction::ShrinkAndRecover { budget_bytes: 0 });
    let s = p.stats();
    assert!(s.recovered && s.entries == 0 && s.budget_bytes == 0);
    assert_eq!(p.hot_set().iter().map(|(c, n)| (*c, *n)).collect::<Vec<_>>(), vec![(1024, 1)]);
}

#[test]
fn a_planned_working_set_stays_in_the_pool_under_pressure() {
    let mut p = pool(4096);
    assert_eq!(p.set_floor(4096), 4096);
    let step = |p: &mut GatherPool<HostBackend>| {
        let a = p.acquire(2048, 0).unwrap();
        let b = p.acquire(2048, 0).unwrap();
        let outside = a.outside || b.outside;
        p.release(a.id, None).unwrap();
        p.release(b.id, None).unwrap();
        outside
    };
    step(&mut p);
    step(&mut p); // hits: both blocks are hot
    assert_eq!(p.observe_pressure(0, 0), PressureAction::None);
    // Retries with nothing free and nothing checked out: the budget stays at the floor, so after
    // the recovery's one drain the working set is cached again and later steps allocate nothing.
    assert_eq!(p.observe_pressure(5, 0), PressureAction::ShrinkAndRecover { budget_bytes: 4096 });
    assert!(!step(&mut p), "the recovery served the planned working set outside the pool");
    let before = p.stats().allocations;
    assert!(matches!(p.observe_pressure(9, 0), PressureAction::Shrink { budget_bytes: 4096 }));
    assert!(!step(&mut p));
    assert_eq!(p.stats().allocations, before, "a gather of the planned working set allocated");
}

/// Host time of an acquire+release pair on a hit (run with
/// `cargo test --release --lib hot_path -- --ignored --nocapture`; benches/pool_bench.py runs it).
#[test]
#[ignore]
fn hot_path_pair_timing() {
    let mut p = pool(1 << 30);
    let a = p.acquire(1 << 20, 0).unwrap();
    p.release(a.id, None).unwrap();
    let n = 1_000_000u32;
    let t = std::time::Instant::now();
    for _ in 0..n {
        let l = p.acquire(1 << 20, 0).unwrap();
        p.release(l.id, None).unwrap();
    }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    println!("rust_core_pair_ns={ns:.1}");
    // What the binding does for `t = acquire(); release(t); del t`: checkout, release by address
    // (no key needed), then the deleter forgets the stale holder.
    let t = std::time::Instant::now();
    for _ in 0..n {
        let l = p.acquire(1 << 20, 0).unwrap();
        assert_eq!(p.release_ptr(l.ptr, None, None), Ok(ReleaseOutcome::Released(l.id)));
        assert_eq!(p.release_if_current(l.id), Ok(false));
    }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    println!("rust_core_explicit_pair_ns={ns:.1}");
}

/// A host backend whose event calls fail on demand (a lost device).
struct FlakyEvents {
    inner: HostBackend,
    fail: bool,
}

impl Backend for FlakyEvents {
    fn device(&self) -> crate::backend::Device {
        self.inner.device()
    }
    fn alignment(&self) -> u64 {
        self.inner.alignment()
    }
    fn allocate(&mut self, nbytes: u64) -> Result<u64, BackendError> {
        self.inner.allocate(nbytes)
    }
    unsafe fn free(&mut self, ptr: u64, nbytes: u64) {
        unsafe { self.inner.free(ptr, nbytes) }
    }
    fn create_event(&mut self) -> Result<EventHandle, BackendError> {
        self.inner.create_event()
    }
    fn destroy_event(&mut self, event: EventHandle) {
        self.inner.destroy_event(event)
    }
    fn record_event(&mut self, event: EventHandle, stream: StreamHandle) -> Result<(), BackendError> {
        if self.fail {
            return Err(BackendError::Driver { op: "cuEventRecord", detail: "CUDA_ERROR_LAUNCH_FAILED".into() });
        }
        self.inner.record_event(event, stream)
    }
    fn stream_wait_event(&mut self, stream: StreamHandle, event: EventHandle) -> Result<(), BackendError> {
        if self.fail {
            return Err(BackendError::Driver { op: "cuStreamWaitEvent", detail: "CUDA_ERROR_LAUNCH_FAILED".into() });
        }
        self.inner.stream_wait_event(stream, event)
    }
    fn event_complete(&mut self, event: EventHandle) -> Result<bool, BackendError> {
        self.inner.event_complete(event)
    }
    fn synchronize_event(&mut self, event: EventHandle) -> Result<(), BackendError> {
        self.inner.synchronize_event(event)
    }
    fn memory_info(&mut self) -> Option<(u64, u64)> {
        None
    }
}

#[test]
fn driver_failures_leave_state_unchanged() {
    let cfg = PoolConfig { budget_bytes: 1 << 20, hard_cap_bytes: 1 << 20, event_log_capacity: 0, recovery_retry_threshold: 3 };
    let mut p = GatherPool::new(FlakyEvents { inner: HostBackend::new(), fail: false }, cfg).unwrap();
    let a = p.acquire(256, 1).unwrap();
    p.release(a.id, None).unwrap();
    let b = p.acquire(256, 1).unwrap();
    p.backend_mut().fail = true;
    let before = p.stats();
    let err = p.release(b.id, None).unwrap_err();
    assert_eq!(err.kind(), "PoolBackendError");
    assert!(err.to_string().contains("cuEventRecord"), "{err}");
    assert_eq!(p.stats(), before, "a failed release changed the pool");
    p.backend_mut().fail = false;
    p.release(b.id, Some(1)).unwrap();
    // A cross-stream hit whose wait fails leaves the block idle.
    p.backend_mut().fail = true;
    let before = p.stats();
    assert_eq!(p.acquire(256, 2).unwrap_err().kind(), "PoolBackendError");
    assert_eq!(p.stats(), before);
}

#[test]
fn a_new_plan_after_the_recovery_is_admitted_by_its_budget() {
    let mut p = pool(1 << 20);
    assert_eq!(p.set_floor(2048), 2048);
    let a = p.acquire(1024, 0).unwrap();
    assert_eq!(p.observe_pressure(0, 1 << 30), PressureAction::None);
    assert!(matches!(p.observe_pressure(3, 1 << 30), PressureAction::ShrinkAndRecover { .. }));
    p.release(a.id, None).unwrap();
    assert!(p.stats().recovered);
    let old_plan = p.acquire(4096, 0).unwrap();
    assert!(old_plan.outside, "the hot set admits only the 1024-byte block");
    p.release(old_plan.id, None).unwrap();
    // The same working set planned again changes nothing.
    p.set_floor(2048);
    assert!(p.acquire(4096, 0).unwrap().outside);
    // A new plan's working set: its 4096-byte gathers go back into the pool and stay there.
    p.set_floor(8192);
    let new_plan = p.acquire(4096, 0).unwrap();
    assert!(!new_plan.outside);
    p.release(new_plan.id, None).unwrap();
    assert!(p.acquire(4096, 0).unwrap().hit);
}

#[test]
fn a_new_plan_during_the_recovery_leaves_no_hot_set_admission_after_it() {
    let mut p = pool(1 << 20);
    let a = p.acquire(1024, 0).unwrap();
    assert_eq!(p.observe_pressure(0, 1 << 30), PressureAction::None);
    assert!(matches!(p.observe_pressure(3, 1 << 30), PressureAction::ShrinkAndRecover { .. }));
    assert!(p.stats().recovering);
    p.set_floor(8192);
    assert!(p.acquire(4096, 0).unwrap().outside, "a recovery serves everything outside");
    p.release(a.id, None).unwrap();
    assert!(p.stats().recovered);
    assert!(!p.acquire(4096, 0).unwrap().outside);
}
