//! CUDA backend: raw device allocations, events and memory info through the driver API
//! (cudarc's `sys` bindings, `dynamic-loading`: libcuda is dlopen-ed on first use).
//!
//! [Note: CUDA context]
//! The backend retains the device's *primary* context, the one the CUDA runtime (and so torch)
//! uses, so pointers, streams and events are interchangeable with torch's. Every driver call
//! runs with that context current: if the calling thread has another context current (or none,
//! e.g. a DLPack deleter on a foreign thread), it is pushed for the call and popped after.
//!
//! [Note: driver probe]
//! cudarc panics when libcuda or one of its symbols is missing. `open` first probes for the
//! library (`is_culib_present`, which only tries to dlopen), and runs the remaining set-up under
//! `catch_unwind`, so a machine without a driver gets `PoolError::NoCudaDriver`, never a panic
//! or an abort.

use std::ffi::CStr;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;

use super::{Backend, BackendError, Device, DeviceKind, EventHandle, StreamHandle};
use crate::pool::PoolError;

/// Capacity granularity: cuMemAlloc returns 512-byte aligned ranges; rounding capacities to it
/// lets blocks of neighbouring request sizes serve each other.
pub const CUDA_ALIGNMENT: u64 = 512;

/// Whether libcuda can be loaded (never panics).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen candidate library names.
    catch_unwind(|| unsafe { cu::is_culib_present() }).unwrap_or(false)
}

/// Opens a backend for `cuda:index`.
pub fn open(index: u32) -> Result<Box<dyn Backend>, PoolError> {
    primary_context(index).map(|b| Box::new(b) as Box<dyn Backend>)
}

/// `cuda:index`'s primary context, retained, after the probe of [Note: driver probe].
fn primary_context(index: u32) -> Result<CudaBackend, PoolError> {
    if !driver_present() {
        return Err(PoolError::NoCudaDriver {
            detail: "libcuda.so (the NVIDIA driver library) was not found on this machine".into(),
        });
    }
    match catch_unwind(AssertUnwindSafe(|| CudaBackend::new(index))) {
        Ok(r) => r.map_err(PoolError::from),
        Err(_) => Err(PoolError::NoCudaDriver {
            detail: "the NVIDIA driver library lacks a required entry point (driver too old?)".into(),
        }),
    }
}

fn error_name(code: cu::CUresult) -> String {
    let mut s: *const std::ffi::c_char = ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or leaves it null.
    let r = unsafe { cu::cuGetErrorName(code, &mut s) };
    if r == cu::CUresult::CUDA_SUCCESS && !s.is_null() {
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    } else {
        format!("{code:?}")
    }
}

fn check(code: cu::CUresult, op: &'static str) -> Result<(), BackendError> {
    if code == cu::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Driver { op, detail: error_name(code) })
    }
}

/// One device's primary context.
pub struct CudaBackend {
    index: u32,
    device: cu::CUdevice,
    ctx: cu::CUcontext,
}

// SAFETY: CUDA contexts and the handles made in them may be used from any thread; the pool
// serialises calls through its mutex.
unsafe impl Send for CudaBackend {}

/// Makes the backend's context current for the guard's lifetime (see [Note: CUDA context]).
struct CurrentContext {
    pushed: bool,
}

impl CurrentContext {
    fn enter(ctx: cu::CUcontext) -> Result<Self, BackendError> {
        let mut current: cu::CUcontext = ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check(unsafe { cu::cuCtxGetCurrent(&mut current) }, "cuCtxGetCurrent")?;
        if current == ctx {
            return Ok(CurrentContext { pushed: false });
        }
        // SAFETY: `ctx` is a retained primary context.
        check(unsafe { cu::cuCtxPushCurrent_v2(ctx) }, "cuCtxPushCurrent")?;
        Ok(CurrentContext { pushed: true })
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped: cu::CUcontext = ptr::null_mut();
            // SAFETY: pops the context pushed by `enter` on this thread.
            unsafe { cu::cuCtxPopCurrent_v2(&mut popped) };
        }
    }
}

