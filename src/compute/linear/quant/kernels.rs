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

/// 1.5·2²³: added to an f32 of magnitude < 2²² it leaves no fraction bits, so the sum is that
/// value rounded to nearest even (the default rounding mode).
const ROUNDING: f32 = 12_582_912.0;

/// Activation rows one weight sub-block is decoded for at most.
pub(super) const MAX_ROWS: usize = 8;

/// A tile of activation rows: `rows` (8, 4, 2 or 1) rows from `first`; the `index`-th tile.
#[derive(Clone, Copy)]
pub(super) struct Tile {
    index: usize,
    first: usize,
    rows: usize,
}

/// `x` quantized per row and 32 values to i8 quants and a scale, laid out tile by tile so that a
/// kernel reads what one weight sub-block meets as consecutive memory.
///
/// Within a tile of `R` rows from row `f` (`subs = k / 32`):
/// - the quants of row `f + r`, sub-block `j` are the 32 at `f·k + (j·R + r)·32`;
/// - its scale is at `f·subs + j·R + r`;
/// - the scaled sums of its halves `h` are at `(index·subs + j)·16 + 8h + r`, 8 lanes per half
///   with the rows past `R` zero, so one vector FMA adds a sub-block's offset to every row.
pub(super) struct Activations {
    k: usize,
    tiles: Vec<Tile>,
    quants: Vec<i8>,
    scales: Vec<f32>,
    half_sums: Vec<f32>,
}

impl Activations {
    /// Row-major `x` `[m, k]`, `k` a multiple of 32.
    pub(super) fn quantize(x: &[f32], m: usize, k: usize) -> Self {
        let subs = k / 32;
        let mut tiles = Vec::new();
        let mut first = 0;
        while first < m {
            let rows = match m - first {
                left if left >= 8 => 8,
                left if left >= 4 => 4,
                left if left >= 2 => 2,
                _ => 1,
            };
            tiles.push(Tile {
                index: tiles.len(),
                first,
                rows,
            });
            first += rows;
        }
        let mut acts = Activations {
            k,
            quants: vec![0; m * k],
            scales: vec![0.0; m * subs],
            half_sums: vec![0.0; tiles.len() * subs * 16],
            tiles,
        };
        for tile in acts.tiles.clone() {
            for r in 0..tile.rows {
                let row = &x[(tile.first + r) * k..][..k];
                for (j, values) in row.chunks_exact(32).enumerate() {
                    let max = values.iter().fold(0.0f32, |max, v| max.max(v.abs()));
                    // `max` skips NaN; a block holding one gets a NaN scale, so the NaN reaches
                    // every output it touches, as in a float product, instead of becoming 0.
                    let nan = values.iter().any(|v| v.is_nan());
                    let scale = if nan { f32::NAN } else { max / 127.0 };
                    let inverse = if max > 0.0 { 127.0 / max } else { 0.0 };
                    let at = tile.first * k + (j * tile.rows + r) * 32;
                    let mut sums = [0i32; 2];
                    for (i, (q, &v)) in acts.quants[at..at + 32].iter_mut().zip(values).enumerate()
                    {
                        // Rounded to nearest even by adding and removing 1.5·2²³ (exact for
                        // |v · inverse| ≤ 127): `round_ties_even` is a libm call per value on the
                        // baseline target (2% of a decode step in perf). `as` saturates.
                        *q = ((v * inverse + ROUNDING) - ROUNDING) as i8;
                        sums[i / 16] += i32::from(*q);
                    }
                    acts.scales[tile.first * subs + j * tile.rows + r] = scale;
                    let at = (tile.index * subs + j) * 16 + r;
                    acts.half_sums[at] = scale * sums[0] as f32;
                    acts.half_sums[at + 8] = scale * sums[1] as f32;
                }
            }
        }
        acts
    }

    /// The tiles, in row order.
    pub(super) fn tiles(&self) -> &[Tile] {
        &self.tiles
    }

    fn subs(&self) -> usize {
        self.k / 32
    }

