//! Linear layers: `y[M, N] = x[M, K] · W[K, N]` with `W` stored in f32, f16 or bf16, or kept in
//! GGUF's quantized formats ([`quant`]), and `x`, `y` and every sum in f32, on the attention
//! thread pool.
//!
//! Invariants:
//! - A quantized weight's product runs the int8 kernels of [`quant`] below
//!   `DEQUANTIZED_FROM_ROWS` rows of `x`; from there (a prompt) the weight is dequantized, chunk
//!   by chunk of output rows, into f32 panels for the tiles below. Measured on Zen 4: SmolLM2's
//!   gate projection (Q4_1, 576 × 1536) took 1,086 µs on the int8 path at 63 rows and 1,188 µs
//!   dequantized at 64 (the crossover); a 512-token prompt ran at 323 tok/s on the int8 path and
//!   516 dequantized (`python -m lab bench model --quick --weight-dtype auto`).
//! - `W` is packed once, at construction, into panels of 16 columns: panel `p` holds
//!   `W[k][16p + j]` at `p·K·16 + k·16 + j`, zero past column `N`. A tile reads each weight once
//!   per `R` rows of `x` from one contiguous stream per panel, and never a padding column into `y`.
//! - `x` is copied once per call into row tiles of the widest tile's height (the last one
//!   shorter), each interleaved as `[k][rows]`: a tile's broadcasts then walk one pointer, not one
//!   per row, which cut the scalar instructions of the k-loop that competed with the FMAs.
//! - The work is split over panel ranges only: every task owns whole columns of `y`, so tasks
//!   write disjoint elements and the result does not depend on the thread count. Each `y` element
//!   is one f32 sum in increasing `k`.
//! - When a panel serves more than one tile of rows, 16-bit weights are converted to f32 once
//!   into a per-task buffer (K·16·P floats, ≤ 200 KB) instead of once per tile.
//! - Calls run on `cpu::pool()`, the same workers as the attention kernel: a model step
//!   alternates the two on the same threads instead of two pools fighting over the cores.
//! - Shapes are checked before any work ([`crate::error::Error::Shape`]); an unavailable kernel is
//!   [`crate::error::Error::InvalidArgument`]. Nothing here panics on caller input.
//!
//! Why own kernels and not the `gemm` crate (0.18), measured on this 2-core Zen 2 AVX2 machine
//! shared with other builds (load average 3–6): `gemm` f32 reached 85–93 GFLOP/s on one thread
//! for M ≥ 16 at SmolLM2-135M's shapes, a better f32 inner loop than these tiles (below). But it
//! takes one element type for `x`, `W` and `y` (f16 means f16 activations; no bf16 at all), so
//! 16-bit weights would need an f32 copy of each panel per call, doubling the bytes M = 1 moves;
//! with `Parallelism::Rayon(2)` it stayed on one thread below ~50 MFLOP (M = 16, K = 576,
//! N = 960: 86.5 vs 86.9 GFLOP/s, so half the cores idle in a decode step); and at M = 1 it gave
//! 5.9 GFLOP/s on the 113 MB lm_head (f32, 12 GB/s). These tiles read 16-bit weights as they
//! are (converted in registers at M ≤ 6, once per panel above), split every shape over the shared
//! pool, and at M = 1 stream the weights at 0.7–1.0 of the read bandwidth measured in the same
//! run (`python -m lab bench linear`, 2 threads, quiet minutes: qkv/o/gate_up/down bf16
//! 0.60–0.89, f32 0.71–1.04). At M = 16 they reached 0.40–0.51 of the 2-thread FMA peak
//! (180–195 GFLOP/s) and at M = 512 0.55–0.71, before `x` was interleaved; with it, under load,
//! 0.53–0.75 and 0.65–0.88 of the peak measured in the same run. Matching `gemm`'s f32 loop
//! (K-blocking, a 2-deep software pipeline) is the open step for prefill.

mod kernels;
#[cfg(target_arch = "x86_64")]
mod paired;
pub mod quant;
#[cfg(test)]
mod tests;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::compute::cpu::pool;
use crate::compute::cpu::Isa;
use crate::error::{Error, Result};
use crate::store::dtype::{KvDtype, KvElement};
use kernels::{max_rows, panels_for, Ahead, MAX_TILE, PANEL};
use quant::{QuantFormat, QuantMatrix};

