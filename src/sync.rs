//! The atomics the lock-free parts are written against: `std` normally, `loom` under `--cfg loom`,
//! so the same code is model-checked by loom and run for real everywhere else.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
