//! The quantized dot-product kernels: activations quantized per 32 values, and one weight row
//! against up to [`MAX_ROWS`] activation rows at a time, once per instruction set.
//!
//! Invariants:
//! - For weight sub-block `w` (quants `q`, scales `scale[h]`, mins `min[h]`, zero `Z`) and
//!   activation block `a` (i8 `a`, scale `s`), the contribution is
//!   `Σ_h scale[h]·s·(Σ_{i∈h} q_i·a_i) + (min[h] − Z·scale[h])·(s·Σ_{i∈h} a_i)`: the integer sums
//!   are exact on every path; the f32 operations are the same, in another order on SIMD paths.
//! - A weight sub-block is decoded once per row tile and used for every activation row of it.
//! - AVX2 forms the 8 partial sums of 4 products with `vpmaddubsw` + `vpmaddwd`; AVX-512 VNNI with
//!   one `vpdpbusd` (256-bit, VL). Both take unsigned bytes on one side: unsigned quants as they
//!   are; Q8_0's signed quants as `|q|` with the activations' signs flipped where `q < 0`
//!   (`vpsignb`). No product pair overflows `vpmaddubsw`'s i16: `|q| ≤ 128`, `|a| ≤ 127`, and
//!   unsigned quants are < 64.
//! - A path other than [`Isa::Portable`] runs only when [`Isa::available`] says its CPU features
//!   are present: that is the safety contract of the `unsafe` functions here.

use super::format::{Format, SoftHalf};
use crate::compute::cpu::Isa;

/// Activation rows one weight sub-block is decoded for at most.
pub(super) const MAX_ROWS: usize = 8;

/// `x` quantized: per row, per 32 values, i8 quants, a scale and the scaled sums of each half.
pub(super) struct Activations {
    k: usize,
    quants: Vec<i8>,
    scales: Vec<f32>,
    half_sums: Vec<[f32; 2]>,
}

impl Activations {
    /// Row-major `x` `[m, k]`, `k` a multiple of 32.
    pub(super) fn quantize(x: &[f32], m: usize, k: usize) -> Self {
        let blocks = m * k / 32;
        let mut acts = Activations {
            k,
            quants: vec![0; m * k],
            scales: Vec::with_capacity(blocks),
            half_sums: Vec::with_capacity(blocks),
        };
        for (values, quants) in x.chunks_exact(32).zip(acts.quants.chunks_exact_mut(32)) {
            let max = values.iter().fold(0.0f32, |max, v| max.max(v.abs()));
            let scale = max / 127.0;
            let inverse = if max > 0.0 { 127.0 / max } else { 0.0 };
            let mut sums = [0i32; 2];
            for (i, (q, &v)) in quants.iter_mut().zip(values).enumerate() {
                // |v · inverse| ≤ 127 up to rounding; `as` saturates what rounding adds.
                *q = (v * inverse).round_ties_even() as i8;
                sums[i / 16] += i32::from(*q);
            }
            acts.scales.push(scale);
            acts.half_sums
                .push([scale * sums[0] as f32, scale * sums[1] as f32]);
        }
        acts
    }

    /// Row `row`'s 32 quants of sub-block `sub`.
    #[inline(always)]
    fn block(&self, row: usize, sub: usize) -> &[i8] {
        &self.quants[row * self.k + 32 * sub..][..32]
    }

    /// Index of row `row`'s sub-block `sub` in `scales` and `half_sums`.
    #[inline(always)]
    fn at(&self, row: usize, sub: usize) -> usize {
        row * self.k / 32 + sub
    }

    fn rows(&self) -> usize {
        self.quants.len() / self.k
    }
}

/// The f32 term of a sub-block that is not the integer dot: `Σ_h (min[h] − Z·scale[h])·s·Σ a`.
#[inline(always)]
fn offset<F: Format>(scales: &super::format::Scales, half_sums: [f32; 2]) -> f32 {
    if !F::HAS_MIN && F::ZERO == 0 {
        return 0.0;
    }
    let zero = F::ZERO as f32;
    if F::SPLIT {
        (scales.min[0] - zero * scales.scale[0]) * half_sums[0]
            + (scales.min[1] - zero * scales.scale[1]) * half_sums[1]
    } else {
        (scales.min[0] - zero * scales.scale[0]) * (half_sums[0] + half_sums[1])
    }
}

/// Writes `y[r][column + i] = x_r · W_i` for the weight rows `rows` (each `row_bytes` of `F`
/// blocks) and every activation row `r`; `y` has `n` columns.
///
/// # Safety
/// `isa` runs on this CPU and is one of the quantized kernels' sets; `y` holds
/// `acts.rows() · n` floats and no other thread writes its columns `column .. column + rows`.
pub(super) unsafe fn columns<F: Format>(
    isa: Isa,
    rows: &[u8],
    row_bytes: usize,
    acts: &Activations,
    y: *mut f32,
    n: usize,
    column: usize,
) {
    let m = acts.rows();
    let mut out = [0.0f32; MAX_ROWS];
    for (i, row) in rows.chunks_exact(row_bytes).enumerate() {
        let mut first = 0;
        while first < m {
            let tile = match m - first {
                left if left >= 8 => 8,
                left if left >= 4 => 4,
                left if left >= 2 => 2,
                _ => 1,
            };
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 | Isa::Avx512Vnni => {
                    simd_rows::<F>(isa, tile, row, acts, first, &mut out)
                }
                _ => portable_rows::<F>(row, acts, first, &mut out[..tile]),
            }
            for (r, &value) in out[..tile].iter().enumerate() {
                *y.add((first + r) * n + column + i) = value;
            }
            first += tile;
        }
    }
}