impl CudaBackend {
    fn new(index: u32) -> Result<Self, BackendError> {
        // SAFETY: plain driver calls with out-pointers to locals.
        unsafe {
            let r = cu::cuInit(0);
            if r != cu::CUresult::CUDA_SUCCESS {
                return Err(BackendError::NoDriver(format!("cuInit failed with {}", error_name(r))));
            }
            let mut count = 0;
            check(cu::cuDeviceGetCount(&mut count), "cuDeviceGetCount")?;
            if index as i64 >= count as i64 {
                return Err(BackendError::InvalidDevice(format!(
                    "cuda:{index} does not exist: this machine has {count} CUDA device(s); use cuda:0..cuda:{}",
                    (count - 1).max(0)
                )));
            }
            let mut device: cu::CUdevice = 0;
            check(cu::cuDeviceGet(&mut device, index as i32), "cuDeviceGet")?;
            let mut ctx: cu::CUcontext = ptr::null_mut();
            check(cu::cuDevicePrimaryCtxRetain(&mut ctx, device), "cuDevicePrimaryCtxRetain")?;
            Ok(CudaBackend { index, device, ctx })
        }
    }

    fn enter(&self) -> Result<CurrentContext, BackendError> {
        CurrentContext::enter(self.ctx)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `new`.
        unsafe { cu::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        Device { kind: DeviceKind::Cuda, index: self.index }
    }

    fn alignment(&self) -> u64 {
        CUDA_ALIGNMENT
    }

    fn allocate(&mut self, nbytes: u64) -> Result<u64, BackendError> {
        let _ctx = self.enter()?;
        let mut dptr: cu::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; the context is current.
        let r = unsafe { cu::cuMemAlloc_v2(&mut dptr, nbytes as usize) };
        match r {
            cu::CUresult::CUDA_SUCCESS => Ok(dptr),
            cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(BackendError::OutOfMemory { nbytes, detail: format!("cuMemAlloc on cuda:{}", self.index) })
            }
            other => Err(BackendError::Driver { op: "cuMemAlloc", detail: error_name(other) }),
        }
    }

    unsafe fn free(&mut self, ptr: u64, _nbytes: u64) {
        if let Ok(_ctx) = self.enter() {
            // SAFETY: the caller guarantees `ptr` came from cuMemAlloc and is unused.
            unsafe { cu::cuMemFree_v2(ptr) };
        }
    }

    fn create_event(&mut self) -> Result<EventHandle, BackendError> {
        let _ctx = self.enter()?;
        let mut ev: cu::CUevent = ptr::null_mut();
        let flags = cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: out-pointer to a local; the context is current.
        check(unsafe { cu::cuEventCreate(&mut ev, flags) }, "cuEventCreate")?;
        Ok(ev as u64)
    }

    fn destroy_event(&mut self, event: EventHandle) {
        if let Ok(_ctx) = self.enter() {
            // SAFETY: `event` came from create_event.
            unsafe { cu::cuEventDestroy_v2(event as cu::CUevent) };
        }
    }

    fn record_event(&mut self, event: EventHandle, stream: StreamHandle) -> Result<(), BackendError> {
        let _ctx = self.enter()?;
        // SAFETY: a live event and a stream handle of this context (torch's).
        check(unsafe { cu::cuEventRecord(event as cu::CUevent, stream as cu::CUstream) }, "cuEventRecord")
    }

    fn stream_wait_event(&mut self, stream: StreamHandle, event: EventHandle) -> Result<(), BackendError> {
        let _ctx = self.enter()?;
        // SAFETY: as above.
        check(unsafe { cu::cuStreamWaitEvent(stream as cu::CUstream, event as cu::CUevent, 0) }, "cuStreamWaitEvent")
    }