/// Rows of `x` from which a quantized weight's product runs on dequantized f32 panels (see
/// `Linear::forward_dequantized`).
const DEQUANTIZED_FROM_ROWS: usize = 64;

/// f32 weights one chunk of the dequantized path holds: 16 MB, so a 262,144-token lm_head is
/// never dequantized whole.
const DEQUANTIZED_CHUNK: usize = 1 << 22;

/// The instruction sets the dense tiles of f32 and f16 weights are written for.
pub const ISAS: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Portable];

/// Those of bf16 weights: [`ISAS`] and the bf16-pair tiles (`paired`), which a call of
/// [`PAIRED_FROM_ROWS`] rows or more runs on (fewer take the AVX-512 f32 tiles). f32 and f16
/// weights never do: their activations stay f32, the precision their dtype was chosen for.
pub const BF16_ISAS: [Isa; 4] = [Isa::Avx512Bf16, Isa::Avx512, Isa::Avx2, Isa::Portable];

/// Those of quantized weights: `quant`'s int8 kernels below [`DEQUANTIZED_FROM_ROWS`] rows
/// ([`Isa::Avx512Bf16`] runs them on VNNI), the dense tiles from there, on bf16 pairs for
/// [`Isa::Avx512Bf16`].
pub const QUANTIZED_ISAS: [Isa; 4] = [Isa::Avx512Bf16, Isa::Avx512Vnni, Isa::Avx2, Isa::Portable];

/// Rows of `x` from which a bf16 weight's product runs on bf16 pairs: pairing a panel costs
/// about as much as 16 rows of its products.
const PAIRED_FROM_ROWS: usize = 16;

/// The instruction set calls on f32 and f16 weights take by default: the best this CPU has
/// under `cpu::ceiling`.
pub fn default_isa() -> Isa {
    Isa::default_of(&ISAS)
}

/// The weight in its storage type: packed panels of a float type, or GGUF's quantized rows.
enum Weight {
    Dense(Panels),
    Quantized(QuantMatrix),
}

/// The packed panels of a float weight.
enum Panels {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

/// A weight `W[K, N]` for `y = x · W`, packed in a float type or kept quantized
/// ([`quant`]); immutable once built.
pub struct Linear {
    in_features: usize,
    out_features: usize,
    weight: Weight,
}

impl Linear {
    /// Packs `weight`, whose element `(k, n)` is `weight[k · k_stride + n · n_stride]`, as
    /// `dtype` (rounded to nearest; f16 saturates to ±inf past 65504). `(N, 1)` strides read a
    /// row-major `[K, N]`, `(1, K)` a row-major `[N, K]` (the `[out, in]` checkpoint layout).
    pub fn new(
        weight: &[f32],
        in_features: usize,
        out_features: usize,
        strides: (usize, usize),
        dtype: KvDtype,
    ) -> Result<Self> {
        let (k, n) = (in_features, out_features);
        if k == 0 || n == 0 {
            return Err(Error::Shape(format!(
                "a linear weight needs positive extents, got [{k}, {n}]"
            )));
        }
        let last = (k - 1)
            .checked_mul(strides.0)
            .zip((n - 1).checked_mul(strides.1))
            .and_then(|(a, b)| a.checked_add(b));
        if last.is_none_or(|last| last >= weight.len()) {
            return Err(Error::Shape(format!(
                "a [{k}, {n}] weight at strides {strides:?} does not fit in {} elements",
                weight.len()
            )));
        }
        let weight = Weight::Dense(match dtype {
            KvDtype::F32 => Panels::F32(pack(weight, k, n, strides)),
            KvDtype::F16 => Panels::F16(pack(weight, k, n, strides)),
            KvDtype::Bf16 => Panels::Bf16(pack(weight, k, n, strides)),
        });
        Ok(Linear {
            in_features: k,
            out_features: n,
            weight,
        })
    }

