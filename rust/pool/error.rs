//! Typed pool errors. Every message names the problem and the fix.

use std::fmt;

use crate::backend::BackendError;

/// What went wrong in a pool call. After any error the pool's state is consistent and, except
/// for idle blocks freed while trying to satisfy an allocation, unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolError {
    /// The buffer does not belong to this pool (never acquired here, or from another pool).
    ForeignBuffer { ptr: u64 },
    /// The buffer was already returned (explicitly or by its tensor's deleter).
    DoubleRelease { ptr: u64 },
    /// The releasing tensor may be a stale holder of the block or its current one, and the pool
    /// cannot tell which (see [Note: stale holders] in pool/mod.rs).
    UnverifiableHolder { ptr: u64 },
    /// The device (even after freeing every idle block) cannot hold the request.
    OutOfMemory { nbytes: u64, detail: String },
    /// A CUDA pool was requested but no usable driver exists.
    NoCudaDriver { detail: String },
    /// The device string or ordinal is not usable.
    InvalidDevice { detail: String },
    /// A malformed request (size overflow, bad configuration value).
    InvalidArgument { detail: String },
    /// The driver failed in a call other than allocation.
    Backend { op: &'static str, detail: String },
}

impl PoolError {
    /// Stable short name of the kind: the name of the Python exception class the bindings map
    /// it onto (rust/python/errors.rs).
    pub fn kind(&self) -> &'static str {
        match self {
            PoolError::ForeignBuffer { .. } => "ForeignBufferError",
            PoolError::DoubleRelease { .. } => "DoubleReleaseError",
            PoolError::UnverifiableHolder { .. } => "UnverifiableReleaseError",
            PoolError::OutOfMemory { .. } => "PoolOutOfMemoryError",
            PoolError::NoCudaDriver { .. } => "NoCudaDriverError",
            PoolError::InvalidDevice { .. } => "InvalidDeviceError",
            PoolError::InvalidArgument { .. } => "InvalidRequestError",
            PoolError::Backend { .. } => "PoolBackendError",
        }
    }
}

impl From<BackendError> for PoolError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::OutOfMemory { nbytes, detail } => PoolError::OutOfMemory { nbytes, detail },
            BackendError::NoDriver(detail) => PoolError::NoCudaDriver { detail },
            BackendError::InvalidDevice(detail) => PoolError::InvalidDevice { detail },
            BackendError::Driver { op, detail } => PoolError::Backend { op, detail },
        }
    }
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::ForeignBuffer { ptr } => write!(
                f,
                "buffer at {ptr:#x} is not checked out from this pool: release only tensors that \
                 this pool's acquire() returned (not views or copies of them), to the pool that \
                 returned them"
            ),
            PoolError::DoubleRelease { ptr } => write!(
                f,
                "buffer at {ptr:#x} was already released (by release() or by its tensor being \
                 freed): release each acquired tensor exactly once and do not use it afterwards"
            ),
            PoolError::UnverifiableHolder { ptr } => write!(
                f,
                "cannot verify that this tensor holds the buffer checked out at {ptr:#x} rather than \
                 an older checkout of the same memory that release() already returned and whose \
                 tensor is still alive (the buffer came from acquire_dlpack, which records no \
                 holder): drop the tensor instead (its last reference returns the buffer), or \
                 free the released tensor first"
            ),
            PoolError::OutOfMemory { nbytes, detail } => write!(
                f,
                "out of memory allocating a {nbytes}-byte gather buffer ({detail}) even after \
                 freeing every idle pool block: lower the gather budget, shard more widely, or \
                 free memory held elsewhere (e.g. torch.cuda.empty_cache())"
            ),
            PoolError::NoCudaDriver { detail } => write!(
                f,
                "cannot create a CUDA gather-buffer pool: {detail}. Install the NVIDIA driver \
                 (libcuda.so) on a machine with a GPU, or use GatherBufferPool(\"cpu\")"
            ),
            PoolError::InvalidDevice { detail } => write!(f, "{detail}"),
            PoolError::InvalidArgument { detail } => write!(f, "{detail}"),
            PoolError::Backend { op, detail } => write!(
                f,
                "the device driver failed in {op}: {detail}. This usually means an earlier \
                 kernel failed (run with CUDA_LAUNCH_BLOCKING=1 to find it) or the device was lost"
            ),
        }
    }
}

impl std::error::Error for PoolError {}