/// The portable kernel, the reference of the others: `out[r] = x_{first + r} · row`.
fn portable_rows<F: Format>(row: &[u8], acts: &Activations, first: usize, out: &mut [f32]) {
    out.fill(0.0);
    for (b, block) in row.chunks_exact(F::BYTES).enumerate() {
        // SAFETY: the software conversion runs everywhere.
        let header = unsafe { F::header::<SoftHalf>(block) };
        for j in 0..F::SUBS {
            let scales = F::scales(&header, j);
            let quants = F::quants(block, j);
            let sub = b * F::SUBS + j;
            for (r, out) in out.iter_mut().enumerate() {
                let a = acts.block(first + r, sub);
                let mut dot = [0i32; 2];
                for (i, (&q, &a)) in quants.iter().zip(a).enumerate() {
                    let q = if F::SIGNED {
                        i32::from(q as i8)
                    } else {
                        i32::from(q)
                    };
                    dot[i / 16] += q * i32::from(a);
                }
                let at = acts.at(first + r, sub);
                let s = acts.scales[at];
                let dot = if F::SPLIT {
                    scales.scale[0] * s * dot[0] as f32 + scales.scale[1] * s * dot[1] as f32
                } else {
                    scales.scale[0] * s * (dot[0] + dot[1]) as f32
                };
                *out += dot + offset::<F>(&scales, acts.half_sums[at]);
            }
        }
    }
}

/// One of the SIMD paths for a tile of `tile` rows (8, 4, 2 or 1).
///
/// # Safety
/// `isa` (AVX2 or AVX-512 VNNI) runs on this CPU.
#[cfg(target_arch = "x86_64")]
unsafe fn simd_rows<F: Format>(
    isa: Isa,
    tile: usize,
    row: &[u8],
    acts: &Activations,
    first: usize,
    out: &mut [f32; MAX_ROWS],
) {
    macro_rules! tiles {
        ($path:ident) => {
            match tile {
                8 => $path::rows::<F, 8>(row, acts, first, out),
                4 => $path::rows::<F, 4>(row, acts, first, out),
                2 => $path::rows::<F, 2>(row, acts, first, out),
                _ => $path::rows::<F, 1>(row, acts, first, out),
            }
        };
    }
    if isa == Isa::Avx512Vnni {
        tiles!(vnni)
    } else {
        tiles!(avx2)
    }
}

/// A SIMD path: the same loop for AVX2 and AVX-512 VNNI, apart from the features it is compiled
/// for and the instruction that forms the 8 partial dot products (`$dot`).
#[cfg(target_arch = "x86_64")]
macro_rules! simd_path {
    ($name:ident, $features:literal, $dot:ident) => {
        mod $name {
            use std::arch::x86_64::*;

            use super::super::format::{F16c, Format};
            use super::{offset, Activations, MAX_ROWS};
            use crate::compute::cpu::vmath::avx2::hsum;

            /// `out[r] = x_{first + r} · row` for `r < R`.
            #[target_feature(enable = $features)]
            pub(super) unsafe fn rows<F: Format, const R: usize>(
                row: &[u8],
                acts: &Activations,
                first: usize,
                out: &mut [f32; MAX_ROWS],
            ) {
                let mut acc = [_mm256_setzero_ps(); R];
                let mut offsets = [0.0f32; R];
                for (b, block) in row.chunks_exact(F::BYTES).enumerate() {
                    let header = F::header::<F16c>(block);
                    for j in 0..F::SUBS {
                        let scales = F::scales(&header, j);
                        let quants = F::quants_avx2(block.as_ptr(), j);
                        // Unsigned bytes for the left operand: Q8_0's magnitudes.
                        let unsigned = if F::SIGNED {
                            _mm256_sign_epi8(quants, quants)
                        } else {
                            quants
                        };
                        let sub = b * F::SUBS + j;
                        for r in 0..R {
                            let a = _mm256_loadu_si256(acts.block(first + r, sub).as_ptr().cast());
                            let a = if F::SIGNED {
                                _mm256_sign_epi8(a, quants)
                            } else {
                                a
                            };
                            let at = acts.at(first + r, sub);
                            let s = *acts.scales.get_unchecked(at);
                            let factor = if F::SPLIT {
                                _mm256_setr_m128(
                                    _mm_set1_ps(scales.scale[0] * s),
                                    _mm_set1_ps(scales.scale[1] * s),
                                )
                            } else {
                                _mm256_set1_ps(scales.scale[0] * s)
                            };
                            let dot = _mm256_cvtepi32_ps(super::$dot(unsigned, a));
                            acc[r] = _mm256_fmadd_ps(dot, factor, acc[r]);
                            offsets[r] += offset::<F>(&scales, *acts.half_sums.get_unchecked(at));
                        }
                    }
                }
                for r in 0..R {
                    out[r] = hsum(acc[r]) + offsets[r];
                }
            }
        }
    };
}

/// The 8 sums of 4 products `u_i · a_i` (unsigned by signed bytes) with AVX2.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn dot_avx2(
    u: std::arch::x86_64::__m256i,
    a: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1))
}

/// The 8 sums of 4 products `u_i · a_i` with one AVX-512 VNNI instruction.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512vnni,avx512vl")]
fn dot_vnni(
    u: std::arch::x86_64::__m256i,
    a: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a)
}

#[cfg(target_arch = "x86_64")]
simd_path!(avx2, "avx2,fma,f16c", dot_avx2);
#[cfg(target_arch = "x86_64")]
simd_path!(
    vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    dot_vnni
);
