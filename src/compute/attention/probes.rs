//! What this machine gives the attention pool, measured in the same run as the kernel: read-only
//! memory bandwidth (the ceiling of decode) and f32 FMA throughput (the ceiling of prefill).
//!
//! Invariants: the bandwidth probe buffer is written once before timing (so every page is backed by real
//! memory, not the shared zero page), then swept read-only by the attention pool with the same
//! vector loads and independent accumulators the kernels use; each sweep is timed separately.

use std::time::Instant;

use rayon::prelude::*;

use super::simd::{Kernels, Portable};
use super::{default_kernel_path, threads, KernelPath};
use crate::error::{ensure, Result};
use crate::store::buffer;

/// Bytes each task sweeps: large enough to amortise scheduling, small enough to balance.
const CHUNK_BYTES: usize = 1 << 20;

/// The smallest probe: one page; below, a sweep times the call, not memory.
pub const MIN_PROBE_BYTES: usize = 4096;

/// A buffer of real memory to sweep: build once, then time sweeps between other measurements.
pub struct ReadProbe {
    data: Vec<f32>,
}

impl ReadProbe {
    /// Allocates and writes `nbytes` (at least [`MIN_PROBE_BYTES`], rounded down to whole f32);
    /// fails when the memory cannot be had.
    pub fn new(nbytes: usize) -> Result<Self> {
        ensure(nbytes >= MIN_PROBE_BYTES, || {
            format!("nbytes must be at least {MIN_PROBE_BYTES}, got {nbytes}")
        })?;
        Ok(ReadProbe {
            data: buffer::random_vec(nbytes / 4, 1, "the read bandwidth probe")?,
        })
    }

    /// Bytes one sweep reads.
    pub fn nbytes(&self) -> usize {
        self.data.len() * 4
    }

    /// Reads the whole buffer once on the attention pool; returns GB/s (10^9 bytes per second).
    pub fn sweep(&self) -> Result<f64> {
        let path = default_kernel_path();
        let sum = |chunk: &[f32]| -> f32 {
            match path {
                // SAFETY: the default path is available on this CPU.
                #[cfg(target_arch = "x86_64")]
                KernelPath::Avx2 => unsafe { super::simd::Avx2::sum(chunk) },
                _ => unsafe { Portable::sum(chunk) },
            }
        };
        let pool = threads::pool()?;
        let start = Instant::now();
        let total: f32 = pool.install(|| self.data.par_chunks(CHUNK_BYTES / 4).map(sum).sum());
        let seconds = start.elapsed().as_secs_f64();
        std::hint::black_box(total);
        Ok(self.nbytes() as f64 / seconds / 1e9)
    }
}

/// Read bandwidth in GB/s of each of `sweeps` sweeps over a fresh buffer of `nbytes`.
pub fn measure_read_bandwidth(nbytes: usize, sweeps: usize) -> Result<Vec<f64>> {
    ensure(sweeps > 0, || "sweeps must be positive".into())?;
    let probe = ReadProbe::new(nbytes)?;
    (0..sweeps).map(|_| probe.sweep()).collect()
}

/// f32 FLOP/s (an FMA counts 2) of every attention thread running a register-only FMA loop with
/// enough independent accumulators to hide the FMA latency, in GFLOP/s.
pub fn measure_fma_peak() -> Result<f64> {
    const ITERATIONS: usize = 2_000_000;
    let path = default_kernel_path();
    let pool = threads::pool()?;
    let threads = pool.current_num_threads();
    let start = Instant::now();
    let flops: f64 = pool.install(|| {
        (0..threads)
            .into_par_iter()
            .with_max_len(1)
            .map(|_| match path {
                // SAFETY: the default path is available on this CPU.
                #[cfg(target_arch = "x86_64")]
                KernelPath::Avx2 => unsafe { super::simd::Avx2::fma_loop(ITERATIONS) },
                _ => unsafe { Portable::fma_loop(ITERATIONS) },
            })
            .sum()
    });
    Ok(flops / start.elapsed().as_secs_f64() / 1e9)
}
