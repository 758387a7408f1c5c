//! CUDA backend (milestone 2: not built yet; every CUDA pool request raises NoCudaDriverError).

use super::Backend;
use crate::pool::PoolError;

pub fn open(index: u32) -> Result<Box<dyn Backend>, PoolError> {
    Err(PoolError::NoCudaDriver { detail: format!("the CUDA backend is not built yet (asked for cuda:{index})") })
}