    /// A weight kept in GGUF's quantized formats: `W`'s transpose, `[N, K]`, given as segments
    /// of whole output rows in the file's layout ([`QuantMatrix::new`]).
    pub fn quantized(in_features: usize, parts: Vec<(QuantFormat, Vec<u8>)>) -> Result<Self> {
        let matrix = QuantMatrix::new(in_features, parts)?;
        Ok(Linear {
            in_features,
            out_features: matrix.out_features(),
            weight: Weight::Quantized(matrix),
        })
    }

    /// `K`.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// `N`.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Whether the weight is kept in a GGUF quantized format (its rows can be dequantized).
    pub fn is_quantized(&self) -> bool {
        matches!(self.weight, Weight::Quantized(_))
    }

    /// The storage type of the weight: "float32", "float16", "bfloat16", or the quantized
    /// formats of its segments joined by "+" (each once, in row order: "q5_0+q8_0").
    pub fn storage(&self) -> String {
        match &self.weight {
            Weight::Dense(panels) => panels.dtype().name().to_string(),
            Weight::Quantized(matrix) => {
                let mut names: Vec<&str> = Vec::new();
                for format in matrix.formats() {
                    if !names.contains(&format.name()) {
                        names.push(format.name());
                    }
                }
                names.join("+")
            }
        }
    }

    /// Bytes of the stored weight (what one call with M ≤ 6 streams from memory).
    pub fn nbytes(&self) -> usize {
        match &self.weight {
            Weight::Dense(panels) => {
                self.out_features.div_ceil(PANEL)
                    * PANEL
                    * self.in_features
                    * panels.dtype().size_of()
            }
            Weight::Quantized(matrix) => matrix.nbytes(),
        }
    }

    /// The instruction sets this weight's kernels are written for.
    pub fn isas(&self) -> &'static [Isa] {
        match self.weight {
            Weight::Dense(Panels::Bf16(_)) => &BF16_ISAS,
            Weight::Dense(_) => &ISAS,
            Weight::Quantized(_) => &QUANTIZED_ISAS,
        }
    }

    /// The instruction set calls take by default: the best of [`Linear::isas`] this CPU has
    /// under `cpu::ceiling`.
    pub fn default_isa(&self) -> Isa {
        Isa::default_of(self.isas())
    }

    /// Rows `ids` of `Wᵀ` (output features) as f32 into `out` (`ids.len() · K`), for a
    /// quantized weight: a tied embedding table gathers its rows from its lm_head. A float
    /// weight is `InvalidArgument` (its panels are laid out for products, not rows).
    pub fn dequantize_rows(&self, ids: &[usize], out: &mut [f32]) -> Result<()> {
        match &self.weight {
            Weight::Quantized(matrix) => matrix.dequantize_rows(ids, out),
            Weight::Dense(_) => Err(Error::InvalidArgument(format!(
                "dequantize_rows reads quantized weights; this one is {}",
                self.storage()
            ))),
        }
    }

    /// `y = x · W` for `x` row-major `[m, K]` into `y` row-major `[m, N]`, on
    /// [`Linear::default_isa`].
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        self.forward_with(self.default_isa(), x, m, y)
    }

    /// [`Linear::forward`] on a chosen instruction set.
    pub fn forward_with(&self, isa: Isa, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        let (k, n) = (self.in_features, self.out_features);
        check_shapes(k, n, x, m, y)?;
        let family = if self.is_quantized() {
            "quantized linear"
        } else {
            "linear"
        };
        isa.check_for(family, self.isas())?;
        match &self.weight {
            Weight::Dense(panels) => match panels {
                Panels::F32(w) => multiply(w, k, n, isa, x, m, y, n),
                Panels::F16(w) => multiply(w, k, n, isa, x, m, y, n),
                Panels::Bf16(w) if isa == Isa::Avx512Bf16 && m < PAIRED_FROM_ROWS => {
                    multiply(w, k, n, Isa::Avx512, x, m, y, n)
                }
                Panels::Bf16(w) => multiply(w, k, n, isa, x, m, y, n),
            },
            Weight::Quantized(matrix) if m >= DEQUANTIZED_FROM_ROWS => {
                forward_dequantized(matrix, isa, x, m, y, DEQUANTIZED_CHUNK)
            }
            Weight::Quantized(matrix) => match isa {
                Isa::Avx512Bf16 => matrix.forward_with(Isa::Avx512Vnni, x, m, y),
                isa => matrix.forward_with(isa, x, m, y),
            },
        }
    }
}

