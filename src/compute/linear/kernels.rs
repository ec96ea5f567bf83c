//! The tile kernels of [`super::Linear`], once per instruction set.
//!
//! Invariants:
//! - A tile is `R` rows of `x`, interleaved (`x[kk · R + r]`, see `linear`'s module doc), times
//!   `P` consecutive panels of the packed weight (each `k × 16` elements), written to `out` as
//!   `R × (16·P)` f32 with row stride `16·P`. `R ≤ max_rows(isa)` and `R·P ≤ 16`.
//! - Weights are converted to f32 on load; every sum is accumulated in f32, one multiply-add per
//!   `x[r][k] · w[k][j]` in increasing `k` (fused on the SIMD paths, so paths agree to within
//!   the rounding of one product per term).
//! - The `R·P` combinations each path instantiates are listed in its `tile` match; `panels_for`
//!   only returns widths that match lists, and the `P = 1` tail exists for every `R`.
//! - A path other than [`Isa::Portable`] runs only when [`Isa::available`] says its CPU features
//!   are present: that is the safety contract of the `unsafe` functions here.

use crate::compute::cpu::Isa;
use crate::store::dtype::KvElement;

/// Columns of one packed panel.
pub(crate) const PANEL: usize = 16;

/// Largest `R · P · 16` of any tile: the size of the output buffer a caller provides.
pub(crate) const MAX_TILE: usize = 16 * PANEL;

/// The panels of the next group, which a tile requests into L2 while it computes: at each `k`
/// where its own rows of weight cross a 64-byte line, one line at the same offset of each panel
/// of `ahead`. Without it the first tile of every group waited on memory with the FMAs idle,
/// and the group's other tiles computed with the memory idle (M = 16 decode is at the balance
/// of the two for f32 weights).
#[derive(Clone, Copy)]
pub(crate) struct Ahead {
    pub(crate) base: *const u8,
    pub(crate) panel_bytes: usize,
    pub(crate) row_bytes: usize,
    pub(crate) panels: usize,
}

impl Ahead {
    /// Nothing to request.
    pub(crate) const NONE: Ahead = Ahead {
        base: std::ptr::null(),
        panel_bytes: 0,
        row_bytes: 0,
        panels: 0,
    };

    /// The next group, `panels` panels of `k · 16` elements of `T` at `next`.
    pub(crate) fn new<T>(next: &[T], k: usize) -> Self {
        let row_bytes = PANEL * std::mem::size_of::<T>();
        Ahead {
            base: next.as_ptr().cast(),
            panel_bytes: k * row_bytes,
            row_bytes,
            panels: next.len() / (k * PANEL),
        }
    }

    /// Requests the lines of steps `kk .. kk + UNROLL` of the k-loop (called once per unrolled
    /// block, so its scalar work is shared by `UNROLL` steps of FMAs).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn request(&self, kk: usize) {
        let end = (kk + UNROLL) * self.row_bytes;
        let mut offset = (kk * self.row_bytes).next_multiple_of(64);
        while offset < end {
            for p in 0..self.panels {
                // SAFETY: the address lies inside the next group's panels (offset < panel_bytes);
                // a prefetch never faults or writes.
                unsafe {
                    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
                    _mm_prefetch::<_MM_HINT_T1>(
                        self.base.add(p * self.panel_bytes + offset).cast(),
                    );
                }
            }
            offset += 64;
        }
    }
}

/// Steps of the k-loop per unrolled block. The per-step loop spent as many instructions on
/// its counter, addresses and prefetch test as on its 8 loads and 12 FMAs (a 6 × 16 f32 tile
/// issued ~40 instructions per step), which left the FMA units idle a third of the time.
#[cfg(target_arch = "x86_64")]
const UNROLL: usize = 4;

/// Rows of `x` one tile of `isa` covers at most.
pub(crate) fn max_rows(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => 6,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bf16 => 8,
        _ => 4,
    }
}

/// Panels per tile for `rows` rows: enough independent accumulators (≥ 8) to hide the FMA
/// latency when few rows share each weight load, which is what keeps M = 1 at the memory's
/// pace instead of the FMA chain's.
pub(crate) fn panels_for(isa: Isa, rows: usize) -> usize {
    match (isa, rows) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, 1) => 4,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, 2) => 2,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, _) => 1,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512 | Isa::Avx512Bf16, 1) => 8,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512 | Isa::Avx512Bf16, 2) => 4,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512 | Isa::Avx512Bf16, _) => 2,
        _ => 1,
    }
}

