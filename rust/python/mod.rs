//! PyO3 bindings: the `zbuf._core` extension module.

mod buffer;
mod dlpack;
mod errors;
mod page_lock;
mod pool;
mod shared;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::add_to(m)?;
    m.add_class::<pool::PoolCore>()?;
    m.add_class::<buffer::DLPackBuffer>()?;
    m.add_function(wrap_pyfunction!(page_lock::page_lock, m)?)?;
    m.add_function(wrap_pyfunction!(page_lock::page_unlock, m)?)?;
    m.add("DLPACK_VERSION", (dlpack::DLPACK_MAJOR, dlpack::DLPACK_MINOR))?;
    m.add("DEFAULT_BUDGET_DIVISOR", pool::DEFAULT_BUDGET_DIVISOR)?;
    m.add("DEFAULT_HARD_CAP_DIVISOR", pool::DEFAULT_HARD_CAP_DIVISOR)?;
    Ok(())
}
