//! The bf16-pair tiles of [`crate::compute::cpu::Isa::Avx512Bf16`]: `vdpbf16ps` multiplies a
//! pair of bf16 activations by a pair of bf16 weights and adds both products to an f32 sum, twice
//! the multiply-adds of an f32 FMA per instruction. What a prompt's products run on where the CPU
//! has it; a decode step's few rows stay on the f32 tiles, which the weights' bandwidth bounds.
//!
//! Invariants:
//! - Activations are rounded to bf16 (nearest even) and weights held as bf16 (exact for bf16
//!   weights; rounded from a dequantized f32 or an f16 weight); every sum is f32. Against the f32
//!   tiles a result differs by about 2⁻⁹ of `Σ|x·w|` (the activation's rounding), the precision
//!   at which PyTorch and vLLM run a bf16 model.
//! - Pair layout: a panel of `k2 = ⌈K/2⌉` pair rows × 16 columns of u32, word `(kk2, j)` holding
//!   `w[2·kk2][j]` in its low half and `w[2·kk2 + 1][j]` in its high half (zero past `K`); the
//!   activations of a row tile likewise, word `kk2 · R + r` holding `x[r][2·kk2]` and
//!   `x[r][2·kk2 + 1]`. A panel of pairs is `2·k2 × 16` bf16: a caller may treat it as a panel of
//!   bf16 rows `2·k2` deep.
//! - Panels are paired per task, into a buffer the tiles of every row tile then read (the
//!   conversion is amortised over the call's rows; its cost is why decode stays on f32).
//! - Tiles cover the same `(R, P)` combinations as the AVX-512 f32 tiles ([`super::kernels`]).
//! - Everything here needs AVX-512F and AVX512-BF16: the safety contract of the `unsafe` functions.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::bf16;
use rayon::prelude::*;

use super::kernels::PANEL;
use crate::store::dtype::{KvDtype, KvElement};

/// `x` (`[m, k]` row-major) as consecutive row tiles of `tile_rows` rows (the last may be
/// shorter), in the pair layout, each word's bits carried in an f32 slot (the tiles' activation
/// buffer type): tile `t` at `t · tile_rows · k2`. Tiles are made in parallel on the pool, each
/// row converted with `vcvtneps2bf16`: a row's bf16 values in order are its pair words. (Made
/// one element at a time on one thread, this took 16% of a 512-token prompt.)
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16.
pub(super) unsafe fn interleave_pairs(x: &[f32], m: usize, k: usize, tile_rows: usize) -> Vec<f32> {
    let k2 = k.div_ceil(2);
    let mut tiles = vec![0.0f32; m * k2];
    tiles
        .par_chunks_mut(tile_rows * k2)
        .zip(x.par_chunks(tile_rows * k))
        .for_each_init(
            || vec![0u32; k2],
            |words, (tile, rows_x)| {
                let rows = rows_x.len() / k;
                for (r, row) in rows_x.chunks_exact(k).enumerate() {
                    // SAFETY: the caller's CPU contract; `words` holds ⌈k/2⌉ words.
                    unsafe { to_bf16(row, words) };
                    for (kk2, &word) in words.iter().enumerate() {
                        tile[kk2 * rows + r] = f32::from_bits(word);
                    }
                }
            },
        );
    tiles
}

/// `row` rounded to bf16 (nearest even) into `words`, two values a word (zero past the row).
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
unsafe fn to_bf16(row: &[f32], words: &mut [u32]) {
    let mut chunks = row.chunks_exact(16);
    for (i, chunk) in (&mut chunks).enumerate() {
        let halves = _mm512_cvtneps_pbh(_mm512_loadu_ps(chunk.as_ptr()));
        _mm256_storeu_si256(
            words.as_mut_ptr().add(8 * i).cast(),
            std::mem::transmute::<__m256bh, __m256i>(halves),
        );
    }
    let done = row.len() - chunks.remainder().len();
    for (j, pair) in chunks.remainder().chunks(2).enumerate() {
        let low = bf16::from_f32(pair[0]).to_bits() as u32;
        let high = pair
            .get(1)
            .map_or(0, |&v| bf16::from_f32(v).to_bits() as u32);
        words[done / 2 + j] = low | high << 16;
    }
}

