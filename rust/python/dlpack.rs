//! DLPack export of pool blocks (zero copy).
//!
//! [Note: DLPack deleter]
//! The consumer (torch) calls the managed tensor's deleter when the last tensor sharing the
//! storage dies: maybe on another thread, maybe without the GIL (CUDA caching-allocator
//! callbacks, autograd threads). The deleter therefore touches no Python object: it locks the
//! pool's mutex, returns the lease if it is still current (an explicit `release` may have
//! returned it already: see [Note: lease generations] in pool/lease.rs) and frees the context.
//! Everything runs inside `catch_unwind`, so a bug can never unwind across the C boundary, and
//! the mutex is taken poison-tolerant. The pool itself lives in an `Arc` held by every export,
//! so it outlives the Python pool object while any tensor still points into it.
//!
//! An unconsumed capsule (never passed to a consumer) still owns its managed tensor: the
//! capsule destructor calls the deleter, so the lease comes back.

use std::ffi::{c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;

use super::shared::Shared;
use crate::backend::{Device, DeviceKind};
use crate::pool::LeaseId;

pub const CAPSULE_VERSIONED: &CStr = c"dltensor_versioned";
pub const CAPSULE_LEGACY: &CStr = c"dltensor";

/// DLPack ABI version this module produces.
pub const DLPACK_MAJOR: u32 = 1;
pub const DLPACK_MINOR: u32 = 0;

pub const KDL_CPU: i32 = 1;
pub const KDL_CUDA: i32 = 2;

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    pub device_type: i32,
    pub device_id: i32,
}

