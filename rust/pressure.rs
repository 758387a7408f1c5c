//! Allocator-pressure policy: when the caching allocator starts retrying (cudaMalloc failed, it
//! freed its cache and tried again), the pool is holding memory the rest of the step needs.
//!
//! [Note: pressure policy]
//! * The first observation only sets the baseline: retries from before the pool existed say
//!   nothing about the pool.
//! * Each later observation where the cumulative `num_alloc_retries` rose shrinks the budget to
//!   `min(budget, max(free / 4, checked_out_bytes, floor_bytes))`: a quarter of what the device
//!   still has free, but never below what is checked out right now (those bytes are in use by
//!   the step; refusing to cache them again would only turn hits into misses) nor below the
//!   floor, the working set the memory plan sized the budget to (`GatherPool::set_floor`): the
//!   plan's gathers need those bytes at once whatever the budget says, so a budget below them
//!   frees nothing for the allocator, it only serves each gather by an allocation of its own,
//!   freed on release (at qwen3-32b as rank 0 of 8 the budget fell to 20 MB and the pool made
//!   about 640 device allocations a step, benches/results/onepath32b.md). The budget never grows
//!   here; the scheduler raises it again with `set_budget`.
//! * Once the retries seen since the baseline reach the recovery threshold (3 by default, as in
//!   DeepSpeed's pool), the one-shot recovery starts (see `[Note: one-shot recovery]` in
//!   pool/mod.rs). It never starts a second time in a pool's life.
//! * A counter that went down (the caller reset the allocator's statistics) re-baselines.

/// What the pool must do after an observation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PressureAction {
    /// Nothing changed.
    None,
    /// Shrink the budget to this many bytes.
    Shrink { budget_bytes: u64 },
    /// Shrink the budget and start the one-shot recovery.
    ShrinkAndRecover { budget_bytes: u64 },
}

/// Divisor of the free device memory in the shrunk budget.
pub const FREE_FRACTION_DIVISOR: u64 = 4;

/// Tracks the retry counter across observations.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PressureTracker {
    /// Counter value at the previous observation (None before the first).
    last_retries: Option<u64>,
    /// Retries seen since the baseline.
    retries_seen: u64,
    /// Whether the one-shot recovery was already triggered.
    recovery_triggered: bool,
}

impl PressureTracker {
    /// Feeds one observation; `budget_bytes`, `checked_out_bytes` and `floor_bytes` are the
    /// pool's current values, `recovery_threshold` its configured threshold.
    pub fn observe(
        &mut self,
        num_alloc_retries: u64,
        free_bytes: u64,
        budget_bytes: u64,
        checked_out_bytes: u64,
        floor_bytes: u64,
        recovery_threshold: u64,
    ) -> PressureAction {
        let previous = self.last_retries.replace(num_alloc_retries);
        let rise = match previous {
            Some(prev) if num_alloc_retries > prev => num_alloc_retries - prev,
            _ => return PressureAction::None,
        };
        self.retries_seen += rise;
        let kept = (free_bytes / FREE_FRACTION_DIVISOR).max(checked_out_bytes).max(floor_bytes);
        let shrunk = budget_bytes.min(kept);
        if !self.recovery_triggered && self.retries_seen >= recovery_threshold {
            self.recovery_triggered = true;
            PressureAction::ShrinkAndRecover { budget_bytes: shrunk }
        } else {
            PressureAction::Shrink { budget_bytes: shrunk }
        }
    }

    /// Retries counted since the baseline.
    pub fn retries_seen(&self) -> u64 {
        self.retries_seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_then_shrink_then_one_shot_recovery() {
        let mut t = PressureTracker::default();
        assert_eq!(t.observe(5, 1000, 800, 0, 0, 3), PressureAction::None);
        assert_eq!(t.observe(5, 1000, 800, 0, 0, 3), PressureAction::None);
        assert_eq!(t.observe(6, 1000, 800, 100, 0, 3), PressureAction::Shrink { budget_bytes: 250 });
        assert_eq!(t.observe(8, 400, 250, 300, 0, 3), PressureAction::ShrinkAndRecover { budget_bytes: 250 });
        assert_eq!(t.observe(20, 400, 250, 0, 0, 3), PressureAction::Shrink { budget_bytes: 100 });
        // A reset counter re-baselines without counting.
        assert_eq!(t.observe(0, 400, 100, 0, 0, 3), PressureAction::None);
        assert_eq!(t.retries_seen(), 15);
    }

    #[test]
    fn the_shrink_stops_at_the_floor_and_never_raises_the_budget() {
        let mut t = PressureTracker::default();
        assert_eq!(t.observe(0, 0, 800, 0, 600, 3), PressureAction::None);
        // Nothing free, nothing checked out: the plan's working set is what stays.
        assert_eq!(t.observe(1, 0, 800, 0, 600, 3), PressureAction::Shrink { budget_bytes: 600 });
        // A floor above the budget does not raise it: only `set_budget` does.
        assert_eq!(t.observe(2, 0, 500, 0, 600, 3), PressureAction::Shrink { budget_bytes: 500 });
    }
}
