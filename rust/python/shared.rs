//! The pool state shared by the Python object and every exported tensor.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::Backend;
use crate::pool::GatherPool;

/// A pool behind a mutex. Held in an `Arc` by the `PoolCore` Python object and by every DLPack
/// export, so the memory outlives the Python object while tensors still point into it.
pub struct Shared {
    pool: Mutex<GatherPool<Box<dyn Backend>>>,
}

impl Shared {
    pub fn new(pool: GatherPool<Box<dyn Backend>>) -> Arc<Self> {
        Arc::new(Shared { pool: Mutex::new(pool) })
    }

    /// Locks the pool. Poison-tolerant: the pool's methods keep it consistent at every early
    /// return, and a deleter must never panic because another thread did.
    ///
    /// Never call into Python (or drop a Python object) while holding the guard: a deleter
    /// running on a thread that holds the GIL would deadlock against it.
    pub fn lock(&self) -> MutexGuard<'_, GatherPool<Box<dyn Backend>>> {
        self.pool.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}
