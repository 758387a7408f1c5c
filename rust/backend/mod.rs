//! Memory backends of the pool.
//!
//! A backend owns nothing the pool does not tell it about: it hands out raw byte ranges and
//! opaque event handles, and the pool keeps every piece of bookkeeping. Handles are plain
//! integers (device pointers, `CUstream`/`CUevent` values) so the core stays free of CUDA types
//! and the trait stays object safe (`Box<dyn Backend>`).

pub mod cuda;
pub mod host;

use std::fmt;

/// A raw stream handle: `CUstream` on CUDA (`torch.cuda.current_stream().cuda_stream`),
/// any caller-chosen id on the host backend (0 is the default stream).
pub type StreamHandle = u64;

/// An opaque event handle created by [`Backend::create_event`].
pub type EventHandle = u64;

/// Which memory a pool manages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Host,
    Cuda,
}

/// A device: kind plus ordinal (always 0 for the host).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Device {
    pub kind: DeviceKind,
    pub index: u32,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            DeviceKind::Host => write!(f, "cpu"),
            DeviceKind::Cuda => write!(f, "cuda:{}", self.index),
        }
    }
}

/// Failures a backend reports; the pool maps them onto [`crate::pool::PoolError`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendError {
    /// The device has no memory left for this request (a real OOM, or an injected one).
    OutOfMemory { nbytes: u64, detail: String },
    /// No usable CUDA driver (libcuda missing, or `cuInit` failed).
    NoDriver(String),
    /// The device ordinal does not exist.
    InvalidDevice(String),
    /// Any other driver error: the call and the driver's error code.
    Driver { op: &'static str, detail: String },
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendError::OutOfMemory { nbytes, detail } => {
                write!(f, "out of memory allocating {nbytes} bytes ({detail})")
            }
            BackendError::NoDriver(d) => write!(f, "no CUDA driver: {d}"),
            BackendError::InvalidDevice(d) => write!(f, "invalid device: {d}"),
            BackendError::Driver { op, detail } => write!(f, "{op} failed: {detail}"),
        }
    }
}

/// Raw memory and stream-ordering primitives for one device.
///
/// Called only with the pool's lock held, hence `&mut self`. `Send` because the pool (and its
/// backend) is shared with DLPack deleters that run on arbitrary threads.
pub trait Backend: Send {
    /// The device this backend allocates on.
    fn device(&self) -> Device;

    /// Byte granularity of allocations; the pool rounds capacities up to it.
    fn alignment(&self) -> u64;

    /// Allocates `nbytes` (> 0, a multiple of [`Backend::alignment`]); returns the address.
    fn allocate(&mut self, nbytes: u64) -> Result<u64, BackendError>;

    /// Frees a range returned by [`Backend::allocate`] with the same `nbytes`.
    ///
    /// # Safety
    /// `ptr` must come from `allocate(nbytes)` on this backend and not be freed yet; no pending
    /// device work may still use it (the pool waits on the block's release event first).
    unsafe fn free(&mut self, ptr: u64, nbytes: u64);

    /// Creates an event (no timing).
    fn create_event(&mut self) -> Result<EventHandle, BackendError>;

    /// Destroys an event created by [`Backend::create_event`].
    fn destroy_event(&mut self, event: EventHandle);

    /// Records `event` on `stream`: it completes when the work queued there so far completes.
    fn record_event(&mut self, event: EventHandle, stream: StreamHandle) -> Result<(), BackendError>;

    /// Makes future work on `stream` wait for `event` (device-side, no host sync).
    fn stream_wait_event(&mut self, stream: StreamHandle, event: EventHandle) -> Result<(), BackendError>;

    /// Whether `event` has completed (non-blocking).
    fn event_complete(&mut self, event: EventHandle) -> Result<bool, BackendError>;

    /// Blocks the host until `event` completes (used only by trim and OOM recovery).
    fn synchronize_event(&mut self, event: EventHandle) -> Result<(), BackendError>;

    /// `(free_bytes, total_bytes)` of the device, if known.
    fn memory_info(&mut self) -> Option<(u64, u64)>;

    /// Testing hook: make the next `count` allocations fail with an out-of-memory error.
    /// Backends that cannot inject faults ignore it and return false.
    fn inject_oom(&mut self, _count: u64) -> bool {
        false
    }
}

impl<B: Backend + ?Sized> Backend for Box<B> {
    fn device(&self) -> Device {
        (**self).device()
    }
    fn alignment(&self) -> u64 {
        (**self).alignment()
    }
    fn allocate(&mut self, nbytes: u64) -> Result<u64, BackendError> {
        (**self).allocate(nbytes)
    }
    unsafe fn free(&mut self, ptr: u64, nbytes: u64) {
        (**self).free(ptr, nbytes)
    }
    fn create_event(&mut self) -> Result<EventHandle, BackendError> {
        (**self).create_event()
    }
    fn destroy_event(&mut self, event: EventHandle) {
        (**self).destroy_event(event)
    }
    fn record_event(&mut self, event: EventHandle, stream: StreamHandle) -> Result<(), BackendError> {
        (**self).record_event(event, stream)
    }
    fn stream_wait_event(&mut self, stream: StreamHandle, event: EventHandle) -> Result<(), BackendError> {
        (**self).stream_wait_event(stream, event)
    }
    fn event_complete(&mut self, event: EventHandle) -> Result<bool, BackendError> {
        (**self).event_complete(event)
    }
    fn synchronize_event(&mut self, event: EventHandle) -> Result<(), BackendError> {
        (**self).synchronize_event(event)
    }
    fn memory_info(&mut self) -> Option<(u64, u64)> {
        (**self).memory_info()
    }
    fn inject_oom(&mut self, count: u64) -> bool {
        (**self).inject_oom(count)
    }
}
