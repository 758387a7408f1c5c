//! Bounded telemetry log of pool events.

use std::collections::VecDeque;

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
}

/// Ring buffer of the last `capacity` events.
#[derive(Debug)]
pub struct EventLog {
    capacity: usize,
    next_seq: u64,
    entries: VecDeque<PoolEvent>,
}

impl EventLog {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, next_seq: 0, entries: VecDeque::with_capacity(capacity.min(4096)) }
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
        self.entries.push_back(PoolEvent { seq, kind, nbytes, ptr, stream, charged_bytes });
    }

    /// The retained events, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &PoolEvent> {
        self.entries.iter()
    }
}