    /// The 32 quants of row `first + r` of `tile`, sub-block `sub`.
    #[inline(always)]
    pub(super) fn block(&self, tile: Tile, sub: usize, r: usize) -> &[i8] {
        &self.quants[tile.first * self.k + (sub * tile.rows + r) * 32..][..32]
    }

    /// The scale of row `first + r` of `tile`, sub-block `sub`.
    #[inline(always)]
    fn scale(&self, tile: Tile, sub: usize, r: usize) -> f32 {
        self.scales[tile.first * self.subs() + sub * tile.rows + r]
    }

    /// The scaled sums of `tile`'s rows in sub-block `sub`: half 0 in lanes 0..8, half 1 in
    /// lanes 8..16, one lane per row (zero past the tile's rows).
    #[inline(always)]
    fn half_sums(&self, tile: Tile, sub: usize) -> &[f32] {
        &self.half_sums[(tile.index * self.subs() + sub) * 16..][..16]
    }

    /// Where sub-block `sub` of `tile` starts in each array, unchecked (the SIMD loops' form of
    /// [`Activations::block`], [`Activations::scale`] and [`Activations::half_sums`]: the rows'
    /// quants are 32 apart, their scales consecutive).
    ///
    /// # Safety
    /// `tile` is one of [`Activations::tiles`] and `sub < k / 32`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn pointers(&self, tile: Tile, sub: usize) -> (*const i8, *const f32, *const f32) {
        let subs = self.subs();
        (
            self.quants
                .as_ptr()
                .add(tile.first * self.k + sub * tile.rows * 32),
            self.scales
                .as_ptr()
                .add(tile.first * subs + sub * tile.rows),
            self.half_sums.as_ptr().add((tile.index * subs + sub) * 16),
        )
    }
}

/// The coefficients of a sub-block's two halves' scaled activation sums in its result:
/// `min[h] − Z·scale[h]` (none when the format has neither a min nor a zero).
#[inline(always)]
fn offsets<F: Format>(scales: &super::format::Scales) -> Option<[f32; 2]> {
    if !F::HAS_MIN && F::ZERO == 0 {
        return None;
    }
    let zero = F::ZERO as f32;
    Some([
        scales.min[0] - zero * scales.scale[0],
        scales.min[1] - zero * scales.scale[1],
    ])
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
    let mut out = [0.0f32; MAX_ROWS];
    // Tiles outside, weight rows inside: a tile's activations (≤ 8 rows) stay in L1 while the
    // task's weight rows come again from L2. The other order streamed every tile past each
    // weight row: a 512-token prompt's activations (~300 KB) from L2 once per row.
    for &tile in acts.tiles() {
        for (i, row) in rows.chunks_exact(row_bytes).enumerate() {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 | Isa::Avx512Vnni => simd_rows::<F>(isa, tile, row, acts, &mut out),
                _ => portable_rows::<F>(row, acts, tile, &mut out[..tile.rows]),
            }
            for (r, &value) in out[..tile.rows].iter().enumerate() {
                *y.add((tile.first + r) * n + column + i) = value;
            }
        }
    }
}

/// The portable kernel, the reference of the others: `out[r] = x_{tile.first + r} · row`.
fn portable_rows<F: Format>(row: &[u8], acts: &Activations, tile: Tile, out: &mut [f32]) {
    out.fill(0.0);
    for (b, block) in row.chunks_exact(F::BYTES).enumerate() {
        // SAFETY: the software conversion runs everywhere.
        let header = unsafe { F::header::<SoftHalf>(block) };
        for j in 0..F::SUBS {
            let scales = F::scales(&header, j);
            let quants = F::quants(block, j);
            let sub = b * F::SUBS + j;
            let sums = acts.half_sums(tile, sub);
            for (r, out) in out.iter_mut().enumerate() {
                let mut dot = [0i32; 2];
                for (i, (&q, &a)) in quants.iter().zip(acts.block(tile, sub, r)).enumerate() {
                    let q = if F::SIGNED {
                        i32::from(q as i8)
                    } else {
                        i32::from(q)
                    };
                    dot[i / 16] += q * i32::from(a);
                }
                let s = acts.scale(tile, sub, r);
                *out += scales.scale[0] * s * dot[0] as f32 + scales.scale[1] * s * dot[1] as f32;
                if let Some(c) = offsets::<F>(&scales) {
                    *out += c[0] * sums[r] + c[1] * sums[8 + r];
                }
            }
        }
    }
}

