//! The one write path into the K/V bytes of a cache a disk tier shares: the step.
//!
//! A disk tier's I/O thread copies blocks out of the cache (offloads) and into it (loads) while
//! the engine runs; the block manager never gives it a block a step's tables hold, so K/V written
//! at a step's `slot_mapping` and read through its `block_tables` — before that step's `update` —
//! never meets the I/O thread. Any other slot might be under a copy: a data race, undefined
//! behaviour. So from `attach_disk_tier` to `detach_disk_tier` the cache is *gated*: each of its
//! calls must come with the scheduler's step awaiting update (`step=`), whose own arrays it uses;
//! slots, tables or copies given by hand, a step already updated, or another scheduler's step are
//! refused with `InvalidArgumentError` before anything is touched.
//!
//! Invariants:
//! - `awaiting` is the id of the step between the scheduler's `schedule` and its `update`, None
//!   outside: `schedule` sets it and `update` clears it under the write lock, after and before
//!   the core's own bookkeeping, so no step's blocks change hands while a gated call runs.
//! - A gated call holds the read lock from its check to its end, so `update` (and the frees it
//!   makes) waits for it. Both locks are taken with the GIL released; the order is always the
//!   scheduler's mutex, then the gate (schedule, update), or the gate, then the cache's mutex (a
//!   gated call): no cycle.

use std::sync::{RwLock, RwLockReadGuard};

use crate::error::{Error, Result};
use crate::scheduler::StepId;

/// Which step of one scheduler may touch its tier-shared cache now.
#[derive(Default)]
pub(crate) struct StepGate {
    awaiting: RwLock<Option<StepId>>,
}

impl StepGate {
    /// Records `step` as the one awaiting update (from `schedule`), or none (`update`).
    pub fn set(&self, step: Option<StepId>) {
        // A panic cannot leave an `Option<StepId>` half-written: a poisoned lock is still right.
        *self.awaiting.write().unwrap_or_else(|e| e.into_inner()) = step;
    }

    /// Runs `update` (of the step awaiting it) holding the write lock, so it waits for every
    /// gated call in progress; clears the awaited step once it succeeds (a refused update
    /// changed nothing, so the step still awaits).
    pub fn close_after<T>(&self, update: impl FnOnce() -> Result<T>) -> Result<T> {
        let mut awaiting = self.awaiting.write().unwrap_or_else(|e| e.into_inner());
        let result = update()?;
        *awaiting = None;
        Ok(result)
    }

    /// Holds the gate open for `step` while the guard lives; `InvalidArgument` unless `step` is
    /// the step awaiting update.
    pub fn enter(&self, step: StepId) -> Result<RwLockReadGuard<'_, Option<StepId>>> {
        let guard = self.awaiting.read().unwrap_or_else(|e| e.into_inner());
        if *guard != Some(step) {
            return Err(Error::InvalidArgument(format!(
                "step {} is not the step awaiting update of the scheduler whose disk tier shares \
                 this KVCache: K/V may be touched only through that step, before its update",
                step.number()
            )));
        }
        Ok(guard)
    }
}
