//! The gate between a runtime's serving loop and its K/V bytes: which step may touch them now.
//!
//! A disk tier's I/O thread copies blocks out of the K/V bytes (offloads) and into them (loads)
//! while the engine runs; the block manager never gives it a block a step's tables hold, so K/V
//! written at a step's slots and read through its tables — before that step is finished — never
//! meet the I/O thread. A call with any other step (one already finished, another runtime's) is
//! refused before it touches anything.
//!
//! Invariants:
//! - `awaiting` is the id of the step between `begin_step` and `finish_step`, None outside:
//!   `begin_step` sets it and `finish_step` clears it under the write lock, after and before the
//!   scheduler's own bookkeeping, so no step's blocks change hands while a gated call runs.
//! - A gated call holds the read lock from its check to its end, so `finish_step` (and the frees
//!   it makes) waits for it. The lock order is always the scheduler's mutex, then the gate (begin,
//!   finish), or the gate, then the store's mutex (a step's K/V call): no cycle.

use std::sync::{RwLock, RwLockReadGuard};

use crate::error::{Error, Result};
use crate::scheduler::StepId;

/// Which step of one runtime may touch its K/V bytes now.
#[derive(Debug, Default)]
pub(super) struct StepGate {
    awaiting: RwLock<Option<StepId>>,
}

impl StepGate {
    /// Records `step` as the one awaiting `finish_step`.
    pub fn open(&self, step: StepId) {
        // A panic cannot leave an `Option<StepId>` half-written: a poisoned lock is still right.
        *self.awaiting.write().unwrap_or_else(|e| e.into_inner()) = Some(step);
    }

    /// Runs `finish` (of the step awaiting it) holding the write lock, so it waits for every
    /// gated call in progress; clears the awaited step once it succeeds (a refused finish
    /// changed nothing, so the step still awaits).
    pub fn close_after<T>(&self, finish: impl FnOnce() -> Result<T>) -> Result<T> {
        let mut awaiting = self.awaiting.write().unwrap_or_else(|e| e.into_inner());
        let result = finish()?;
        *awaiting = None;
        Ok(result)
    }

    /// Holds the gate open for `step` while the guard lives; `InvalidArgument` unless `step` is
    /// the step awaiting `finish_step`.
    pub fn enter(&self, step: StepId) -> Result<RwLockReadGuard<'_, Option<StepId>>> {
        let guard = self.awaiting.read().unwrap_or_else(|e| e.into_inner());
        if *guard != Some(step) {
            return Err(Error::InvalidArgument(format!(
                "step {} is not this runtime's step awaiting its finish: K/V are touched only \
                 through that step, before it is finished",
                step.number()
            )));
        }
        Ok(guard)
    }
}