    fn event_complete(&mut self, event: EventHandle) -> Result<bool, BackendError> {
        let _ctx = self.enter()?;
        // SAFETY: a live event.
        match unsafe { cu::cuEventQuery(event as cu::CUevent) } {
            cu::CUresult::CUDA_SUCCESS => Ok(true),
            cu::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(BackendError::Driver { op: "cuEventQuery", detail: error_name(other) }),
        }
    }

    fn synchronize_event(&mut self, event: EventHandle) -> Result<(), BackendError> {
        let _ctx = self.enter()?;
        // SAFETY: a live event.
        check(unsafe { cu::cuEventSynchronize(event as cu::CUevent) }, "cuEventSynchronize")
    }

    fn memory_info(&mut self) -> Option<(u64, u64)> {
        let _ctx = self.enter().ok()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals.
        let r = unsafe { cu::cuMemGetInfo_v2(&mut free, &mut total) };
        (r == cu::CUresult::CUDA_SUCCESS).then_some((free as u64, total as u64))
    }
}

/// [Note: page-locked host ranges]
/// The device copies to and from host memory asynchronously only where that memory is
/// page-locked. Torch's pinned tensors come from its caching host allocator, which rounds each
/// to a power of two (a 2.8 GB block's activations take 4 GiB) and pins with `cudaHostAlloc`
/// on the calling thread, holding the GIL: at qwen3-14b the first step that offloaded blocks
/// pinned about 40 GiB for 23.7 GiB moved, inside that step. `page_lock` locks a range the
/// caller allocated, of exactly its size: its pages are first touched by `touch_threads`
/// threads (the page faults run in parallel), then registered with the device's primary
/// context. The bindings call it with the GIL released, so a background thread pins while the
/// Python thread works. Registering 4 KiB pages ran at 1.3 GB/s on an H100 machine (33 GB of
/// qwen3-14b's offloaded blocks in 25 s, benches/results/onepath14.md), so the range's whole
/// 2 MiB pages are first advised to be huge pages (`MADV_HUGEPAGE`: transparent huge pages in
/// "madvise" mode, the common setting, serve them; the kernel then faults and pins 512 times
/// fewer pages). The advice is only advice: where the kernel refuses it the range is locked
/// as it is.

/// How long each part of [`page_lock`] took: the two stall different things (the page faults the
/// host's memory map, the registration the driver's calls from other threads).
#[derive(Clone, Copy, Debug)]
pub struct LockTimes {
    /// Faulting the range's pages in (`touch_threads` threads).
    pub touch: Duration,
    /// Registering them with the device's context (`cuMemHostRegister`).
    pub register: Duration,
}

/// Page-locks `nbytes` of host memory at `ptr` for `cuda:index` (contents unchanged).
///
/// # Safety
/// `ptr..ptr + nbytes` must be memory the caller owns, readable and writable, and must stay
/// allocated until [`page_unlock`].
pub unsafe fn page_lock(index: u32, ptr: u64, nbytes: u64, touch_threads: usize) -> Result<LockTimes, PoolError> {
    let backend = primary_context(index)?;
    let start = Instant::now();
    advise_huge_pages(ptr as usize, nbytes as usize);
    // SAFETY: the caller's range (see above).
    unsafe { touch_pages(ptr as *mut u8, nbytes as usize, touch_threads) };
    let touched = Instant::now();
    let _ctx = backend.enter()?;
    // SAFETY: the caller's range; the context is current.
    let r = unsafe { cu::cuMemHostRegister_v2(ptr as *mut std::ffi::c_void, nbytes as usize, 0) };
    match r {
        cu::CUresult::CUDA_SUCCESS => Ok(LockTimes { touch: touched - start, register: touched.elapsed() }),
        cu::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(PoolError::OutOfMemory {
            nbytes,
            detail: "cuMemHostRegister: the host could not page-lock that much memory".into(),
        }),
        other => Err(BackendError::Driver { op: "cuMemHostRegister", detail: error_name(other) }.into()),
    }
}

