//! AVX-512F. Register blocking: the score kernel keeps up to 4 query rows × 4 key rows of
//! accumulators (16 of 32 zmm registers), the value kernel 4 query rows × 64 lanes of output; both
//! load each K/V vector once per 4 query rows and each query/weight once per 4 rows.
//!
//! Rows whose `head_dim` is not a multiple of 16 go to the AVX2 kernels (this CPU has AVX2:
//! `Isa::Avx512` implies it), so no loop here has a tail; so do f16 K/V, whose 512-bit
//! conversion was the slower (Zen 4, `bench attention --quick --dtypes float16`, AVX2 and AVX-512
//! alternated twice: decode of 1 × 2,048 0.34-0.42 vs 0.46-0.58 ms, 4 × 8,192 4.0-6.2 vs
//! 5.8-6.7 ms; f32 and bf16 gained, 1 × 2,048 bf16 0.42-0.59 vs 0.33-0.35 ms). Horizontal sums fold each 512-bit
//! accumulator to 256 bits and reuse AVX2's transposing add tree, 4 × 2 sums at a time.

use std::arch::x86_64::*;

use super::ahead::Ahead;
use super::avx2::{store_sums_4x2, Avx2};
use super::Kernels;
use crate::compute::cpu::vmath;
use crate::store::dtype::{load16, KvDtype, KvElement};

pub(crate) struct Avx512;

/// The sum of the two 256-bit halves of `v`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn fold(v: __m512) -> __m256 {
    _mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
    )
}

/// Dot products of `QH` query rows with `KR` key rows, written to `out[i * stride + r]`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn dot_block<T: KvElement, const QH: usize, const KR: usize>(
    q: *const f32,
    k: *const T,
    d: usize,
    out: *mut f32,
    stride: usize,
    ahead: &mut Ahead,
) {
    let mut acc = [[_mm512_setzero_ps(); KR]; QH];
    let mut c = 0;
    while c < d {
        ahead.lines(KR * 16 * std::mem::size_of::<T>());
        let mut keys = [_mm512_setzero_ps(); KR];
        for (r, key) in keys.iter_mut().enumerate() {
            *key = load16(k.add(r * d + c));
        }
        for (i, acc_row) in acc.iter_mut().enumerate() {
            let query = _mm512_loadu_ps(q.add(i * d + c));
            for (a, key) in acc_row.iter_mut().zip(keys) {
                *a = _mm512_fmadd_ps(query, key, *a);
            }
        }
        c += 16;
    }
    if QH == 4 && KR.is_multiple_of(2) {
        for pair in (0..KR).step_by(2) {
            let halves: [__m256; 8] = std::array::from_fn(|j| fold(acc[j / 2][pair + j % 2]));
            store_sums_4x2(&halves, out.add(pair), stride);
        }
    } else {
        for (i, acc_row) in acc.iter().enumerate() {
            for (r, a) in acc_row.iter().enumerate() {
                *out.add(i * stride + r) = _mm512_reduce_add_ps(*a);
            }
        }
    }
}

/// Scores of `QH` query rows against every key row: `KR` rows at a time, then one by one.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
        dot_block::<T, QH, KR>(q, k.add(r * d), d, out.add(r), stride, ahead);
        r += KR;
    }
    ahead.until(rows, rows);
    while r < rows {
        dot_block::<T, QH, 1>(q, k.add(r * d), d, out.add(r), stride, ahead);
        r += 1;
    }
}

/// `acc[i][c..c + 16 * DV] += Σ_r p[i][r] · v[r][c..c + 16 * DV]` for `QH` query rows.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn weighted_block<T: KvElement, const QH: usize, const DV: usize>(
    p: *const f32,
    stride: usize,
    v: *const T,
    rows: usize,
    d: usize,
    acc: *mut f32,
    ahead: &mut Ahead,
) {
    let mut sums = [[_mm512_setzero_ps(); DV]; QH];
    for (i, row) in sums.iter_mut().enumerate() {
        for (j, s) in row.iter_mut().enumerate() {
            *s = _mm512_loadu_ps(acc.add(i * d + 16 * j));
        }
    }
    for r in 0..rows {
        ahead.lines(DV * 16 * std::mem::size_of::<T>());
        let mut values = [_mm512_setzero_ps(); DV];
        for (j, value) in values.iter_mut().enumerate() {
            *value = load16(v.add(r * d + 16 * j));
        }
        for (i, row) in sums.iter_mut().enumerate() {
            let weight = _mm512_set1_ps(*p.add(i * stride + r));
            for (s, value) in row.iter_mut().zip(values) {
                *s = _mm512_fmadd_ps(weight, value, *s);
            }
        }
    }
    for (i, row) in sums.iter().enumerate() {
        for (j, s) in row.iter().enumerate() {
            _mm512_storeu_ps(acc.add(i * d + 16 * j), *s);
        }
    }
}

/// The value rows for `QH` query rows, 64 columns at a time, then 16.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    while c + 64 <= d {
        weighted_block::<T, QH, 4>(p, stride, v.add(c), rows, d, acc.add(c), ahead);
        c += 64;
    }
    while c < d {
        weighted_block::<T, QH, 1>(p, stride, v.add(c), rows, d, acc.add(c), ahead);
        c += 16;
    }
    ahead.until(1, 1);
}

impl Kernels for Avx512 {
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
        if !d.is_multiple_of(16) || T::DTYPE == KvDtype::F16 {
            return Avx2::scores(q, m, k, rows, d, scores, stride, prefetch);
        }
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
                1 => dot_rows::<T, 1, 8>(q, k, rows, d, out, stride, &mut ahead),
                2 => dot_rows::<T, 2, 6>(q, k, rows, d, out, stride, &mut ahead),
                3 => dot_rows::<T, 3, 4>(q, k, rows, d, out, stride, &mut ahead),
                _ => dot_rows::<T, 4, 4>(q, k, rows, d, out, stride, &mut ahead),
            }
            i += 4;
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn max(row: &[f32]) -> f32 {
        let mut chunks = row.chunks_exact(16);
        let mut best = _mm512_set1_ps(f32::NEG_INFINITY);
        for chunk in &mut chunks {
            best = _mm512_max_ps(best, _mm512_loadu_ps(chunk.as_ptr()));
        }
        let lanes = _mm512_reduce_max_ps(best);
        chunks.remainder().iter().copied().fold(lanes, f32::max)
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn exp_sub_sum(row: &mut [f32], max: f32) -> f32 {
        // At most a step's 64 scores per row: AVX2's `exp` is not where the time goes.
        vmath::avx2::exp_sub_sum(row, max)
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
        if !d.is_multiple_of(16) || T::DTYPE == KvDtype::F16 {
            return Avx2::accumulate(p, stride, m, v, rows, d, acc, prefetch);
        }
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

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn scale(row: &mut [f32], factor: f32) {
        let f = _mm512_set1_ps(factor);
        let mut chunks = row.chunks_exact_mut(16);
        for chunk in &mut chunks {
            _mm512_storeu_ps(
                chunk.as_mut_ptr(),
                _mm512_mul_ps(_mm512_loadu_ps(chunk.as_ptr()), f),
            );
        }
        chunks
            .into_remainder()
            .iter_mut()
            .for_each(|x| *x *= factor);
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn prefetch<T>(tile: &[T]) {
        Avx2::prefetch(tile)
    }
}
