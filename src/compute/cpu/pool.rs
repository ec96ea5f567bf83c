//! The one rayon pool every kernel runs on (attention, linear, sampling): a model step
//! alternates them on the same threads instead of pools fighting over the cores.
//!
//! Invariants:
//! - One pool per process. Its size is the last [`set_num_threads`] value, else
//!   `PAGEDKV_NUM_THREADS`, else the number of CPUs available (both read once, at first use);
//!   always within `1..=MAX_THREADS` (an environment value outside it is ignored).
//! - [`set_num_threads`] builds the new pool before it records the count, so a count the system
//!   cannot start (`OutOfMemory`) is refused with the previous pool and count unchanged; a
//!   failure to build the pool later (first use, a forked child) is an error of that call.
//! - The pool remembers the pid that built it. A child made by `fork()` inherits the pool's memory
//!   but none of its threads, so a call in the child sees another pid and builds a fresh pool; the
//!   parent's pool object is leaked there on purpose (dropping it would signal threads that do
//!   not exist in the child).
//! - Callers take an `Arc` of the pool, so resizing never pulls a pool from under a running call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use rayon::{ThreadPool, ThreadPoolBuilder};

use crate::error::{ensure, Error, Result};

/// Environment variable read for the default thread count.
pub const NUM_THREADS_ENV: &str = "PAGEDKV_NUM_THREADS";

/// The most threads the pool runs. The pool starts every thread at once, and the kernels gain
/// nothing from more threads than CPUs; the bound keeps a mistyped count from exhausting the
/// process's threads or address space.
pub const MAX_THREADS: usize = 1024;

/// Thread count set by [`set_num_threads`]; 0 when unset.
static REQUESTED_THREADS: AtomicUsize = AtomicUsize::new(0);

struct Pool {
    pid: u32,
    pool: Arc<ThreadPool>,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// Sets the number of pool threads, `1..=MAX_THREADS` (from the next call on).
pub fn set_num_threads(threads: usize) -> Result<()> {
    ensure((1..=MAX_THREADS).contains(&threads), || {
        format!("the number of threads must be in 1..={MAX_THREADS}, got {threads}")
    })?;
    let mut slot = lock_pool();
    let pid = std::process::id();
    if !slot
        .as_ref()
        .is_some_and(|p| p.pid == pid && p.pool.current_num_threads() == threads)
    {
        let pool = build(threads)?;
        retire(slot.replace(pool));
    }
    REQUESTED_THREADS.store(threads, Ordering::Relaxed);
    Ok(())
}

/// The number of threads the pool runs.
pub fn num_threads() -> usize {
    match REQUESTED_THREADS.load(Ordering::Relaxed) {
        0 => default_threads(),
        n => n,
    }
}

/// Read once: `available_parallelism` reads cgroup files on Linux, which cost ~90 µs per call
/// when this ran on every attention call (measured: batch 1 × 128 keys took 140 µs instead of
/// 50 µs until the count was cached).
fn default_threads() -> usize {
    static DEFAULT: OnceLock<usize> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        std::env::var(NUM_THREADS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|n| (1..=MAX_THREADS).contains(n))
            .unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_THREADS))
            })
    })
}

/// The pool slot. Nothing panics while holding it, so a poisoned lock is a bug: it panics again
/// (a binding reports that as `InternalError`) rather than use the slot.
fn lock_pool() -> MutexGuard<'static, Option<Pool>> {
    POOL.lock()
        .expect("an earlier panic poisoned the worker pool's lock")
}

/// A pool of `threads` threads for this process.
fn build(threads: usize) -> Result<Pool> {
    let pool = ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("pagedkv-worker-{i}"))
        .build()
        .map_err(|e| Error::OutOfMemory(format!("{threads} worker threads ({e})")))?;
    Ok(Pool {
        pid: std::process::id(),
        pool: Arc::new(pool),
    })
}

/// Drops a pool built by this process; leaks one inherited through `fork()`.
fn retire(pool: Option<Pool>) {
    if let Some(pool) = pool {
        if pool.pid != std::process::id() {
            std::mem::forget(pool);
        }
    }
}

/// The pool of this process, built on first use (and again in a forked child).
pub(crate) fn pool() -> Result<Arc<ThreadPool>> {
    let pid = std::process::id();
    let mut slot = lock_pool();
    if let Some(p) = slot.as_ref().filter(|p| p.pid == pid) {
        return Ok(Arc::clone(&p.pool));
    }
    let fresh = build(num_threads())?;
    let pool = Arc::clone(&fresh.pool);
    retire(slot.replace(fresh));
    Ok(pool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_follows_the_requested_size() {
        set_num_threads(3).unwrap();
        assert_eq!(num_threads(), 3);
        assert_eq!(pool().unwrap().current_num_threads(), 3);
        set_num_threads(2).unwrap();
        assert_eq!(pool().unwrap().current_num_threads(), 2);
        for refused in [0, MAX_THREADS + 1, 100_000, usize::MAX] {
            assert!(matches!(
                set_num_threads(refused),
                Err(Error::InvalidArgument(_))
            ));
        }
    }
}