/// Undoes [`page_lock`] for the range starting at `ptr`.
///
/// # Safety
/// `ptr` must have been locked by [`page_lock`] and no device copy may still use it.
pub unsafe fn page_unlock(index: u32, ptr: u64) -> Result<(), PoolError> {
    let backend = primary_context(index)?;
    let _ctx = backend.enter()?;
    // SAFETY: a range locked by `page_lock`, unused by the device (the caller's promise).
    check(unsafe { cu::cuMemHostUnregister(ptr as *mut std::ffi::c_void) }, "cuMemHostUnregister")
        .map_err(PoolError::from)
}

/// The huge page size the advice is given in whole units of.
const HUGE_PAGE: usize = 2 << 20;

/// Advises the whole huge pages inside `ptr..ptr + nbytes` to be huge pages; a refusal (no
/// transparent huge pages on this kernel) leaves them as they are.
fn advise_huge_pages(ptr: usize, nbytes: usize) {
    let start = ptr.next_multiple_of(HUGE_PAGE);
    let end = (ptr + nbytes) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: advice on whole pages inside the caller's range; it changes no contents.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

/// Bytes between two touches: every page of any size the host uses is touched at least once.
const TOUCH_STRIDE: usize = 4096;

/// Faults in every page of `ptr..ptr + nbytes`, writable, from `threads` threads (each a
/// contiguous share), leaving the contents as they were.
///
/// # Safety
/// The range must be memory the caller owns, readable and writable, untouched by others while
/// this runs.
unsafe fn touch_pages(ptr: *mut u8, nbytes: usize, threads: usize) {
    let pages = nbytes.div_ceil(TOUCH_STRIDE);
    let per_thread = pages.div_ceil(threads.max(1)).max(1);
    let base = ptr as usize;
    std::thread::scope(|scope| {
        for first in (0..pages).step_by(per_thread) {
            scope.spawn(move || {
                for page in first..(first + per_thread).min(pages) {
                    let p = (base + page * TOUCH_STRIDE) as *mut u8;
                    // SAFETY: inside the caller's range; a read and a write of the same value.
                    unsafe { p.write_volatile(p.read_volatile()) };
                }
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_without_a_driver_is_a_clean_error() {
        if driver_present() {
            return; // exercised by tests/gpu on the GPU machine
        }
        match open(0) {
            Err(PoolError::NoCudaDriver { detail }) => assert!(detail.contains("libcuda")),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("opened a CUDA backend without a driver"),
        }
    }

    #[test]
    fn advising_huge_pages_keeps_the_contents() {
        for nbytes in [0usize, 1, HUGE_PAGE - 1, 3 * HUGE_PAGE + 17] {
            let mut data: Vec<u8> = (0..nbytes).map(|i| (i * 31 % 251) as u8).collect();
            let expected = data.clone();
            advise_huge_pages(data.as_mut_ptr() as usize, nbytes);
            // SAFETY: the vector's own bytes.
            unsafe { touch_pages(data.as_mut_ptr(), nbytes, 2) };
            assert_eq!(data, expected);
        }
    }

    #[test]
    fn touching_pages_keeps_the_contents() {
        for (nbytes, threads) in [(0usize, 4usize), (1, 1), (4095, 3), (3 * 4096 + 17, 2), (10 * 4096, 16)] {
            let mut data: Vec<u8> = (0..nbytes).map(|i| (i * 31 % 251) as u8).collect();
            let expected = data.clone();
            // SAFETY: the vector's own bytes, not shared while the threads run.
            unsafe { touch_pages(data.as_mut_ptr(), nbytes, threads) };
            assert_eq!(data, expected);
        }
    }

    #[test]
    fn page_lock_without_a_driver_is_a_clean_error() {
        if driver_present() {
            return; // exercised by tests/gpu on the GPU machine
        }
        let mut data = vec![0u8; 8192];
        // SAFETY: the vector's own bytes; it outlives the (failing) call.
        match unsafe { page_lock(0, data.as_mut_ptr() as u64, 8192, 2) } {
            Err(PoolError::NoCudaDriver { .. }) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}