/// `Shape` unless `x` holds `m` rows of `k` and `y` `m` rows of `n`.
fn check_shapes(k: usize, n: usize, x: &[f32], m: usize, y: &[f32]) -> Result<()> {
    if Some(x.len()) != m.checked_mul(k) || Some(y.len()) != m.checked_mul(n) {
        return Err(Error::Shape(format!(
            "linear [{k}, {n}] on {} inputs into {} outputs: expected {m} × {k} and {m} × {n}",
            x.len(),
            y.len()
        )));
    }
    Ok(())
}

/// `y = x · W` for packed f32/f16/bf16 panels of a `[k, n]` weight, row `r` of the result at
/// `y[r · y_stride ..][.. n]` (`y_stride ≥ n`: the columns of a wider output), the shapes and
/// `isa` checked by the caller.
#[allow(clippy::too_many_arguments)]
fn multiply<T: KvElement>(
    packed: &[T],
    k: usize,
    n: usize,
    isa: Isa,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    y_stride: usize,
) -> Result<()> {
    debug_assert!(m == 0 || y.len() >= (m - 1) * y_stride + n);
    if m == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    let x = &if isa == Isa::Avx512Bf16 {
        // SAFETY: the caller checked that `isa` runs on this CPU.
        pool()?.install(|| unsafe { paired::interleave_pairs(x, m, k, max_rows(isa)) })
    } else {
        interleave(x, m, k, max_rows(isa))
    };
    #[cfg(not(target_arch = "x86_64"))]
    let x = &interleave(x, m, k, max_rows(isa));
    let run = Run {
        isa,
        x,
        m,
        k,
        n,
        y: SharedOut(y.as_mut_ptr()),
        y_stride,
    };
    run.all(packed)
}

/// A quantized weight's product for many rows of `x` (a prompt), the shapes and `isa` checked
/// by the caller: the weight dequantized, chunk by chunk of output rows, straight into f32
/// panels (in parallel, a panel per task) and multiplied by the dense tiles, which are near the
/// FMA peak there, while the int8 products decode each weight block once per tile of 8 rows.
/// At most `chunk_floats` dequantized weights are held at once.
fn forward_dequantized(
    matrix: &QuantMatrix,
    isa: Isa,
    x: &[f32],
    m: usize,
    y: &mut [f32],
    chunk_floats: usize,
) -> Result<()> {
    let (k, n) = (matrix.in_features(), matrix.out_features());
    // The dense tiles' counterpart of the quantized path's instruction set.
    let dense_isa = match isa {
        Isa::Avx512Vnni => Isa::Avx512,
        other => other,
    };
    // Whole panels per chunk, so a chunk's columns start on a panel.
    let chunk = (chunk_floats / k / PANEL).max(1) * PANEL;
    let mut panels = vec![0.0f32; chunk.min(n.next_multiple_of(PANEL)) * k];
    let pool = pool()?;
    for start in (0..n).step_by(chunk) {
        let count = chunk.min(n - start);
        let packed = &mut panels[..count.div_ceil(PANEL) * PANEL * k];
        pool.install(|| {
            packed
                .par_chunks_mut(PANEL * k)
                .enumerate()
                .try_for_each_init(
                    || vec![0.0f32; k],
                    |row, (p, panel)| {
                        panel.fill(0.0);
                        let first = start + p * PANEL;
                        for j in 0..PANEL.min(start + count - first) {
                            matrix.dequantize_rows(&[first + j], row)?;
                            for (kk, &value) in row.iter().enumerate() {
                                panel[kk * PANEL + j] = value;
                            }
                        }
                        Ok::<(), Error>(())
                    },
                )
        })?;
        multiply(packed, k, count, dense_isa, x, m, &mut y[start..], n)?;
    }
    Ok(())
}