/// One of the SIMD paths for a tile of 8, 4, 2 or 1 rows.
///
/// # Safety
/// `isa` (AVX2 or AVX-512 VNNI) runs on this CPU.
#[cfg(target_arch = "x86_64")]
unsafe fn simd_rows<F: Format>(
    isa: Isa,
    tile: Tile,
    row: &[u8],
    acts: &Activations,
    out: &mut [f32; MAX_ROWS],
) {
    macro_rules! tiles {
        ($path:ident) => {
            match tile.rows {
                8 => $path::rows::<F, 8>(row, acts, tile, out),
                4 => $path::rows::<F, 4>(row, acts, tile, out),
                2 => $path::rows::<F, 2>(row, acts, tile, out),
                _ => $path::rows::<F, 1>(row, acts, tile, out),
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
/// for and the instruction that forms the 8 partial dot products (`$dot`). Per sub-block and row
/// it is a dot, a conversion, a multiply of the sub-block's scales by the row's (a broadcast
/// load) and an FMA; the offsets of all the tile's rows take one FMA per half.
#[cfg(target_arch = "x86_64")]
macro_rules! simd_path {
    ($name:ident, $features:literal, $dot:ident) => {
        mod $name {
            use std::arch::x86_64::*;

            use super::super::format::{F16c, Format};
            use super::{offsets, Activations, Tile, MAX_ROWS};
            use crate::compute::cpu::vmath::avx2::hsum;

            /// `out[r] = x_{tile.first + r} · row` for `r < R` (`R` = `tile.rows`).
            #[target_feature(enable = $features)]
            pub(super) unsafe fn rows<F: Format, const R: usize>(
                row: &[u8],
                acts: &Activations,
                tile: Tile,
                out: &mut [f32; MAX_ROWS],
            ) {
                let mut acc = [_mm256_setzero_ps(); R];
                let mut offset = _mm256_setzero_ps();
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
                        let weight_scale = if F::SPLIT {
                            _mm256_setr_m128(
                                _mm_set1_ps(scales.scale[0]),
                                _mm_set1_ps(scales.scale[1]),
                            )
                        } else {
                            _mm256_set1_ps(scales.scale[0])
                        };
                        // SAFETY: `tile` is one of the activations' and `sub` one of the row's
                        // sub-blocks, whose count the call checked equals the activations'.
                        let (quants_at, scales_at, sums) = acts.pointers(tile, b * F::SUBS + j);
                        for r in 0..R {
                            let a = _mm256_loadu_si256(quants_at.add(32 * r).cast());
                            let a = if F::SIGNED {
                                _mm256_sign_epi8(a, quants)
                            } else {
                                a
                            };
                            let dot = _mm256_cvtepi32_ps(super::$dot(unsigned, a));
                            let row_scale = _mm256_broadcast_ss(&*scales_at.add(r));
                            acc[r] = _mm256_fmadd_ps(
                                dot,
                                _mm256_mul_ps(weight_scale, row_scale),
                                acc[r],
                            );
                        }
                        if let Some(c) = offsets::<F>(&scales) {
                            offset = _mm256_fmadd_ps(
                                _mm256_set1_ps(c[0]),
                                _mm256_loadu_ps(sums),
                                offset,
                            );
                            offset = _mm256_fmadd_ps(
                                _mm256_set1_ps(c[1]),
                                _mm256_loadu_ps(sums.add(8)),
                                offset,
                            );
                        }
                    }
                }
                let mut offsets = [0.0f32; 8];
                _mm256_storeu_ps(offsets.as_mut_ptr(), offset);
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
