//! Lease identity: which checkout of which block a caller holds.

/// Identifies one checkout: the block's slot plus the slot's generation at checkout time.
///
/// [Note: lease generations]
/// A slot's generation rises on every checkout, so a lease id names exactly one checkout. An
/// explicit release followed by the tensor's deleter (or two explicit releases) presents the
/// same id twice; the second time the block is idle or checked out under a newer generation, so
/// the pool recognises the stale id and leaves the state alone ("never both").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(u64);

impl LeaseId {
    pub(crate) fn new(slot: u32, generation: u32) -> Self {
        LeaseId(((slot as u64) << 32) | generation as u64)
    }

    pub(crate) fn slot(self) -> usize {
        (self.0 >> 32) as usize
    }
}

/// A checked-out buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: LeaseId,
    /// Start address of the block (device pointer on CUDA).
    pub ptr: u64,
    /// Bytes the block holds (the request rounded up to the backend's alignment, or more when
    /// a larger idle block was the best fit).
    pub capacity: u64,
    /// Served by an allocation outside the pool (freed on release, never cached).
    pub outside: bool,
    /// Served by an idle block.
    pub hit: bool,
    /// A stale holder could name this block: record the new holder's owner key with
    /// `GatherPool::set_holder_key` (see [Note: stale holders] in pool/mod.rs).
    pub verify_holder: bool,
}