/// One tile: `rows` rows of `x`, `panels` panels from `w`, `k` deep, into `out`, requesting
/// `ahead` (ignored by the portable and bf16-pair paths).
///
/// # Safety
/// The CPU runs this path; `x` holds `rows` rows of `k`, interleaved; `w` holds
/// `panels · k · 16` elements; `out` holds `rows · panels · 16`; `(rows, panels)` is a
/// combination this path lists (see [`panels_for`]; `panels = 1` always is). On
/// [`Isa::Avx512Bf16`], `x` and `w` are in `paired`'s layout (pair words, `w` bf16 panels of
/// an even `k`).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn tile<T: KvElement>(
    isa: Isa,
    rows: usize,
    panels: usize,
    x: *const f32,
    w: *const T,
    k: usize,
    out: *mut f32,
    ahead: Ahead,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::tile(rows, panels, x, w, k, out, ahead),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512::tile(rows, panels, x, w, k, out, ahead),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bf16 => {
            debug_assert!(T::DTYPE == crate::store::dtype::KvDtype::Bf16 && k.is_multiple_of(2));
            super::paired::tile(rows, panels, x.cast(), w.cast(), k / 2, out)
        }
        _ => portable::tile(rows, x, w, k, out),
    }
}

/// Converts `src` to f32 into `dst` (same length), with this path's vector conversion.
///
/// # Safety
/// The CPU runs this path.
pub(crate) unsafe fn convert<T: KvElement>(isa: Isa, src: &[T], dst: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => avx2::convert(src, dst),
        _ => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
    }
}

/// Plain Rust over `[f32; 16]` accumulator rows, vectorised by the compiler for the baseline.
mod portable {
    use super::PANEL;
    use crate::store::dtype::KvElement;

    /// # Safety
    /// As [`tile`] with one panel and `rows ≤ 4`.
    pub(super) unsafe fn tile<T: KvElement>(
        rows: usize,
        x: *const f32,
        w: *const T,
        k: usize,
        out: *mut f32,
    ) {
        match rows {
            1 => rows_tile::<T, 1>(x, w, k, out),
            2 => rows_tile::<T, 2>(x, w, k, out),
            3 => rows_tile::<T, 3>(x, w, k, out),
            _ => rows_tile::<T, 4>(x, w, k, out),
        }
    }

    unsafe fn rows_tile<T: KvElement, const R: usize>(
        x: *const f32,
        w: *const T,
        k: usize,
        out: *mut f32,
    ) {
        // SAFETY (whole body): the caller guarantees the extents documented on `Isa::tile`.
        let w = unsafe { std::slice::from_raw_parts(w, k * PANEL) };
        let mut acc = [[0.0f32; PANEL]; R];
        for (kk, wrow) in w.chunks_exact(PANEL).enumerate() {
            let mut wf = [0.0f32; PANEL];
            for (f, v) in wf.iter_mut().zip(wrow) {
                *f = v.to_f32();
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let xv = unsafe { *x.add(kk * R + r) };
                // Not `mul_add`: without FMA in the baseline target it is a libm call per element.
                for (a, f) in row.iter_mut().zip(&wf) {
                    *a += xv * f;
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(r * PANEL), PANEL) };
        }
    }
}

/// AVX2 + FMA + F16C: two 8-lane vectors per panel; a 6 × 16 tile keeps 12 accumulators.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Ahead, PANEL, UNROLL};
    use crate::store::dtype::{load8, KvElement};

    /// # Safety
    /// AVX2, FMA and F16C are present; `dst.len() == src.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn convert<T: KvElement>(src: &[T], dst: &mut [f32]) {
        let vectors = src.len() / 8;
        for i in 0..vectors {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i * 8), load8(src.as_ptr().add(i * 8)));
        }
        for i in vectors * 8..src.len() {
            dst[i] = src[i].to_f32();
        }
    }

    /// # Safety
    /// As [`tile`] on a CPU with AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile<T: KvElement>(
        rows: usize,
        panels: usize,
        x: *const f32,
        w: *const T,
        k: usize,
        out: *mut f32,
        ahead: Ahead,
    ) {
        match (rows, panels) {
            (1, 4) => block::<T, 1, 4>(x, w, k, out, ahead),
            (2, 2) => block::<T, 2, 2>(x, w, k, out, ahead),
            (1, _) => block::<T, 1, 1>(x, w, k, out, ahead),
            (2, _) => block::<T, 2, 1>(x, w, k, out, ahead),
            (3, _) => block::<T, 3, 1>(x, w, k, out, ahead),
            (4, _) => block::<T, 4, 1>(x, w, k, out, ahead),
            (5, _) => block::<T, 5, 1>(x, w, k, out, ahead),
            _ => block::<T, 6, 1>(x, w, k, out, ahead),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block<T: KvElement, const R: usize, const P: usize>(
        x: *const f32,
        w: *const T,
        k: usize,
        out: *mut f32,
        ahead: Ahead,
    ) {
        let mut acc = [[[_mm256_setzero_ps(); 2]; P]; R];
        let mut kk = 0;
        while kk + UNROLL <= k {
            ahead.request(kk);
            for u in 0..UNROLL {
                step::<T, R, P>(&mut acc, x, w, k, kk + u);
            }
            kk += UNROLL;
        }
        while kk < k {
            step::<T, R, P>(&mut acc, x, w, k, kk);
            kk += 1;
        }
        for (r, row) in acc.iter().enumerate() {
            for (p, a) in row.iter().enumerate() {
                let at = out.add(r * P * PANEL + p * PANEL);
                _mm256_storeu_ps(at, a[0]);
                _mm256_storeu_ps(at.add(8), a[1]);
            }
        }
    }

    /// Step `kk` of the k-loop: `acc[r][p] += x[r][kk] · w[p][kk]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step<T: KvElement, const R: usize, const P: usize>(
        acc: &mut [[[__m256; 2]; P]; R],
        x: *const f32,
        w: *const T,
        k: usize,
        kk: usize,
    ) {
        let mut wv = [[_mm256_setzero_ps(); 2]; P];
        for (p, v) in wv.iter_mut().enumerate() {
            let at = w.add(p * k * PANEL + kk * PANEL);
            *v = [load8(at), load8(at.add(8))];
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = _mm256_broadcast_ss(&*x.add(kk * R + r));
            for (a, v) in row.iter_mut().zip(&wv) {
                a[0] = _mm256_fmadd_ps(xv, v[0], a[0]);
                a[1] = _mm256_fmadd_ps(xv, v[1], a[1]);
            }
        }
    }
}

