//! Vector math the kernels share, written once: `exp` of non-positive arguments (softmax over
//! scores minus their maximum, in attention and in sampling) and lane sums.
//!
//! Invariants:
//! - One `exp`: `2^n · e^f` with `x = n ln 2 + f`, `|f| ≤ ln 2 / 2` (ln 2 split in a part exact in
//!   f32 and a remainder, so `n ln 2` subtracts without rounding), and the degree-7 Taylor
//!   polynomial of `e^f`; inputs below -87 (and -inf, the causal mask) give exactly 0. The scalar
//!   form (`exp_nonpositive`) and the AVX2 one (`avx2::exp_nonpositive`) evaluate the same
//!   polynomial; the AVX2 one fuses its multiply-adds, so they may differ in the last bit. Both
//!   are within 2e-7 relative of the exact value (`tests`).
//! - Sums run in independent lanes (a strict left-to-right float sum does not vectorise), so
//!   they may differ from a sequential sum by rounding.
//! - The `avx2` functions may be called only when `Isa::Avx2.available()` (`cpu::isa`).

/// Below this, `exp` is 0 (f32's smallest normal is about e^-87.3).
const EXP_MIN: f32 = -87.0;
/// ln 2 = LN2_HI + LN2_LO, LN2_HI with trailing zero bits so `n · LN2_HI` is exact for |n| < 2^9.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1/7!, 1/6!, ..., 1/1!, 1/0!: the Taylor coefficients of `e^f`, highest first.
const TAYLOR: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `exp(x)` for `x ≤ 0` (see the module invariants). Branch-free, so loops calling it vectorise.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 × 2^23: adding it rounds to the nearest integer
    let clamped = x.max(EXP_MIN);
    let shifted = clamped * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let f = (clamped - n * LN2_HI) - n * LN2_LO;
    let poly = TAYLOR[1..].iter().fold(TAYLOR[0], |p, &c| p * f + c);
    // `n` as an integer read from `shifted`'s mantissa, not `n as i32`: Rust's saturating
    // float-to-int cast does not vectorise (its NaN and range checks went scalar, most of the
    // sampler's softmax time).
    let n_int = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if x >= EXP_MIN {
        poly * scale
    } else {
        0.0
    }
}

/// `row[i] = exp(row[i] - max)` (every `row[i] ≤ max`); returns their sum.
pub fn exp_sub_sum(row: &mut [f32], max: f32) -> f32 {
    for x in row.iter_mut() {
        *x = exp_nonpositive(*x - max);
    }
    sum(row)
}

/// The sum of `values`, in 32 lanes.
#[inline(always)]
pub fn sum(values: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 32];
    let chunks = values.chunks_exact(32);
    let tail: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += x;
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
pub mod avx2 {
    //! The AVX2 + FMA forms (callable only where `Isa::Avx2` is available).

    use std::arch::x86_64::*;

    use super::{EXP_MIN, LN2_HI, LN2_LO, TAYLOR};

    /// The sum of the 8 lanes of `v`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// `exp` of 8 lanes, each ≤ 0 (the polynomial of [`super::exp_nonpositive`]).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub fn exp_nonpositive(x: __m256) -> __m256 {
        let underflow = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN));
        let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
        let f = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), f);
        let mut poly = _mm256_set1_ps(TAYLOR[0]);
        for &coefficient in &TAYLOR[1..] {
            poly = _mm256_fmadd_ps(poly, f, _mm256_set1_ps(coefficient));
        }
        let exponent = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        let result = _mm256_mul_ps(poly, _mm256_castsi256_ps(exponent));
        _mm256_andnot_ps(underflow, result)
    }

    /// [`super::exp_sub_sum`] on AVX2.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn exp_sub_sum(row: &mut [f32], max: f32) -> f32 {
        let max = _mm256_set1_ps(max);
        let mut sum = _mm256_setzero_ps();
        let mut chunks = row.chunks_exact_mut(8);
        for chunk in &mut chunks {
            let e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), max));
            _mm256_storeu_ps(chunk.as_mut_ptr(), e);
            sum = _mm256_add_ps(sum, e);
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            // Pad the tail with -inf (exp → 0) so it takes the same vector path.
            let mut lanes = [f32::NEG_INFINITY; 8];
            lanes[..tail.len()].copy_from_slice(tail);
            let e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(lanes.as_ptr()), max));
            _mm256_storeu_ps(lanes.as_mut_ptr(), e);
            tail.copy_from_slice(&lanes[..tail.len()]);
            sum = _mm256_add_ps(sum, e);
        }
        hsum(sum)
    }

    /// [`super::sum`] on AVX2 (4 accumulators of 8 lanes).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn sum(data: &[f32]) -> f32 {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut chunks = data.chunks_exact(32);
        for chunk in &mut chunks {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(*a, _mm256_loadu_ps(chunk.as_ptr().add(8 * j)));
            }
        }
        let total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        hsum(total) + chunks.remainder().iter().sum::<f32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::cpu::Isa;

    /// Non-positive arguments across the whole range, some near each power of two's boundary.
    fn arguments() -> Vec<f32> {
        let mut xs: Vec<f32> = (0..20_000).map(|i| -(i as f32) * 0.004_4).collect();
        xs.extend((0..88).flat_map(|k| {
            [
                -(k as f32) * std::f32::consts::LN_2 + 1e-4,
                -(k as f32) * 0.5,
            ]
        }));
        xs.retain(|&x| x >= EXP_MIN);
        xs
    }

    fn relative_error(got: f32, x: f32) -> f64 {
        let exact = (x as f64).exp();
        (got as f64 - exact).abs() / exact
    }

    #[test]
    fn the_scalar_exp_is_within_2e_7_of_the_exact_value() {
        let worst = arguments()
            .into_iter()
            .map(|x| relative_error(exp_nonpositive(x), x))
            .fold(0.0, f64::max);
        assert!(worst <= 2e-7, "worst relative error {worst:e}");
        for x in [EXP_MIN - 0.1, -1e30, f32::NEG_INFINITY] {
            assert_eq!(exp_nonpositive(x), 0.0);
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx2_exp_is_the_same_polynomial() {
        if !Isa::Avx2.available() {
            return; // nothing to compare on this CPU; the scalar form is tested above
        }
        let mut xs = arguments();
        xs.extend([EXP_MIN - 0.1, f32::NEG_INFINITY, -1e30]);
        xs.truncate(xs.len() / 8 * 8);
        let mut row = xs.clone();
        // SAFETY: AVX2 is available (checked above).
        let total = unsafe { avx2::exp_sub_sum(&mut row, 0.0) };
        for (&x, &got) in xs.iter().zip(&row) {
            let scalar = exp_nonpositive(x);
            assert!(
                (got - scalar).abs() <= 2.5e-7 * scalar,
                "{x}: avx2 {got} vs scalar {scalar}"
            );
        }
        let mut scalar_row = xs.clone();
        let scalar_total = exp_sub_sum(&mut scalar_row, 0.0);
        assert!((total - scalar_total).abs() <= 1e-5 * scalar_total);
        // SAFETY: as above.
        let avx2_sum = unsafe { avx2::sum(&xs[..1000]) };
        assert!((avx2_sum - sum(&xs[..1000])).abs() <= 1e-3 * sum(&xs[..1000]).abs());
    }
}
