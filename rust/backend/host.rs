//! Host (CPU) memory backend: aligned heap allocations.
//!
//! Used for CPU runs, CI and fuzzing. Host "streams" are caller-chosen ids and events are
//! modelled, not real: CPU tensors are synchronous, so an event completes when recorded unless a
//! test defers completion ([`HostBackend::set_defer_events`]). Every call can be traced
//! ([`HostOp`]) so model tests can check the stream-ordering contract ("a block is reused on
//! another stream only after that stream waited on its release event").

use std::alloc::{alloc, dealloc, Layout};
use rustc_hash::FxHashMap;

use super::{Backend, BackendError, Device, DeviceKind, EventHandle, StreamHandle};

/// Allocation alignment (and capacity granularity): 256 bytes, what DLPack consumers and
/// vectorised kernels expect of a buffer start.
pub const HOST_ALIGNMENT: u64 = 256;

/// One backend call, as recorded by the trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostOp {
    Allocate { ptr: u64, nbytes: u64 },
    Free { ptr: u64, nbytes: u64 },
    Record { event: EventHandle, stream: StreamHandle },
    Wait { stream: StreamHandle, event: EventHandle },
    Synchronize { event: EventHandle },
}

/// Aligned host memory with fault injection and an optional call trace.
#[derive(Debug, Default)]
pub struct HostBackend {
    /// Next allocations to fail with an injected OOM (testing hook).
    fail_next: u64,
    /// If set, allocations beyond this many live bytes fail with OOM (models a full device).
    limit_bytes: Option<u64>,
    live_bytes: u64,
    next_event: EventHandle,
    /// Event -> completed?  Present while the event exists.
    events: FxHashMap<EventHandle, bool>,
    /// When true, recorded events stay pending until [`HostBackend::complete_all_events`].
    defer_events: bool,
    trace: Option<Vec<HostOp>>,
}

impl HostBackend {
    pub fn new() -> Self {
        Self { next_event: 1, ..Self::default() }
    }

    /// Fails allocations that would take the live bytes above `limit` (None: no limit).
    pub fn set_limit_bytes(&mut self, limit: Option<u64>) {
        self.limit_bytes = limit;
    }

    /// Starts recording every call (see [`HostBackend::take_trace`]).
    pub fn enable_trace(&mut self) {
        self.trace = Some(Vec::new());
    }

    /// Returns and clears the recorded calls.
    pub fn take_trace(&mut self) -> Vec<HostOp> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Keeps recorded events pending until [`HostBackend::complete_all_events`] (models a
    /// device still running the work that used a block).
    pub fn set_defer_events(&mut self, defer: bool) {
        self.defer_events = defer;
    }

    /// Completes every pending event (the "device" caught up).
    pub fn complete_all_events(&mut self) {
        self.events.values_mut().for_each(|done| *done = true);
    }

    /// Bytes currently allocated through this backend.
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// Number of events that exist (created and not destroyed).
    pub fn live_events(&self) -> usize {
        self.events.len()
    }

    fn log(&mut self, op: HostOp) {
        if let Some(t) = self.trace.as_mut() {
            t.push(op);
        }
    }

    fn layout(nbytes: u64) -> Option<Layout> {
        Layout::from_size_align(usize::try_from(nbytes).ok()?, HOST_ALIGNMENT as usize).ok()
    }

    fn check_event(&self, event: EventHandle, op: &'static str) -> Result<(), BackendError> {
        if self.events.contains_key(&event) {
            Ok(())
        } else {
            Err(BackendError::Driver { op, detail: format!("unknown event {event}") })
        }
    }
}

impl Backend for HostBackend {
    fn device(&self) -> Device {
        Device { kind: DeviceKind::Host, index: 0 }
    }

    fn alignment(&self) -> u64 {
        HOST_ALIGNMENT
    }

    fn allocate(&mut self, nbytes: u64) -> Result<u64, BackendError> {
        if self.fail_next > 0 {
            self.fail_next -= 1;
            return Err(BackendError::OutOfMemory { nbytes, detail: "injected by the test hook".into() });
        }
        if let Some(limit) = self.limit_bytes {
            if self.live_bytes.saturating_add(nbytes) > limit {
                return Err(BackendError::OutOfMemory {
                    nbytes,
                    detail: format!("host backend limit of {limit} bytes, {} in use", self.live_bytes),
                });
            }
        }
        let layout = Self::layout(nbytes.max(1)).ok_or_else(|| BackendError::OutOfMemory {
            nbytes,
            detail: "size does not fit the address space".into(),
        })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc(layout) };
        if ptr.is_null() {
            return Err(BackendError::OutOfMemory { nbytes, detail: "the system allocator returned null".into() });
        }
        self.live_bytes += nbytes;
        let ptr = ptr as u64;
        self.log(HostOp::Allocate { ptr, nbytes });
        Ok(ptr)
    }

    unsafe fn free(&mut self, ptr: u64, nbytes: u64) {
        self.log(HostOp::Free { ptr, nbytes });
        self.live_bytes -= nbytes;
        if let Some(layout) = Self::layout(nbytes.max(1)) {
            // SAFETY: the caller guarantees `ptr` came from `allocate(nbytes)`.
            unsafe { dealloc(ptr as *mut u8, layout) };
        }
    }

    fn create_event(&mut self) -> Result<EventHandle, BackendError> {
        let e = self.next_event;
        self.next_event += 1;
        self.events.insert(e, true);
        Ok(e)
    }

    fn destroy_event(&mut self, event: EventHandle) {
        self.events.remove(&event);
    }

    fn record_event(&mut self, event: EventHandle, stream: StreamHandle) -> Result<(), BackendError> {
        self.check_event(event, "record_event")?;
        self.events.insert(event, !self.defer_events);
        self.log(HostOp::Record { event, stream });
        Ok(())
    }

    fn stream_wait_event(&mut self, stream: StreamHandle, event: EventHandle) -> Result<(), BackendError> {
        self.check_event(event, "stream_wait_event")?;
        self.log(HostOp::Wait { stream, event });
        Ok(())
    }

    fn event_complete(&mut self, event: EventHandle) -> Result<bool, BackendError> {
        self.check_event(event, "event_complete")?;
        Ok(self.events[&event])
    }

    fn synchronize_event(&mut self, event: EventHandle) -> Result<(), BackendError> {
        self.check_event(event, "synchronize_event")?;
        self.events.insert(event, true);
        self.log(HostOp::Synchronize { event });
        Ok(())
    }

    fn memory_info(&mut self) -> Option<(u64, u64)> {
        host_memory_info()
    }

    fn inject_oom(&mut self, count: u64) -> bool {
        self.fail_next = count;
        true
    }
}

/// `(MemAvailable, MemTotal)` from /proc/meminfo (Linux); None elsewhere.
pub fn host_memory_info() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    };
    Some((field("MemAvailable:")?, field("MemTotal:")?))
}