/// AVX-512F: one 16-lane vector per panel; an 8 × 32 tile keeps 16 accumulators. Only AVX-512F
/// instructions are used: AVX512-BF16's `vdpbf16ps` rounds the activations to bf16 (it has its
/// own tiles, `paired`, for prompts) and AVX512-FP16 accumulates in f16.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Ahead, PANEL, UNROLL};
    use crate::store::dtype::{load16, KvElement};

    /// # Safety
    /// As [`tile`] on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn tile<T: KvElement>(
        rows: usize,
        panels: usize,
        x: *const f32,
        w: *const T,
        k: usize,
        out: *mut f32,
        ahead: Ahead,
    ) {
        match (rows, panels) {
            (1, 8) => block::<T, 1, 8>(x, w, k, out, ahead),
            (2, 4) => block::<T, 2, 4>(x, w, k, out, ahead),
            (3, 2) => block::<T, 3, 2>(x, w, k, out, ahead),
            (4, 2) => block::<T, 4, 2>(x, w, k, out, ahead),
            (5, 2) => block::<T, 5, 2>(x, w, k, out, ahead),
            (6, 2) => block::<T, 6, 2>(x, w, k, out, ahead),
            (7, 2) => block::<T, 7, 2>(x, w, k, out, ahead),
            (8, 2) => block::<T, 8, 2>(x, w, k, out, ahead),
            (1, _) => block::<T, 1, 1>(x, w, k, out, ahead),
            (2, _) => block::<T, 2, 1>(x, w, k, out, ahead),
            (3, _) => block::<T, 3, 1>(x, w, k, out, ahead),
            (4, _) => block::<T, 4, 1>(x, w, k, out, ahead),
            (5, _) => block::<T, 5, 1>(x, w, k, out, ahead),
            (6, _) => block::<T, 6, 1>(x, w, k, out, ahead),
            (7, _) => block::<T, 7, 1>(x, w, k, out, ahead),
            _ => block::<T, 8, 1>(x, w, k, out, ahead),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block<T: KvElement, const R: usize, const P: usize>(
        x: *const f32,
        w: *const T,
        k: usize,
        out: *mut f32,
        ahead: Ahead,
    ) {
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        let mut kk = 0;
        while kk + UNROLL <= k {
            ahead.request(kk);
            for u in 0..UNROLL {
                step::<T, R, P>(&mut acc, x, w, k, kk + u);
            }
            kk += UNROLL;
        }
        while kk < k {
            step::<T, R, P>(&mut acc, x, w, k, kk);
            kk += 1;
        }
        for (r, row) in acc.iter().enumerate() {
            for (p, a) in row.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * P * PANEL + p * PANEL), *a);
            }
        }
    }

    /// Step `kk` of the k-loop: `acc[r][p] += x[r][kk] · w[p][kk]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn step<T: KvElement, const R: usize, const P: usize>(
        acc: &mut [[__m512; P]; R],
        x: *const f32,
        w: *const T,
        k: usize,
        kk: usize,
    ) {
        let mut wv = [_mm512_setzero_ps(); P];
        for (p, v) in wv.iter_mut().enumerate() {
            *v = load16(w.add(p * k * PANEL + kk * PANEL));
        }
        for (r, row) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*x.add(kk * R + r));
            for (a, v) in row.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_ps(xv, *v, *a);
            }
        }
    }
}
