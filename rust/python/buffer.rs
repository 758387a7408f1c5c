//! `DLPackBuffer`: a checked-out block speaking the DLPack protocol (`__dlpack__`,
//! `__dlpack_device__`), for consumers other than the torch fast path (`torch.from_dlpack`,
//! `numpy.from_dlpack`, CuPy, JAX).

use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;

use super::dlpack::{self, DLDataType, DLDevice, ExportRequest, KDL_CUDA};
use super::errors::to_py;
use super::shared::Shared;
use crate::pool::LeaseId;

/// What is needed to export the lease; taken by the first `__dlpack__`.
struct Pending {
    lease: LeaseId,
    ptr: u64,
    dtype: DLDataType,
    dims: Vec<i64>,
    acquire_stream: u64,
}

/// A lease not yet handed to a consumer. Exported at most once; if never exported, dropping
/// the buffer returns the lease.
#[pyclass(frozen, module = "zbuf._core")]
pub struct DLPackBuffer {
    shared: Arc<Shared>,
    device: DLDevice,
    pending: Mutex<Option<Pending>>,
}

impl DLPackBuffer {
    pub fn new(shared: Arc<Shared>, device: DLDevice, lease: LeaseId, ptr: u64, dtype: DLDataType, dims: Vec<i64>, acquire_stream: u64) -> Self {
        DLPackBuffer { shared, device, pending: Mutex::new(Some(Pending { lease, ptr, dtype, dims, acquire_stream })) }
    }
}

/// The raw handle a DLPack `stream` argument names on CUDA (array API conventions): None and 1
/// are the legacy default stream (`CU_STREAM_LEGACY` = 1 in the driver API), 2 the per-thread
/// default (`CU_STREAM_PER_THREAD` = 2), -1 "no synchronisation", anything else a raw handle.
fn consumer_stream(stream: Option<i64>) -> Option<u64> {
    match stream {
        Some(-1) => None,
        None => Some(1),
        Some(s) => Some(s as u64),
    }
}

#[pymethods]
impl DLPackBuffer {
    /// `(device_type, device_id)` as DLPack enums (kDLCPU = 1, kDLCUDA = 2).
    fn __dlpack_device__(&self) -> (i32, i32) {
        (self.device.device_type, self.device.device_id)
    }

    /// Exports the buffer once as a DLPack capsule: versioned when the consumer's
    /// `max_version` allows 1.x, legacy otherwise. On CUDA the consumer's `stream` is made to
    /// wait for the block's previous release. Never copies (`copy=True` is refused).
    #[pyo3(signature = (*, stream=None, max_version=None, dl_device=None, copy=None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if copy == Some(true) {
            return Err(PyBufferError::new_err("the pool exports its buffers without copying: pass copy=None or False"));
        }
        if let Some(d) = dl_device {
            if d != (self.device.device_type, self.device.device_id) {
                return Err(PyBufferError::new_err(format!(
                    "the buffer lives on DLPack device {:?}, not {d:?}: export it where it lives",
                    (self.device.device_type, self.device.device_id)
                )));
            }
        }
        let p = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| PyBufferError::new_err("this buffer was already exported: each DLPackBuffer exports once"))?;
        if self.device.device_type == KDL_CUDA {
            if let Some(s) = consumer_stream(stream).filter(|&s| s != p.acquire_stream) {
                let ordered = self.shared.lock().order_stream(p.lease, s);
                if let Err(e) = ordered {
                    let _ = self.shared.lock().release_if_current(p.lease);
                    return Err(to_py(e));
                }
            }
        }
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        let req = ExportRequest { shared: Arc::clone(&self.shared), lease: p.lease, ptr: p.ptr, device: self.device, dtype: p.dtype, dims: p.dims };
        dlpack::export_capsule(py, req, versioned)
    }

    /// Whether `__dlpack__` was already called.
    #[getter]
    fn exported(&self) -> bool {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }
}

impl Drop for DLPackBuffer {
    fn drop(&mut self) {
        if let Some(p) = self.pending.get_mut().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = self.shared.lock().release_if_current(p.lease);
        }
    }
}