/// Pairs the panels of `src` (`k × 16` each, any element type) into `dst` (`2·⌈k/2⌉ × 16` bf16
/// each).
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16; `dst` holds a paired panel per panel of `src`.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
pub(super) unsafe fn pair_panels<T: KvElement>(src: &[T], k: usize, dst: &mut [bf16]) {
    let (panel, k2) = (k * PANEL, k.div_ceil(2));
    assert!(dst.len() >= src.len() / panel * k2 * 2 * PANEL);
    for (s, d) in src
        .chunks_exact(panel)
        .zip(dst.chunks_exact_mut(k2 * 2 * PANEL))
    {
        for kk2 in 0..k2 {
            let low = row_bits(s.as_ptr().add(2 * kk2 * PANEL));
            let high = if 2 * kk2 + 1 < k {
                row_bits(s.as_ptr().add((2 * kk2 + 1) * PANEL))
            } else {
                _mm256_setzero_si256()
            };
            let words = _mm512_or_si512(
                _mm512_cvtepu16_epi32(low),
                _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(high)),
            );
            _mm512_storeu_si512(d.as_mut_ptr().add(kk2 * 2 * PANEL).cast(), words);
        }
    }
}

/// The 16 elements at `p` as bf16 bits.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma,f16c")]
unsafe fn row_bits<T: KvElement>(p: *const T) -> __m256i {
    let to_bf16 = |v: __m512| std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(v));
    match T::DTYPE {
        KvDtype::Bf16 => _mm256_loadu_si256(p.cast()),
        KvDtype::F32 => to_bf16(_mm512_loadu_ps(p.cast())),
        KvDtype::F16 => to_bf16(_mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))),
    }
}

/// One tile: `rows` row-tile activations `x` (pair words) times `panels` paired panels at `w`,
/// `k2` pair rows deep, into `out` (`rows × panels · 16`, row stride `panels · 16`).
///
/// # Safety
/// The CPU has AVX-512F and AVX512-BF16; the extents are those of
/// [`super::kernels::tile`] with `k2` pair rows; `(rows, panels)` is an AVX-512 combination.
#[target_feature(enable = "avx512f,avx512bf16")]
pub(super) unsafe fn tile(
    rows: usize,
    panels: usize,
    x: *const u32,
    w: *const u32,
    k2: usize,
    out: *mut f32,
) {
    match (rows, panels) {
        (1, 8) => block::<1, 8>(x, w, k2, out),
        (2, 4) => block::<2, 4>(x, w, k2, out),
        (3, 2) => block::<3, 2>(x, w, k2, out),
        (4, 2) => block::<4, 2>(x, w, k2, out),
        (5, 2) => block::<5, 2>(x, w, k2, out),
        (6, 2) => block::<6, 2>(x, w, k2, out),
        (7, 2) => block::<7, 2>(x, w, k2, out),
        (8, 2) => block::<8, 2>(x, w, k2, out),
        (1, _) => block::<1, 1>(x, w, k2, out),
        (2, _) => block::<2, 1>(x, w, k2, out),
        (3, _) => block::<3, 1>(x, w, k2, out),
        (4, _) => block::<4, 1>(x, w, k2, out),
        (5, _) => block::<5, 1>(x, w, k2, out),
        (6, _) => block::<6, 1>(x, w, k2, out),
        (7, _) => block::<7, 1>(x, w, k2, out),
        _ => block::<8, 1>(x, w, k2, out),
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn block<const R: usize, const P: usize>(
    x: *const u32,
    w: *const u32,
    k2: usize,
    out: *mut f32,
) {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    for kk2 in 0..k2 {
        let mut wv = [_mm512_setzero_si512(); P];
        for (p, v) in wv.iter_mut().enumerate() {
            *v = _mm512_loadu_si512(w.add((p * k2 + kk2) * PANEL).cast());
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_epi32(*x.add(kk2 * R + r) as i32);
            for (a, v) in row.iter_mut().zip(&wv) {
                *a = _mm512_dpbf16_ps(
                    *a,
                    std::mem::transmute::<__m512i, __m512bh>(xv),
                    std::mem::transmute::<__m512i, __m512bh>(*v),
                );
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (p, a) in row.iter().enumerate() {
            _mm512_storeu_ps(out.add(r * P * PANEL + p * PANEL), *a);
        }
    }
}
