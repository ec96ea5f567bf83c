//! The arithmetic of the attention loop at tile granularity, once per instruction set.
//!
//! Invariants:
//! - Every kernel works on whole tiles (a block of K or V rows for one KV head, and all query rows
//!   of a work item), so the cost of calling through a `#[target_feature]` boundary is paid once
//!   per tile, never per element.
//! - `head_dim` is a multiple of 8 (checked by the caller): vector loops have no element tails.
//! - K/V elements are converted to f32 on load; every sum is accumulated in f32.
//! - An implementation other than [`Portable`] may only be called when its [`Isa`] is available
//!   on this CPU (`cpu::isa`): that is the safety contract of the `unsafe` methods.
//! - The softmax's `exp` is the one of `cpu::vmath`.

use crate::compute::cpu::vmath;
#[cfg(doc)]
use crate::compute::cpu::Isa;
use crate::store::dtype::KvElement;

/// Tile-level kernels of the attention loop. Slices are row-major with the strides named.
///
/// # Safety
/// Implementations may require CPU features: call them only when their [`Isa`] is available on
/// this CPU.
pub(crate) trait Kernels {
    /// `scores[i * stride + r] = q[i] · k[r]` for query rows `i < m` and key rows `r < rows`;
    /// `q` is `m × head_dim`, `k` is at least `rows × head_dim`. `prefetch` (possibly empty) is a
    /// later tile to request into L2 a line at a time between the arithmetic.
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores<T: KvElement>(
        q: &[f32],
        m: usize,
        k: &[T],
        rows: usize,
        head_dim: usize,
        scores: &mut [f32],
        stride: usize,
        prefetch: &[T],
    );

    /// The largest element of a non-empty `row`.
    unsafe fn max(row: &[f32]) -> f32;

    /// Replaces each `x` of `row` by `exp(x - max)` (with `exp(-inf) = 0`) and returns their sum.
    unsafe fn exp_sub_sum(row: &mut [f32], max: f32) -> f32;

    /// `acc[i] += Σ_r p[i * stride + r] · v[r]` for `i < m`, `r < rows`; `acc` is `m × head_dim`.
    /// `prefetch` as in [`Kernels::scores`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate<T: KvElement>(
        p: &[f32],
        stride: usize,
        m: usize,
        v: &[T],
        rows: usize,
        head_dim: usize,
        acc: &mut [f32],
        prefetch: &[T],
    );

    /// Multiplies every element of `row` by `factor`.
    unsafe fn scale(row: &mut [f32], factor: f32);

    /// Asks the cache to start loading all of `tile` at once (an item's first tiles, before any
    /// arithmetic to pace the requests with).
    unsafe fn prefetch<T>(tile: &[T]);
}

/// The portable implementation: 8-wide accumulator arrays that the compiler vectorises.
pub(crate) struct Portable;

fn dot_portable<T: KvElement>(q: &[f32], k: &[T]) -> f32 {
    let mut lanes = [0.0f32; 8];
    for (qc, kc) in q.chunks_exact(8).zip(k.chunks_exact(8)) {
        for lane in 0..8 {
            lanes[lane] += qc[lane] * kc[lane].to_f32();
        }
    }
    lanes.iter().sum()
}

impl Kernels for Portable {
    unsafe fn scores<T: KvElement>(
        q: &[f32],
        m: usize,
        k: &[T],
        rows: usize,
        d: usize,
        scores: &mut [f32],
        stride: usize,
        _prefetch: &[T],
    ) {
        for (i, q_row) in q[..m * d].chunks_exact(d).enumerate() {
            for (r, k_row) in k[..rows * d].chunks_exact(d).enumerate() {
                scores[i * stride + r] = dot_portable(q_row, k_row);
            }
        }
    }

    unsafe fn max(row: &[f32]) -> f32 {
        row.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }

    unsafe fn exp_sub_sum(row: &mut [f32], max: f32) -> f32 {
        vmath::exp_sub_sum(row, max)
    }

    unsafe fn accumulate<T: KvElement>(
        p: &[f32],
        stride: usize,
        m: usize,
        v: &[T],
        rows: usize,
        d: usize,
        acc: &mut [f32],
        _prefetch: &[T],
    ) {
        for (i, acc_row) in acc[..m * d].chunks_exact_mut(d).enumerate() {
            for (r, v_row) in v[..rows * d].chunks_exact(d).enumerate() {
                let weight = p[i * stride + r];
                for (a, x) in acc_row.iter_mut().zip(v_row) {
                    *a += weight * x.to_f32();
                }
            }
        }
    }

    unsafe fn scale(row: &mut [f32], factor: f32) {
        row.iter_mut().for_each(|x| *x *= factor);
    }

    unsafe fn prefetch<T>(_tile: &[T]) {}
}

#[cfg(target_arch = "x86_64")]
mod ahead;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::Avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) use avx512::Avx512;
