//! The pool's exception classes, defined here and re-exported by `zbuf.errors`, and the map from
//! Rust error kinds onto them (by type: no class is looked up by name at raise time).
//!
//! Several classes have two bases (`InvalidRequestError(PoolError, ValueError)`, so that
//! `except ValueError` keeps working), which `pyo3::create_exception!` cannot express; they are
//! built once, when the module loads, by calling `type(name, bases, namespace)`. Their
//! `__module__` is `zbuf.errors`, where users import them from (reprs and pickles name it).

use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::pool::PoolError;

/// The exception classes, in `CLASSES` order.
#[derive(Clone, Copy, Debug)]
pub enum Class {
    Pool,
    ForeignBuffer,
    DoubleRelease,
    UnverifiableRelease,
    OutOfMemory,
    NoCudaDriver,
    InvalidDevice,
    InvalidRequest,
    UnsupportedDtype,
    Backend,
}

/// A second base beside `PoolError` (the base class itself derives from `RuntimeError`).
#[derive(Clone, Copy)]
enum Also {
    Nothing,
    Value,
    Memory,
    Type,
}

/// (class, name, second base, docstring); `PoolError` first: the others derive from it.
const CLASSES: [(Class, &str, Also, &str); 10] = [
    (Class::Pool, "PoolError", Also::Nothing, "Base class of every gather-buffer pool error."),
    (Class::ForeignBuffer, "ForeignBufferError", Also::Value,
     "A released tensor was never checked out from this pool (or is a view or copy of one)."),
    (Class::DoubleRelease, "DoubleReleaseError", Also::Nothing,
     "A tensor's buffer was already returned (by `release` or by the tensor being freed)."),
    (Class::UnverifiableRelease, "UnverifiableReleaseError", Also::Nothing,
     "`release` cannot tell whether the tensor holds its block or is a stale alias of it.\n\n\
      Only for buffers from `acquire_dlpack` (which records no holder) while a tensor released\n\
      earlier from the same memory is still alive; the pool is unchanged, and dropping the tensor\n\
      still returns the block."),
    (Class::OutOfMemory, "PoolOutOfMemoryError", Also::Memory,
     "The device refused the allocation even after the pool freed all its idle blocks.\n\n\
      The pool's state is consistent afterwards; the request simply failed."),
    (Class::NoCudaDriver, "NoCudaDriverError", Also::Nothing,
     "A CUDA pool was requested on a machine without a usable NVIDIA driver."),
    (Class::InvalidDevice, "InvalidDeviceError", Also::Value,
     "The device string or ordinal is not usable (malformed, or no such GPU)."),
    (Class::InvalidRequest, "InvalidRequestError", Also::Value,
     "A malformed request: negative or overflowing shape, bad sizes or options."),
    (Class::UnsupportedDtype, "UnsupportedDtypeError", Also::Type,
     "The dtype cannot be exported through DLPack by the pool."),
    (Class::Backend, "PoolBackendError", Also::Nothing,
     "The device driver failed in a call other than allocation (e.g. recording an event)."),
];

static TYPES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

fn build(py: Python<'_>) -> PyResult<Vec<Py<PyType>>> {
    let mut built: Vec<Py<PyType>> = Vec::with_capacity(CLASSES.len());
    for (class, name, also, doc) in CLASSES {
        debug_assert_eq!(class as usize, built.len());
        let pool_base = match built.first() {
            Some(p) => p.bind(py).clone(),
            None => py.get_type::<PyRuntimeError>(),
        };
        let bases = match also {
            Also::Nothing => PyTuple::new(py, [pool_base])?,
            Also::Value => PyTuple::new(py, [pool_base, py.get_type::<PyValueError>()])?,
            Also::Memory => PyTuple::new(py, [pool_base, py.get_type::<PyMemoryError>()])?,
            Also::Type => PyTuple::new(py, [pool_base, py.get_type::<PyTypeError>()])?,
        };
        let namespace = PyDict::new(py);
        namespace.set_item("__module__", "zbuf.errors")?;
        namespace.set_item("__qualname__", name)?;
        namespace.set_item("__doc__", doc)?;
        let cls = py.get_type::<PyType>().call1((name, bases, namespace))?.cast_into::<PyType>()?;
        built.push(cls.unbind());
    }
    Ok(built)
}

/// Adds every class to the extension module (called once, from its init).
pub fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let types = TYPES.get_or_try_init(py, || build(py))?;
    for ((_, name, _, _), cls) in CLASSES.iter().zip(types) {
        m.add(*name, cls.bind(py))?;
    }
    Ok(())
}

/// An exception of `class` with `message`.
pub fn new_err(py: Python<'_>, class: Class, message: String) -> PyErr {
    match TYPES.get(py) {
        Some(types) => PyErr::from_type(types[class as usize].bind(py).clone(), message),
        // Unreachable: the module's init builds them before any pool exists.
        None => PyRuntimeError::new_err(message),
    }
}

/// The class of a pool error.
pub fn class_of(err: &PoolError) -> Class {
    match err {
        PoolError::ForeignBuffer { .. } => Class::ForeignBuffer,
        PoolError::DoubleRelease { .. } => Class::DoubleRelease,
        PoolError::UnverifiableHolder { .. } => Class::UnverifiableRelease,
        PoolError::OutOfMemory { .. } => Class::OutOfMemory,
        PoolError::NoCudaDriver { .. } => Class::NoCudaDriver,
        PoolError::InvalidDevice { .. } => Class::InvalidDevice,
        PoolError::InvalidArgument { .. } => Class::InvalidRequest,
        PoolError::Backend { .. } => Class::Backend,
    }
}

/// Builds the Python exception for a pool error.
pub fn to_py(err: PoolError) -> PyErr {
    Python::attach(|py| new_err(py, class_of(&err), err.to_string()))
}

/// An `InvalidRequestError` with `message` (a malformed argument found by the bindings).
pub fn invalid_request(py: Python<'_>, message: String) -> PyErr {
    new_err(py, Class::InvalidRequest, message)
}
