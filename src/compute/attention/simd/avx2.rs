//! AVX2 + FMA + F16C. Register blocking: the score kernel keeps up to 4 query rows × 2 key rows
//! of accumulators (8 of 16 ymm registers), the value kernel 4 query rows × 16 lanes of output;
//! both load each K/V vector once per 4 query rows and each query/weight once per 2 rows.

use std::arch::x86_64::*;

use super::ahead::Ahead;
use super::Kernels;
use crate::compute::cpu::vmath;
use crate::compute::cpu::vmath::avx2::hsum;
use crate::store::dtype::{load8, KvElement};

pub(crate) struct Avx2;

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
pub(super) unsafe fn store_sums_4x2(a: &[__m256], out: *mut f32, stride: usize) {
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
