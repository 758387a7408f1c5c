//! zbuf: the gather-buffer pool (pure Rust core) and its Python bindings.
//!
//! * [`pool`]: the pool logic over a [`backend::Backend`] (no Python, no CUDA types).
//! * [`pressure`]: the allocator-pressure policy that shrinks the byte budget and triggers the
//!   one-shot recovery.
//! * [`backend`]: host memory (CPU runs, CI, fuzzing with OOM injection) and CUDA (cudarc,
//!   loaded at run time).
//! * `python` (feature `python`): thin PyO3 bindings and the DLPack export.

pub mod backend;
pub mod pressure;
pub mod pool;

#[cfg(feature = "python")]
mod python;
