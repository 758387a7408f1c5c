//! `zbuf._core.page_lock` / `page_unlock`: host ranges locked for the device's asynchronous
//! copies ([Note: page-locked host ranges] in backend/cuda.rs), with the GIL released.

use pyo3::prelude::*;

use super::errors::{invalid_request, to_py};
use crate::backend::cuda;

/// Threads that fault in a range's pages before it is registered.
const TOUCH_THREADS: usize = 8;

/// Page-locks `nbytes` at `ptr` (a CPU tensor's data, which the caller keeps alive until
/// `page_unlock`) for `cuda:device_index`, its pages faulted in by `touch_threads` threads
/// (default: the machine's cores, at most `TOUCH_THREADS`); returns the seconds the touching and
/// the registration took.
#[pyfunction]
#[pyo3(signature = (device_index, ptr, nbytes, touch_threads=None))]
pub fn page_lock(py: Python<'_>, device_index: u32, ptr: u64, nbytes: u64,
                 touch_threads: Option<usize>) -> PyResult<(f64, f64)> {
    if ptr == 0 || nbytes == 0 {
        return Err(invalid_request(py, format!(
            "page_lock needs a host range: got address {ptr:#x}, {nbytes} bytes")));
    }
    if touch_threads == Some(0) {
        return Err(invalid_request(py, "page_lock needs at least one touch thread: got 0".into()));
    }
    let threads = touch_threads.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, |n| n.get()).min(TOUCH_THREADS)
    });
    // SAFETY: the caller's range (the Python caller owns the tensor and keeps it alive).
    let times = py.detach(move || unsafe { cuda::page_lock(device_index, ptr, nbytes, threads) })
        .map_err(to_py)?;
    Ok((times.touch.as_secs_f64(), times.register.as_secs_f64()))
}

/// Undoes `page_lock` at `ptr`; the caller has waited for every copy that used it.
#[pyfunction]
pub fn page_unlock(py: Python<'_>, device_index: u32, ptr: u64) -> PyResult<()> {
    // SAFETY: the caller's promise (see above).
    py.detach(move || unsafe { cuda::page_unlock(device_index, ptr) }).map_err(to_py)
}
