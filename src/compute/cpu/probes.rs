//! What this machine gives the worker pool, measured in the same run as the kernels: read-only
//! memory bandwidth (the ceiling of decode) and f32 FMA throughput (the ceiling of prefill), each
//! on the instruction set the kernels use by default (`isa::ceiling`, as far as a probe is written
//! for it: AVX2 or portable).
//!
//! Invariants: the bandwidth probe buffer is written once before timing (so every page is backed by real
//! memory, not the shared zero page), then swept read-only by the attention pool with the same
//! vector loads and independent accumulators the kernels use; each sweep is timed separately.

use std::time::Instant;

use rayon::prelude::*;

use super::{pool, vmath, Isa};
use crate::error::{ensure, Result};
use crate::store::buffer;

/// The instruction sets the bandwidth sweep is written for.
const SWEEP_PROBES: [Isa; 2] = [Isa::Avx2, Isa::Portable];

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

    /// Reads the whole buffer once on the worker pool; returns GB/s (10^9 bytes per second).
    pub fn sweep(&self) -> Result<f64> {
        let isa = Isa::default_of(&SWEEP_PROBES);
        let sum = |chunk: &[f32]| -> f32 {
            match isa {
                // SAFETY: the default is available on this CPU.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { vmath::avx2::sum(chunk) },
                _ => vmath::sum(chunk),
            }
        };
        let pool = pool::pool()?;
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

/// f32 FLOP/s (an FMA counts 2) of every pool thread running a register-only FMA loop with
/// enough independent accumulators to hide the FMA latency, in GFLOP/s.
pub fn measure_fma_peak() -> Result<f64> {
    fma_peak_on(Isa::default_of(&FMA_PROBES))
}

/// The FMA loop's instruction sets: the widest vectors the CPU has count (AVX-512 doubles the
/// FLOPs per instruction; on Zen 4, which splits them in two, the peak stays AVX2's).
const FMA_PROBES: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Portable];

/// [`measure_fma_peak`] on `isa` (`InvalidArgument` if this CPU lacks it).
fn fma_peak_on(isa: Isa) -> Result<f64> {
    const ITERATIONS: usize = 2_000_000;
    isa.check_for("the FMA probe", &FMA_PROBES)?;
    let pool = pool::pool()?;
    let threads = pool.current_num_threads();
    let start = Instant::now();
    let flops: f64 = pool.install(|| {
        (0..threads)
            .into_par_iter()
            .with_max_len(1)
            .map(|_| match isa {
                // SAFETY: the default is available on this CPU.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { fma_loop_avx512(ITERATIONS) },
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { fma_loop_avx2(ITERATIONS) },
                _ => fma_loop(ITERATIONS),
            })
            .sum()
    });
    Ok(flops / start.elapsed().as_secs_f64() / 1e9)
}

/// Runs `iterations` rounds of independent FMAs on registers; returns the FLOPs done (an FMA
/// counts 2). 12 chains of 8 lanes: two FMA units × 4 cycles of latency need at least 8 in flight.
fn fma_loop(iterations: usize) -> f64 {
    let mut acc = [[1.0f32; 8]; 12];
    let (a, b) = (
        std::hint::black_box(0.999_999f32),
        std::hint::black_box(1e-7f32),
    );
    for _ in 0..iterations {
        for lanes in acc.iter_mut() {
            for x in lanes.iter_mut() {
                *x = *x * a + b;
            }
        }
    }
    std::hint::black_box(acc);
    (iterations * 12 * 8 * 2) as f64
}

/// [`fma_loop`] in `$vector` registers of `$lanes` lanes, compiled for `$features`: 12 chains.
macro_rules! fma_loop_simd {
    ($name:ident, $features:literal, $vector:ident, $lanes:literal, $set1:ident, $fmadd:ident) => {
        /// [`fma_loop`] with explicit vectors.
        ///
        /// # Safety
        /// The CPU has the features the function is compiled for.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        unsafe fn $name(iterations: usize) -> f64 {
            use std::arch::x86_64::*;
            let mut acc: [$vector; 12] = [$set1(1.0); 12];
            let (a, b) = (
                $set1(std::hint::black_box(0.999_999)),
                $set1(std::hint::black_box(1e-7)),
            );
            for _ in 0..iterations {
                for x in acc.iter_mut() {
                    *x = $fmadd(*x, a, b);
                }
            }
            std::hint::black_box(acc);
            (iterations * 12 * $lanes * 2) as f64
        }
    };
}

fma_loop_simd!(
    fma_loop_avx2,
    "avx2,fma,f16c",
    __m256,
    8,
    _mm256_set1_ps,
    _mm256_fmadd_ps
);
fma_loop_simd!(
    fma_loop_avx512,
    "avx512f",
    __m512,
    16,
    _mm512_set1_ps,
    _mm512_fmadd_ps
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probes_measure_something() {
        let sweeps = measure_read_bandwidth(1 << 22, 2).unwrap();
        assert_eq!(sweeps.len(), 2);
        // Positive and finite, whatever the machine's speed or load (a 0.1 GB/s floor failed once
        // while two builds shared the 2 cores).
        assert!(sweeps.iter().all(|&gbps| gbps > 0.0 && gbps.is_finite()));
        let peak = measure_fma_peak().unwrap();
        assert!(peak > 0.0 && peak.is_finite());
        for isa in Isa::available_of(&FMA_PROBES) {
            let peak = fma_peak_on(isa).unwrap();
            assert!(peak > 0.0 && peak.is_finite(), "{isa:?}");
        }
        assert!(FMA_PROBES
            .into_iter()
            .filter(|isa| !isa.available())
            .all(|isa| fma_peak_on(isa).is_err()));
        assert!(ReadProbe::new(MIN_PROBE_BYTES - 1).is_err());
    }
}
