//! The dedicated rayon pool attention runs on.
//!
//! Invariants:
//! - One pool per process. Its size is the last [`set_num_threads`] value, else
//!   `PAGEDKV_NUM_THREADS`, else the number of CPUs available (both read once, at first use).
//! - The pool remembers the pid that built it. A child made by `fork()` inherits the pool's memory
//!   but none of its threads, so a call in the child sees another pid and builds a fresh pool; the
//!   parent's pool object is leaked there on purpose (dropping it would signal threads that do
//!   not exist in the child).
//! - Callers take an `Arc` of the pool, so resizing never pulls a pool from under a running call.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use rayon::{ThreadPool, ThreadPoolBuilder};

use crate::error::{ensure, Result};

/// Environment variable read for the default thread count.
pub const NUM_THREADS_ENV: &str = "PAGEDKV_NUM_THREADS";

/// Thread count set by [`set_num_threads`]; 0 when unset.
static REQUESTED_THREADS: AtomicUsize = AtomicUsize::new(0);

struct Pool {
    pid: u32,
    pool: Arc<ThreadPool>,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// Sets the number of attention threads (from the next call on).
pub fn set_num_threads(threads: usize) -> Result<()> {
    ensure(threads > 0, || {
        "the number of threads must be positive".into()
    })?;
    REQUESTED_THREADS.store(threads, Ordering::Relaxed);
    let mut slot = POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if slot
        .as_ref()
        .is_some_and(|p| p.pool.current_num_threads() != threads)
    {
        retire(slot.take());
    }
    Ok(())
}

/// The number of threads attention runs on.
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
            .filter(|&n| n > 0)
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
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
pub(crate) fn pool() -> Arc<ThreadPool> {
    let pid = std::process::id();
    let mut slot = POOL.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(p) = slot.as_ref().filter(|p| p.pid == pid) {
        return Arc::clone(&p.pool);
    }
    retire(slot.take());
    let pool = ThreadPoolBuilder::new()
        .num_threads(num_threads())
        .thread_name(|i| format!("pagedkv-attention-{i}"))
        .build()
        .expect("building the attention thread pool");
    let pool = Arc::new(pool);
    *slot = Some(Pool {
        pid,
        pool: Arc::clone(&pool),
    });
    pool
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_follows_the_requested_size() {
        set_num_threads(3).unwrap();
        assert_eq!(num_threads(), 3);
        assert_eq!(pool().current_num_threads(), 3);
        set_num_threads(2).unwrap();
        assert_eq!(pool().current_num_threads(), 2);
        assert!(set_num_threads(0).is_err());
    }
}
