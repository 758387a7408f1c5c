//! Bounded telemetry log of pool events.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::backend::StreamHandle;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// Served by an idle block.
    Hit,
    /// Served by a new pool block.
    Allocate,
    /// Served outside the pool (budget full, recovering, or not in the hot set).
    AllocateOutside,
    /// A lease came back.
    Release,
    /// A pool block was freed (LRU eviction, budget shrink, trim, retired block returned).
    Evict,
    /// The device refused an allocation.
    OutOfMemory,
    /// The retry counter rose; `nbytes` is the new budget.
    Pressure,
    /// The one-shot recovery started; `nbytes` is the hot set's size.
    RecoveryStart,
    /// The recovery finished.
    RecoveryEnd,
    /// The budget was set by the caller; `nbytes` is the new budget.
    SetBudget,
}

impl EventKind {
    pub fn name(self) -> &'static str {
        match self {
            EventKind::Hit => "hit",
            EventKind::Allocate => "allocate",
            EventKind::AllocateOutside => "allocate_outside",
            EventKind::Release => "release",
            EventKind::Evict => "evict",
            EventKind::OutOfMemory => "out_of_memory",
            EventKind::Pressure => "pressure",
            EventKind::RecoveryStart => "recovery_start",
            EventKind::RecoveryEnd => "recovery_end",
            EventKind::SetBudget => "set_budget",
        }
    }
}

/// One log entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolEvent {
    /// Position in the pool's history (0-based, never reused, so gaps show dropped entries).
    pub seq: u64,
    pub kind: EventKind,
    /// Block capacity, or the value described by the kind.
    pub nbytes: u64,
    /// Block address (0 when not about a block).
    pub ptr: u64,
    pub stream: StreamHandle,
    /// `charged_bytes` after the event.
    pub charged_bytes: u64,
    /// When it happened, if the log was timing its events (else 0): microseconds since the
    /// Unix epoch, as torch's allocation history stamps its entries (`time_us`), so that a
    /// caller can lay the pool's buffers beside torch's allocations at the same moment.
    pub time_us: u64,
}

/// Ring buffer of the last `capacity` events.
#[derive(Debug)]
pub struct EventLog {
    capacity: usize,
    next_seq: u64,
    entries: VecDeque<PoolEvent>,
    /// Stamp each event with the time: off by default, since a clock read costs about half of
    /// an acquire and release pair through the core (about 27 ns an event on x86-64 Linux).
    timed: bool,
}

impl EventLog {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, next_seq: 0, entries: VecDeque::with_capacity(capacity.min(4096)), timed: false }
    }

    /// Whether the events from now on carry their time (`PoolEvent::time_us`).
    pub fn set_timed(&mut self, timed: bool) {
        self.timed = timed;
    }

    pub fn push(&mut self, kind: EventKind, nbytes: u64, ptr: u64, stream: StreamHandle, charged_bytes: u64) {
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.capacity == 0 {
            return;
        }
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        // A clock before the epoch reads 0: the stamp orders events, it decides nothing.
        let time_us = if self.timed {
            SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
        } else {
            0
        };
        self.entries.push_back(PoolEvent { seq, kind, nbytes, ptr, stream, charged_bytes, time_us });
    }

    /// The retained events, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &PoolEvent> {
        self.entries.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_events_are_stamped_in_order_on_the_unix_clock() {
        let mut log = EventLog::new(8);
        log.push(EventKind::Hit, 0, 0, 0, 0);
        assert_eq!(log.iter().next().unwrap().time_us, 0, "untimed by default");
        log.set_timed(true);
        let before = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64;
        for i in 0..4 {
            log.push(EventKind::Hit, i, 0, 0, 0);
        }
        let after = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as u64;
        let stamps: Vec<u64> = log.iter().skip(1).map(|e| e.time_us).collect();
        assert!(stamps.windows(2).all(|w| w[0] <= w[1]), "{stamps:?}");
        assert!(before <= stamps[0] && stamps[3] <= after, "{before} {stamps:?} {after}");
    }
}
