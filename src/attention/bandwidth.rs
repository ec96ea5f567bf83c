//! The read-only memory bandwidth this machine gives the attention pool: the ceiling decode is
//! judged against.
//!
//! Invariants: the probe buffer is written once before timing (so every page is backed by real
//! memory, not the shared zero page), then swept read-only by the attention pool with the same
//! vector loads and independent accumulators the kernels use; each sweep is timed separately.

use std::time::Instant;

use rayon::prelude::*;

use super::simd::{Kernels, Portable};
use super::{default_kernel_path, threads, KernelPath};

/// Bytes each task sweeps: large enough to amortise scheduling, small enough to balance.
const CHUNK_BYTES: usize = 1 << 20;

/// Sweeps a freshly written buffer of `nbytes` `sweeps` times on the attention pool and returns
/// the read bandwidth of each sweep in GB/s (10^9 bytes per second).
pub fn measure_read_bandwidth(nbytes: usize, sweeps: usize) -> Vec<f64> {
    let data: Vec<f32> = super::random_values(nbytes / 4, 1);
    let sum = |chunk: &[f32]| -> f32 {
        match default_kernel_path() {
            // SAFETY: the default path is available on this CPU.
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => unsafe { super::simd::Avx2::sum(chunk) },
            _ => unsafe { Portable::sum(chunk) },
        }
    };
    let pool = threads::pool();
    (0..sweeps)
        .map(|_| {
            let start = Instant::now();
            let total: f32 = pool.install(|| data.par_chunks(CHUNK_BYTES / 4).map(sum).sum());
            let seconds = start.elapsed().as_secs_f64();
            std::hint::black_box(total);
            (data.len() * 4) as f64 / seconds / 1e9
        })
        .collect()
}
