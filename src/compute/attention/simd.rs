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
pub(crate) use avx2::Avx2;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 + FMA + F16C. Register blocking: the score kernel keeps up to 4 query rows × 2 key rows
    //! of accumulators (8 of 16 ymm registers), the value kernel 4 query rows × 16 lanes of output;
    //! both load each K/V vector once per 4 query rows and each query/weight once per 2 rows.

    use std::arch::x86_64::*;

    use super::Kernels;
    use crate::compute::cpu::vmath;
    use crate::compute::cpu::vmath::avx2::hsum;
    use crate::store::dtype::{load8, KvElement};

    pub(crate) struct Avx2;

    /// The tile a step ahead, pulled into L2 while the kernels compute on the current one.
    ///
    /// Pacing matters more than distance here (measured on Zen 3, decode from memory): a burst of
    /// 128+ prefetches per tile fills the miss buffers and stalls the core with the arithmetic
    /// it could have overlapped (0.33–0.36 of the read bandwidth); one line requested per 8 FMAs,
    /// about one line per line of f32 K/V consumed, reached 0.57–0.74.
    struct Ahead {
        start: *const i8,
        next: *const i8,
        end: *const i8,
    }

    impl Ahead {
        fn new<T>(tile: &[T]) -> Self {
            let range = tile.as_ptr_range();
            Ahead {
                start: range.start.cast(),
                next: range.start.cast(),
                end: range.end.cast(),
            }
        }

        /// Requests the next 64-byte line of the tile, if any is left.
        #[inline(always)]
        fn line(&mut self) {
            if self.next < self.end {
                // SAFETY: `next` lies inside the tile; a prefetch never faults or writes.
                unsafe {
                    _mm_prefetch::<_MM_HINT_T1>(self.next);
                    self.next = self.next.add(64);
                }
            }
        }

        /// One line per inner-loop iteration that reads `bytes` of the current tile: one per
        /// 64 bytes of f32, one per other iteration for 16-bit K/V.
        #[inline(always)]
        fn pace(&mut self, bytes: usize, iteration: usize) {
            if bytes >= 64 || iteration.is_multiple_of(2) {
                self.line();
            }
        }

        /// Catches up to fraction `done / total` of the tile (where iterations read more than a
        /// line each), or requests the rest when `done == total`.
        #[inline(always)]
        fn until(&mut self, done: usize, total: usize) {
            let len = self.end as usize - self.start as usize;
            let target = self.start.wrapping_add(len * done / total);
            while self.next < target {
                self.line();
            }
        }
    }

    /// Dot products of `QH` query rows with `KR` key rows, written to `out[i * stride + r]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_block<T: KvElement, const QH: usize, const KR: usize>(
        q: *const f32,
        k: *const T,
        d: usize,
        out: *mut f32,
        stride: usize,
        ahead: &mut Ahead,
    ) {
        let mut acc = [[_mm256_setzero_ps(); KR]; QH];
        let mut c = 0;
        while c < d {
            ahead.pace(KR * 8 * std::mem::size_of::<T>(), c / 8);
            let mut keys = [_mm256_setzero_ps(); KR];
            for (r, key) in keys.iter_mut().enumerate() {
                *key = load8(k.add(r * d + c));
            }
            for (i, acc_row) in acc.iter_mut().enumerate() {
                let query = _mm256_loadu_ps(q.add(i * d + c));
                for (a, key) in acc_row.iter_mut().zip(keys) {
                    *a = _mm256_fmadd_ps(query, key, *a);
                }
            }
            c += 8;
        }
        if QH == 4 && KR == 2 {
            store_sums_4x2(&acc.as_flattened()[..8], out, stride);
        } else {
            for (i, acc_row) in acc.iter().enumerate() {
                for (r, a) in acc_row.iter().enumerate() {
                    *out.add(i * stride + r) = hsum(*a);
                }
            }
        }
    }

    /// Stores the horizontal sums of 8 accumulators `a[2i + r]` (query row i, key r) to
    /// `out[i * stride + r]`: one transposing add tree (9 instructions) instead of 8 separate
    /// horizontal sums, the main overhead of decode's 4-head score block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store_sums_4x2(a: &[__m256], out: *mut f32, stride: usize) {
        let pairs = [
            _mm256_hadd_ps(a[0], a[1]),
            _mm256_hadd_ps(a[2], a[3]),
            _mm256_hadd_ps(a[4], a[5]),
            _mm256_hadd_ps(a[6], a[7]),
        ];
        let quads = [
            _mm256_hadd_ps(pairs[0], pairs[1]),
            _mm256_hadd_ps(pairs[2], pairs[3]),
        ];
        // Lane j of `sums` is the full sum of a[j]: low 128-bit halves hold a[0..4] partial sums of
        // lanes 0..4, high halves those of lanes 4..8.
        let sums = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(quads[0], quads[1]),
            _mm256_permute2f128_ps::<0x31>(quads[0], quads[1]),
        );
        let (low, high) = (
            _mm_castps_pd(_mm256_castps256_ps128(sums)),
            _mm_castps_pd(_mm256_extractf128_ps::<1>(sums)),
        );
        _mm_storel_pd(out.cast(), low);
        _mm_storeh_pd(out.add(stride).cast(), low);
        _mm_storel_pd(out.add(2 * stride).cast(), high);
        _mm_storeh_pd(out.add(3 * stride).cast(), high);
    }

    /// Scores of `QH` query rows against every key row: `KR` rows at a time, then one by one.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_rows<T: KvElement, const QH: usize, const KR: usize>(
        q: *const f32,
        k: *const T,
        rows: usize,
        d: usize,
        out: *mut f32,
        stride: usize,
        ahead: &mut Ahead,
    ) {
        let mut r = 0;
        while r + KR <= rows {
            ahead.until(r + KR, rows);
            dot_block::<T, QH, KR>(q, k.add(r * d), d, out.add(r), stride, ahead);
            r += KR;
        }
        ahead.until(rows, rows);
        while r < rows {
            dot_block::<T, QH, 1>(q, k.add(r * d), d, out.add(r), stride, ahead);
            r += 1;
        }
    }

    /// `acc[i][c..c + 8 * DV] += Σ_r p[i][r] · v[r][c..c + 8 * DV]` for `QH` query rows.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weighted_block<T: KvElement, const QH: usize, const DV: usize>(
        p: *const f32,
        stride: usize,
        v: *const T,
        rows: usize,
        d: usize,
        acc: *mut f32,
        ahead: &mut Ahead,
    ) {
        let mut sums = [[_mm256_setzero_ps(); DV]; QH];
        for (i, row) in sums.iter_mut().enumerate() {
            for (j, s) in row.iter_mut().enumerate() {
                *s = _mm256_loadu_ps(acc.add(i * d + 8 * j));
            }
        }
        for r in 0..rows {
            ahead.pace(DV * 8 * std::mem::size_of::<T>(), r);
            let mut values = [_mm256_setzero_ps(); DV];
            for (j, value) in values.iter_mut().enumerate() {
                *value = load8(v.add(r * d + 8 * j));
            }
            for (i, row) in sums.iter_mut().enumerate() {
                let weight = _mm256_broadcast_ss(&*p.add(i * stride + r));
                for (s, value) in row.iter_mut().zip(values) {
                    *s = _mm256_fmadd_ps(weight, value, *s);
                }
            }
        }
        for (i, row) in sums.iter().enumerate() {
            for (j, s) in row.iter().enumerate() {
                _mm256_storeu_ps(acc.add(i * d + 8 * j), *s);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weighted_rows<T: KvElement, const QH: usize>(
        p: *const f32,
        stride: usize,
        v: *const T,
        rows: usize,
        d: usize,
        acc: *mut f32,
        ahead: &mut Ahead,
    ) {
        let mut c = 0;
        while c + 16 <= d {
            ahead.until(c + 16, d);
            weighted_block::<T, QH, 2>(p, stride, v.add(c), rows, d, acc.add(c), ahead);
            c += 16;
        }
        ahead.until(d, d);
        if c < d {
            weighted_block::<T, QH, 1>(p, stride, v.add(c), rows, d, acc.add(c), ahead);
        }
    }

    impl Kernels for Avx2 {
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn scores<T: KvElement>(
            q: &[f32],
            m: usize,
            k: &[T],
            rows: usize,
            d: usize,
            scores: &mut [f32],
            stride: usize,
            prefetch: &[T],
        ) {
            assert!(
                q.len() >= m * d
                    && k.len() >= rows * d
                    && (m == 0 || scores.len() >= (m - 1) * stride + rows)
            );
            let (q, k, out) = (q.as_ptr(), k.as_ptr(), scores.as_mut_ptr());
            let mut ahead = Ahead::new(prefetch);
            let mut i = 0;
            while i < m {
                let (q, out) = (q.add(i * d), out.add(i * stride));
                match m - i {
                    1 => dot_rows::<T, 1, 4>(q, k, rows, d, out, stride, &mut ahead),
                    2 => dot_rows::<T, 2, 4>(q, k, rows, d, out, stride, &mut ahead),
                    3 => dot_rows::<T, 3, 2>(q, k, rows, d, out, stride, &mut ahead),
                    _ => dot_rows::<T, 4, 2>(q, k, rows, d, out, stride, &mut ahead),
                }
                i += 4;
            }
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn max(row: &[f32]) -> f32 {
            let mut chunks = row.chunks_exact(8);
            let mut best = _mm256_set1_ps(f32::NEG_INFINITY);
            for chunk in &mut chunks {
                best = _mm256_max_ps(best, _mm256_loadu_ps(chunk.as_ptr()));
            }
            let s = _mm_max_ps(
                _mm256_castps256_ps128(best),
                _mm256_extractf128_ps::<1>(best),
            );
            let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
            let lanes = _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps::<1>(s, s)));
            chunks.remainder().iter().copied().fold(lanes, f32::max)
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn exp_sub_sum(row: &mut [f32], max: f32) -> f32 {
            vmath::avx2::exp_sub_sum(row, max)
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn accumulate<T: KvElement>(
            p: &[f32],
            stride: usize,
            m: usize,
            v: &[T],
            rows: usize,
            d: usize,
            acc: &mut [f32],
            prefetch: &[T],
        ) {
            assert!(
                acc.len() >= m * d
                    && v.len() >= rows * d
                    && (m == 0 || p.len() >= (m - 1) * stride + rows)
            );
            let (v, acc_ptr) = (v.as_ptr(), acc.as_mut_ptr());
            let mut ahead = Ahead::new(prefetch);
            let mut i = 0;
            while i < m {
                let (p, acc) = (p.as_ptr().add(i * stride), acc_ptr.add(i * d));
                match m - i {
                    1 => weighted_rows::<T, 1>(p, stride, v, rows, d, acc, &mut ahead),
                    2 => weighted_rows::<T, 2>(p, stride, v, rows, d, acc, &mut ahead),
                    3 => weighted_rows::<T, 3>(p, stride, v, rows, d, acc, &mut ahead),
                    _ => weighted_rows::<T, 4>(p, stride, v, rows, d, acc, &mut ahead),
                }
                i += 4;
            }
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn scale(row: &mut [f32], factor: f32) {
            let f = _mm256_set1_ps(factor);
            let mut chunks = row.chunks_exact_mut(8);
            for chunk in &mut chunks {
                _mm256_storeu_ps(
                    chunk.as_mut_ptr(),
                    _mm256_mul_ps(_mm256_loadu_ps(chunk.as_ptr()), f),
                );
            }
            chunks
                .into_remainder()
                .iter_mut()
                .for_each(|x| *x *= factor);
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn prefetch<T>(tile: &[T]) {
            let bytes = std::mem::size_of_val(tile);
            let base = tile.as_ptr().cast::<i8>();
            let mut offset = 0;
            while offset < bytes {
                // Into L2, one request per 64-byte line: the caller prefetches a whole step
                // (K and V of 64+ keys) ahead, more than L1 holds, and the adjacent-line
                // prefetcher does not reliably fetch the pair of a software prefetch (measured:
                // 128-byte spacing was ~20% slower from memory).
                _mm_prefetch::<_MM_HINT_T1>(base.add(offset));
                offset += 64;
            }
        }
    }
}
