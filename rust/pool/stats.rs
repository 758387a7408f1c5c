//! Counters and byte totals of a pool.

/// A snapshot of the pool's accounting (see `GatherPool::stats`).
///
/// Terms: a *pool block* is memory the pool owns and may cache (charged to the budget); an
/// *outside* allocation serves a request the budget cannot hold and is freed on release.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Current byte budget for pool blocks (after pressure shrinks and `set_budget`).
    pub budget_bytes: u64,
    /// The budget never exceeds this.
    pub hard_cap_bytes: u64,
    /// The pressure policy never shrinks the budget below this (`GatherPool::set_floor`).
    pub floor_bytes: u64,
    /// Bytes of pool blocks, idle + checked out.
    pub charged_bytes: u64,
    /// Bytes of idle pool blocks (cached for reuse).
    pub idle_bytes: u64,
    /// Bytes of checked-out pool blocks.
    pub checked_out_bytes: u64,
    /// Bytes of checked-out outside allocations.
    pub outside_bytes: u64,
    /// Bytes freed by the pool but still waiting for their release event before the memory
    /// goes back to the device.
    pub pending_free_bytes: u64,
    /// Highest `charged_bytes` ever.
    pub high_water_bytes: u64,
    /// Highest `charged_bytes + outside_bytes` ever (all memory handed out at once).
    pub high_water_total_bytes: u64,
    /// Number of pool blocks (idle + checked out).
    pub entries: u64,
    /// Number of live leases (pool blocks and outside allocations).
    pub checked_out: u64,
    /// Acquires served by an idle block.
    pub hits: u64,
    /// Acquires served by a new allocation (pool block or outside).
    pub misses: u64,
    /// Pool blocks freed to make room, to follow a budget shrink, or by `trim`.
    pub evictions: u64,
    /// Successful device allocations (pool blocks + outside).
    pub allocations: u64,
    /// The subset of `allocations` made outside the pool.
    pub outside_allocations: u64,
    /// Releases (explicit or by a tensor's deleter).
    pub releases: u64,
    /// Allocations the device refused (each acquire retries once after freeing idle blocks).
    pub alloc_failures: u64,
    /// Pressure observations that saw the retry counter rise.
    pub pressure_events: u64,
    /// True while the one-shot recovery drains the blocks checked out when it started.
    pub recovering: bool,
    /// True once the recovery has finished; from then on only the hot set is admitted.
    pub recovered: bool,
}
