//! Scheduling policies and the waiting queue they order.
//!
//! The queue is a set of `(QueueKey, sequence)` ordered by key; the head is admitted first, and
//! admission never skips the head (a head that does not fit blocks the ones behind it, so a large
//! or cache-cold request cannot be overtaken forever).
//!
//! - FCFS: key = order of `add_request`.
//! - Priority with aging: a lower `priority` value is served first, and waiting lowers it by one
//!   level every `aging_steps` scheduler steps. A request of priority `p` added at step `t` has
//!   effective priority `p - (now - t) / aging_steps`; comparing two requests at the same `now`
//!   the `now` cancels, so the order is the static key `p * aging_steps + t` (ties: earlier
//!   `arrival_time`, then add order), and the queue never needs re-sorting.
//!
//! Aging bound: a request R (priority `p_R`, added at step `t_R`) is never queued behind a
//! request Q (priority `p_Q`) added after step `t_R + (p_R - p_Q) * aging_steps`. With arrivals
//! bounded, R therefore reaches the head after finitely many admissions, and the head is never
//! skipped.
//!
//! A preempted sequence goes back under its original key: under FCFS that is ahead of every
//! request added after it, i.e. the head of the queue.

use std::collections::BTreeSet;

use crate::error::{ensure, Error, Result};
use crate::scheduler::slab::Handle;

/// The order in which waiting requests are admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served.
    Fcfs,
    /// Lower priority value first; waiting `aging_steps` steps raises a request by one level.
    Priority { aging_steps: u64 },
}

/// `aging_steps` of a priority policy when a configuration does not say.
pub const DEFAULT_AGING_STEPS: u64 = 100;

impl Policy {
    /// The name `from_name` reads.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Fcfs => "fcfs",
            Policy::Priority { .. } => "priority",
        }
    }

    /// The policy called `name` in configurations: `"fcfs"`, or `"priority"` aging one level
    /// every `aging_steps` steps (which must be positive; ignored by FCFS).
    pub fn from_name(name: &str, aging_steps: u64) -> Result<Policy> {
        match name {
            "fcfs" => Ok(Policy::Fcfs),
            "priority" => {
                ensure(aging_steps > 0, || "aging_steps must be positive".into())?;
                Ok(Policy::Priority { aging_steps })
            }
            other => Err(Error::InvalidArgument(format!(
                "policy must be 'fcfs' or 'priority', not {other:?}"
            ))),
        }
    }
}

/// Position of a sequence in the waiting queue (smaller is served first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct QueueKey {
    rank: i128,
    arrival: u64,
    order: u64,
    seq_index: u32,
}

impl QueueKey {
    /// The key of a request added as the `order`-th request, at scheduler step `step`.
    pub fn new(policy: Policy, priority: i64, arrival_time: f64, step: u64, order: u64) -> Self {
        match policy {
            Policy::Fcfs => QueueKey {
                rank: 0,
                arrival: 0,
                order,
                seq_index: 0,
            },
            Policy::Priority { aging_steps } => QueueKey {
                rank: i128::from(priority) * i128::from(aging_steps) + i128::from(step),
                arrival: ordered_bits(arrival_time),
                order,
                seq_index: 0,
            },
        }
    }

    /// The same position for sample `seq_index` of the request.
    pub fn for_sequence(self, seq_index: u32) -> Self {
        QueueKey { seq_index, ..self }
    }
}

/// Maps an `f64` to a `u64` with the same order (total order, NaN last).
fn ordered_bits(value: f64) -> u64 {
    let bits = value.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    }
}

/// Waiting sequences in admission order.
#[derive(Default)]
pub struct WaitingQueue {
    entries: BTreeSet<(QueueKey, Handle)>,
}

impl WaitingQueue {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn push(&mut self, key: QueueKey, seq: Handle) {
        let inserted = self.entries.insert((key, seq));
        debug_assert!(inserted, "sequence queued twice");
    }

    /// The sequence admitted next.
    pub fn head(&self) -> Option<Handle> {
        self.entries.first().map(|&(_, seq)| seq)
    }

    pub fn pop_head(&mut self) -> Option<Handle> {
        self.entries.pop_first().map(|(_, seq)| seq)
    }

    /// Removes `seq` queued under `key`; returns whether it was there.
    pub fn remove(&mut self, key: QueueKey, seq: Handle) -> bool {
        self.entries.remove(&(key, seq))
    }

    /// Waiting sequences in admission order.
    pub fn iter(&self) -> impl Iterator<Item = Handle> + '_ {
        self.entries.iter().map(|&(_, seq)| seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aging_key_orders_by_priority_then_waiting_time() {
        let policy = Policy::Priority { aging_steps: 10 };
        let old_low = QueueKey::new(policy, 5, 0.0, 0, 0);
        // Priority 0 added 49 steps later still goes first; added 51 steps later it goes after.
        assert!(QueueKey::new(policy, 0, 0.0, 49, 1) < old_low);
        assert!(QueueKey::new(policy, 0, 0.0, 51, 2) > old_low);
        // Same rank: the earlier arrival time wins, whatever the add order.
        assert!(QueueKey::new(policy, 0, -1.5, 0, 9) < QueueKey::new(policy, 0, 2.0, 0, 3));
        // FCFS ignores priority.
        assert!(
            QueueKey::new(Policy::Fcfs, 9, 0.0, 0, 0) < QueueKey::new(Policy::Fcfs, -9, 0.0, 0, 1)
        );
    }
}
