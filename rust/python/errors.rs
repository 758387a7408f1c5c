//! Maps pool errors onto the exception classes of `zbuf.errors`.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::pool::PoolError;

static ERRORS_MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();

/// The exception class named `name` in `zbuf.errors`.
fn error_class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyType>> {
    let module = ERRORS_MODULE.get_or_try_init(py, || py.import("zbuf.errors").map(Bound::unbind))?;
    Ok(module.bind(py).getattr(name)?.cast_into::<PyType>()?)
}

/// Builds the Python exception for a pool error.
pub fn to_py(err: PoolError) -> PyErr {
    Python::attach(|py| raise(py, err.kind(), err.to_string()))
}

/// An exception of class `zbuf.errors.<kind>` with `message`.
pub fn raise(py: Python<'_>, kind: &str, message: String) -> PyErr {
    match error_class(py, kind) {
        Ok(cls) => PyErr::from_type(cls, message),
        Err(e) => PyRuntimeError::new_err(format!("{message} (zbuf.errors.{kind} unavailable: {e})")),
    }
}
