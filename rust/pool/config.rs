//! Pool configuration.

use super::PoolError;

/// Sizing and telemetry options of a [`super::GatherPool`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Bytes the pool may keep in blocks it owns (idle + checked out). Requests that do not fit
    /// are served by allocations outside the pool (misses), never refused for that reason.
    pub budget_bytes: u64,
    /// Upper bound for `budget_bytes`; `set_budget` clamps to it.
    pub hard_cap_bytes: u64,
    /// Entries kept by the telemetry event log (oldest dropped first). 0 disables it.
    pub event_log_capacity: usize,
    /// Cumulative allocator retries (counted from the first observation) after which the
    /// one-shot recovery starts.
    pub recovery_retry_threshold: u64,
}

impl PoolConfig {
    /// Checks the values and clamps the budget to the hard cap.
    pub fn validated(mut self) -> Result<Self, PoolError> {
        if self.hard_cap_bytes == 0 {
            return Err(PoolError::InvalidArgument {
                detail: "hard_cap_bytes must be positive: pass the most bytes the pool may ever hold".into(),
            });
        }
        if self.recovery_retry_threshold == 0 {
            return Err(PoolError::InvalidArgument {
                detail: "recovery_retry_threshold must be at least 1".into(),
            });
        }
        self.budget_bytes = self.budget_bytes.min(self.hard_cap_bytes);
        Ok(self)
    }
}