impl DLDevice {
    pub fn of(device: Device) -> Self {
        match device.kind {
            DeviceKind::Host => DLDevice { device_type: KDL_CPU, device_id: 0 },
            DeviceKind::Cuda => DLDevice { device_type: KDL_CUDA, device_id: device.index as i32 },
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDataType {
    pub code: u8,
    pub bits: u8,
    pub lanes: u16,
}

#[repr(C)]
pub struct DLTensor {
    pub data: *mut c_void,
    pub device: DLDevice,
    pub ndim: i32,
    pub dtype: DLDataType,
    pub shape: *mut i64,
    pub strides: *mut i64,
    pub byte_offset: u64,
}

#[repr(C)]
pub struct DLManagedTensor {
    pub dl_tensor: DLTensor,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
pub struct DLPackVersion {
    pub major: u32,
    pub minor: u32,
}

#[repr(C)]
pub struct DLManagedTensorVersioned {
    pub version: DLPackVersion,
    pub manager_ctx: *mut c_void,
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    pub flags: u64,
    pub dl_tensor: DLTensor,
}

// DLPack type codes.
const KDL_INT: u8 = 0;
const KDL_UINT: u8 = 1;
const KDL_FLOAT: u8 = 2;
const KDL_BFLOAT: u8 = 4;
const KDL_COMPLEX: u8 = 5;
const KDL_BOOL: u8 = 6;

/// Supported dtypes: (DLPack type, bytes), indexed like `TORCH_DTYPE_NAMES`.
const DTYPES: [(DLDataType, u64); 15] = [
    (DLDataType { code: KDL_FLOAT, bits: 32, lanes: 1 }, 4),    // 0 float32
    (DLDataType { code: KDL_FLOAT, bits: 16, lanes: 1 }, 2),    // 1 float16
    (DLDataType { code: KDL_BFLOAT, bits: 16, lanes: 1 }, 2),   // 2 bfloat16
    (DLDataType { code: KDL_FLOAT, bits: 64, lanes: 1 }, 8),    // 3 float64
    (DLDataType { code: KDL_INT, bits: 8, lanes: 1 }, 1),       // 4 int8
    (DLDataType { code: KDL_UINT, bits: 8, lanes: 1 }, 1),      // 5 uint8
    (DLDataType { code: KDL_INT, bits: 16, lanes: 1 }, 2),      // 6 int16
    (DLDataType { code: KDL_INT, bits: 32, lanes: 1 }, 4),      // 7 int32
    (DLDataType { code: KDL_INT, bits: 64, lanes: 1 }, 8),      // 8 int64
    (DLDataType { code: KDL_BOOL, bits: 8, lanes: 1 }, 1),      // 9 bool
    (DLDataType { code: KDL_COMPLEX, bits: 64, lanes: 1 }, 8),  // 10 complex64
    (DLDataType { code: KDL_COMPLEX, bits: 128, lanes: 1 }, 16), // 11 complex128
    (DLDataType { code: KDL_UINT, bits: 16, lanes: 1 }, 2),     // 12 uint16
    (DLDataType { code: KDL_UINT, bits: 32, lanes: 1 }, 4),     // 13 uint32
    (DLDataType { code: KDL_UINT, bits: 64, lanes: 1 }, 8),     // 14 uint64
];

/// `torch.<name>` of each `DTYPES` entry, same order.
pub const TORCH_DTYPE_NAMES: [&str; 15] = [
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
    "complex64", "complex128", "uint16", "uint32", "uint64",
];

/// Looks up a dtype code; None if unknown.
pub fn dtype(code: u32) -> Option<(DLDataType, u64)> {
    DTYPES.get(code as usize).copied()
}

/// Shape and strides of one export, validated. `dims` holds the shape followed by the
/// contiguous strides (one allocation for both).
pub struct Layout {
    pub dims: Vec<i64>,
    pub nbytes: u64,
}

impl Layout {
    /// Validates a shape (non-negative dims, no overflow) for elements of `itemsize` bytes.
    /// `shape` becomes the `dims` buffer (the strides are appended in place: one allocation
    /// per export).
    pub fn contiguous(shape: Vec<i64>, itemsize: u64) -> Result<Self, String> {
        let ndim = shape.len();
        let mut dims = shape;
        dims.resize(2 * ndim, 0);
        let mut numel: u64 = 1;
        for i in (0..ndim).rev() {
            let d = dims[i];
            if d < 0 {
                return Err(format!("shape {:?} has a negative dimension: pass sizes >= 0", &dims[..ndim]));
            }
            dims[ndim + i] = numel.max(1) as i64;
            numel = numel
                .checked_mul(d as u64)
                .ok_or_else(|| format!("shape {:?} has more elements than fit in memory", &dims[..ndim]))?;
        }
        let nbytes = numel
            .checked_mul(itemsize)
            .filter(|n| *n <= i64::MAX as u64)
            .ok_or_else(|| format!("shape {:?} needs more bytes than fit in memory", &dims[..ndim]))?;
        Ok(Layout { dims, nbytes })
    }
}

/// Owner of one exported lease, reachable from the managed tensor's `manager_ctx`.
struct ExportCtx {
    shared: Arc<Shared>,
    lease: LeaseId,
    dims: Vec<i64>,
}

impl ExportCtx {
    fn dl_tensor(&mut self, ptr: u64, device: DLDevice, dtype: DLDataType) -> DLTensor {
        let ndim = self.dims.len() / 2;
        let base = self.dims.as_mut_ptr();
        DLTensor {
            data: ptr as *mut c_void,
            device,
            ndim: ndim as i32,
            dtype,
            shape: base,
            // SAFETY: `dims` holds 2 * ndim values.
            strides: unsafe { base.add(ndim) },
            byte_offset: 0,
        }
    }
}

#[repr(C)]
struct ExportVersioned {
    managed: DLManagedTensorVersioned, // first field: the managed pointer is the box pointer
    ctx: ExportCtx,
}

#[repr(C)]
struct ExportLegacy {
    managed: DLManagedTensor,
    ctx: ExportCtx,
}

/// Everything needed to export one checked-out block.
pub struct ExportRequest {
    pub shared: Arc<Shared>,
    pub lease: LeaseId,
    pub ptr: u64,
    pub device: DLDevice,
    pub dtype: DLDataType,
    pub dims: Vec<i64>,
}

/// Wraps a lease in a new capsule ("dltensor_versioned" or legacy "dltensor"). On failure the
/// lease is returned to the pool.
pub fn export_capsule(py: Python<'_>, req: ExportRequest, versioned: bool) -> PyResult<Bound<'_, PyAny>> {
    let ExportRequest { shared, lease, ptr, device, dtype, dims } = req;
    let mut ctx = ExportCtx { shared, lease, dims };
    let tensor = ctx.dl_tensor(ptr, device, dtype);
    // SAFETY (both arms): the box is leaked into the capsule; ownership passes to the consumer
    // that renames the capsule, or back to `capsule_destructor_*` if none does. If
    // PyCapsule_New fails it takes no ownership, so the deleter is run here (returning the
    // lease and freeing the box).
    let raw = unsafe {
        if versioned {
            let b = Box::into_raw(Box::new(ExportVersioned {
                managed: DLManagedTensorVersioned {
                    version: DLPackVersion { major: DLPACK_MAJOR, minor: DLPACK_MINOR },
                    manager_ctx: std::ptr::null_mut(),
                    deleter: Some(delete_versioned),
                    flags: 0,
                    dl_tensor: tensor,
                },
                ctx,
            }));
            (*b).managed.manager_ctx = b as *mut c_void;
            let cap = ffi::PyCapsule_New(b as *mut c_void, CAPSULE_VERSIONED.as_ptr(), Some(capsule_destructor_versioned));
            if cap.is_null() {
                delete_versioned(b as *mut DLManagedTensorVersioned);
            }
            cap
        } else {
            let b = Box::into_raw(Box::new(ExportLegacy {
                managed: DLManagedTensor { dl_tensor: tensor, manager_ctx: std::ptr::null_mut(), deleter: Some(delete_legacy) },
                ctx,
            }));
            (*b).managed.manager_ctx = b as *mut c_void;
            let cap = ffi::PyCapsule_New(b as *mut c_void, CAPSULE_LEGACY.as_ptr(), Some(capsule_destructor_legacy));
            if cap.is_null() {
                delete_legacy(b as *mut DLManagedTensor);
            }
            cap
        }
    };
    // SAFETY: `raw` is a new reference, or null with an exception set.
    unsafe { Bound::from_owned_ptr_or_err(py, raw) }
}

/// Returns the lease from a deleter. Never panics, never touches Python.
fn return_from_deleter(ctx: &ExportCtx) {
    let mut pool = ctx.shared.lock();
    if let Err(e) = pool.release_if_current(ctx.lease) {
        // The driver refused to record the release event: the block stays checked out (leaked
        // rather than reused while a kernel may still use it).
        eprintln!("zbuf: a tensor's buffer could not be returned to the pool: {e}");
    }
}

unsafe extern "C" fn delete_versioned(m: *mut DLManagedTensorVersioned) {
    if m.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `m` is the first field of an `ExportVersioned` leaked by `export_capsule`;
        // consumers call the deleter exactly once.
        let b = unsafe { Box::from_raw(m as *mut ExportVersioned) };
        return_from_deleter(&b.ctx);
    }));
}

unsafe extern "C" fn delete_legacy(m: *mut DLManagedTensor) {
    if m.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: as in `delete_versioned`.
        let b = unsafe { Box::from_raw(m as *mut ExportLegacy) };
        return_from_deleter(&b.ctx);
    }));
}