impl Panels {
    fn dtype(&self) -> KvDtype {
        match self {
            Panels::F32(_) => KvDtype::F32,
            Panels::F16(_) => KvDtype::F16,
            Panels::Bf16(_) => KvDtype::Bf16,
        }
    }
}

fn pack<T: KvElement>(weight: &[f32], k: usize, n: usize, strides: (usize, usize)) -> Vec<T> {
    let panels = n.div_ceil(PANEL);
    let mut packed = vec![T::default(); panels * k * PANEL];
    for (p, panel) in packed.chunks_exact_mut(k * PANEL).enumerate() {
        for (kk, row) in panel.chunks_exact_mut(PANEL).enumerate() {
            for (j, value) in row.iter_mut().enumerate().take(n - p * PANEL) {
                *value = T::from_f32(weight[kk * strides.0 + (p * PANEL + j) * strides.1]);
            }
        }
    }
    packed
}

/// `x` (`[m, k]` row-major) as consecutive tiles of `tile_rows` rows (the last may be shorter),
/// tile `t` at `t · tile_rows · k` holding its element `(r, kk)` at `kk · rows + r`.
fn interleave(x: &[f32], m: usize, k: usize, tile_rows: usize) -> Vec<f32> {
    let mut tiles = vec![0.0f32; m * k];
    for (tile, rows_x) in tiles.chunks_mut(tile_rows * k).zip(x.chunks(tile_rows * k)) {
        let rows = rows_x.len() / k;
        for (r, row) in rows_x.chunks_exact(k).enumerate() {
            for (kk, &value) in row.iter().enumerate() {
                tile[kk * rows + r] = value;
            }
        }
    }
    tiles
}

/// `y`'s base pointer, shared by the tasks of one call (here and in [`quant`]).
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);

impl SharedOut {
    /// The pointer (a method, so closures capture the `Sync` wrapper, not its field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

// SAFETY: tasks write disjoint column ranges of `y` (see the module invariants), and the call
// that owns `&mut y` waits for all of them.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// One checked call: the shapes agree and `isa` runs on this CPU.
struct Run<'a> {
    isa: Isa,
    x: &'a [f32],
    m: usize,
    k: usize,
    n: usize,
    y: SharedOut,
    y_stride: usize,
}

