//! zbuf: the gather-buffer pool (pure Rust core) and its Python bindings.

#[cfg(feature = "python")]
mod python;