unsafe extern "C" fn capsule_destructor_versioned(capsule: *mut ffi::PyObject) {
    // A consumer renames the capsule ("used_dltensor_versioned") when it takes ownership; only a
    // capsule still carrying the original name owns its tensor. IsValid sets no exception.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_VERSIONED.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, CAPSULE_VERSIONED.as_ptr()) as *mut DLManagedTensorVersioned;
            if let Some(d) = (*m).deleter {
                d(m);
            }
        }
    }
}

unsafe extern "C" fn capsule_destructor_legacy(capsule: *mut ffi::PyObject) {
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, CAPSULE_LEGACY.as_ptr()) == 1 {
            let m = ffi::PyCapsule_GetPointer(capsule, CAPSULE_LEGACY.as_ptr()) as *mut DLManagedTensor;
            if let Some(d) = (*m).deleter {
                d(m);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_layout() {
        let l = Layout::contiguous(vec![2, 3, 4], 2).unwrap();
        assert_eq!(l.dims, vec![2, 3, 4, 12, 4, 1]);
        assert_eq!(l.nbytes, 48);
        assert!(matches!(Layout::contiguous(vec![-1], 4), Err(m) if m.contains("[-1]")));
        assert!(Layout::contiguous(vec![i64::MAX, 4], 4).is_err());
        assert_eq!(Layout::contiguous(vec![], 4).unwrap().nbytes, 4);
    }
}