impl Run<'_> {
    /// Splits the panels over the pool: about 4 tasks per thread, for balance under load, each a
    /// whole number of the widest tile's panel groups (a task of fewer panels than a group would
    /// run M = 1 on single-panel tiles, 2 accumulators deep: bound by the FMA latency).
    fn all<T: KvElement>(&self, packed: &[T]) -> Result<()> {
        let panel_len = self.k * PANEL;
        let panels = packed.len() / panel_len;
        let pool = pool()?;
        let width = panels_for(self.isa, self.m.min(max_rows(self.isa)));
        let share = panels.div_ceil(pool.current_num_threads() * 4);
        let per_task = (share / width * width).max(width);
        pool.install(|| {
            packed
                .par_chunks(per_task * panel_len)
                .enumerate()
                .for_each(|(task, chunk)| self.task(chunk, task * per_task));
        });
        Ok(())
    }

    /// Whether the tiles run on bf16 pairs (`paired`).
    fn pairs(&self) -> bool {
        self.isa == Isa::Avx512Bf16
    }

    /// Rows of the panels the tiles read: `k`, or the pair rows' `2·⌈k/2⌉` bf16.
    fn depth(&self) -> usize {
        if self.pairs() {
            2 * self.k.div_ceil(2)
        } else {
            self.k
        }
    }

    /// Elements of `x`'s buffer per row: `k`, or `⌈k/2⌉` pair words.
    fn x_row(&self) -> usize {
        if self.pairs() {
            self.k.div_ceil(2)
        } else {
            self.k
        }
    }

    /// Panels `first..` held in `chunk`, for every row of `x`.
    fn task<T: KvElement>(&self, chunk: &[T], first: usize) {
        let panel_len = self.k * PANEL;
        let rows = self.m.min(max_rows(self.isa));
        let width = panels_for(self.isa, rows);
        let pairs = self.pairs();
        let convert = !pairs && T::DTYPE != KvDtype::F32 && self.m > rows;
        let mut to_f32 = vec![0.0f32; if convert { width * panel_len } else { 0 }];
        let mut to_pairs = vec![
            bf16::ZERO;
            if pairs {
                width * self.depth() * PANEL
            } else {
                0
            }
        ];
        let mut done = 0;
        while done < chunk.len() {
            let group = if chunk.len() - done >= width * panel_len {
                width
            } else {
                1
            };
            let end = done + group * panel_len;
            let (src, rest) = (&chunk[done..end], &chunk[end..]);
            let ahead = Ahead::new(&rest[..rest.len().min(width * panel_len)], self.k);
            let panel = first + done / panel_len;
            // SAFETY (conversions): `isa` runs on this CPU (checked by the caller of `all`).
            if pairs {
                #[cfg(target_arch = "x86_64")]
                {
                    let dst = &mut to_pairs[..group * self.depth() * PANEL];
                    unsafe { paired::pair_panels(src, self.k, dst) };
                    self.rows(group, dst, panel, Ahead::NONE);
                }
            } else if convert {
                let dst = &mut to_f32[..group * panel_len];
                unsafe { kernels::convert(self.isa, src, dst) };
                self.rows(group, dst, panel, ahead);
            } else {
                self.rows(group, src, panel, ahead);
            }
            done = end;
        }
    }

    /// Every tile of rows of `x` against `group` panels at `w`, the first being panel `panel`;
    /// the first tile requests `ahead`, the next group.
    fn rows<T: KvElement>(&self, group: usize, w: &[T], panel: usize, ahead: Ahead) {
        let mut out = [0.0f32; MAX_TILE];
        let col0 = panel * PANEL;
        let cols = (group * PANEL).min(self.n - col0);
        let mut row0 = 0;
        while row0 < self.m {
            let rows = (self.m - row0).min(max_rows(self.isa));
            // A shorter last tile of rows may want wider tiles than the group: then one panel each.
            let width = match panels_for(self.isa, rows) {
                wide if wide <= group && group.is_multiple_of(wide) => wide,
                _ => 1,
            };
            for sub in (0..group).step_by(width) {
                // The first tile brings the next group into L2; the others would only repeat it.
                let ahead = if row0 == 0 && sub == 0 {
                    ahead
                } else {
                    Ahead::NONE
                };
                self.tile(rows, width, w, sub, row0, col0, cols, &mut out, ahead);
            }
            row0 += rows;
        }
    }

    /// One tile: `rows` rows from `row0`, `width` panels from `sub` within the group.
    #[allow(clippy::too_many_arguments)]
    fn tile<T: KvElement>(
        &self,
        rows: usize,
        width: usize,
        w: &[T],
        sub: usize,
        row0: usize,
        col0: usize,
        cols: usize,
        out: &mut [f32; MAX_TILE],
        ahead: Ahead,
    ) {
        let panel_len = self.depth() * PANEL;
        let w = &w[sub * panel_len..(sub + width) * panel_len];
        // Row tiles are `max_rows` high but the last, so the tile of `row0` starts at `row0 · k`.
        let x = &self.x[row0 * self.x_row()..(row0 + rows) * self.x_row()];
        // SAFETY: `isa` runs on this CPU; `x` holds `rows` interleaved rows of `k`, `w` holds `width` panels,
        // `out` holds MAX_TILE ≥ rows · width · 16 floats, and `(rows, width)` is either
        // `(rows, panels_for(rows))` or `(rows, 1)`, the combinations every path lists.
        unsafe {
            kernels::tile(
                self.isa,
                rows,
                width,
                x.as_ptr(),
                w.as_ptr(),
                self.depth(),
                out.as_mut_ptr(),
                ahead,
            )
        };
        let first = sub * PANEL;
        let count = (width * PANEL).min(cols.saturating_sub(first));
        for r in 0..rows {
            let src = &out[r * width * PANEL..r * width * PANEL + count];
            // SAFETY: row `row0 + r` < m and columns `col0 + first .. + count` ≤ n lie in `y`
            // (m × n); this task alone writes these columns.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    self.y.0.add((row0 + r) * self.y_stride + col0 + first),
                    count,
                )
            };
        }
    }
}
