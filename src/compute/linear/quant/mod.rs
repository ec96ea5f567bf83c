//! Linear layers whose weight stays in GGUF's quantized block formats as shipped: `y = x · Wᵀ`
//! for `W` `[N, K]` (rows are output features, as in the file) and `x`, `y` in f32.
//!
//! Invariants:
//! - The weight is the file's bytes, row after row, never dequantized or repacked: one segment
//!   per format, so a fused projection (`[q|k|v]`) whose parts were shipped in different formats
//!   (Gemma 3's Q5_0 Q and K beside a Q8_0 V) is one matrix of several segments.
//! - A call quantizes each row of `x` per 32 values to i8 with one f32 scale (`max |x| / 127`,
//!   round to nearest even), as ggml's Q8 activations do; each weight sub-block of 32 then takes
//!   an exact integer dot product with the matching 32 activations, scaled once in f32 (see
//!   `kernels`). So the result is the product with `x` as quantized: off from the f32 product
//!   by at most `Σ_blocks scale_x / 2 · Σ |w|` (the tests hold every path to that bound), and the
//!   SIMD paths differ from the portable one only in the order of f32 additions.
//! - Work is split over output rows: each task owns whole columns of `y`, so the result does
//!   not depend on the thread count. Calls run on `cpu::pool()`, with attention and the dense
//!   linear kernels.
//! - Shapes and byte counts are checked when built and on every call; nothing here panics on
//!   caller input.

mod format;
mod kernels;

use rayon::prelude::*;

use super::{check_shapes, SharedOut};
use crate::compute::cpu::{pool, Isa};
use crate::error::{Error, Result};
pub use format::QuantFormat;
use format::{Q4K, Q4_0, Q4_1, Q5_0, Q6K, Q8_0};

/// The instruction sets the quantized kernels are written for.
pub const ISAS: [Isa; 3] = [Isa::Avx512Vnni, Isa::Avx2, Isa::Portable];

/// The instruction set calls take by default: the best this CPU has under `cpu::ceiling`.
pub fn default_isa() -> Isa {
    Isa::default_of(&ISAS)
}

/// Runs `$body` with `$F` the format type of `$format`.
macro_rules! with_format {
    ($format:expr, $F:ident => $body:expr) => {
        match $format {
            QuantFormat::Q8_0 => {
                type $F = Q8_0;
                $body
            }
            QuantFormat::Q4_0 => {
                type $F = Q4_0;
                $body
            }
            QuantFormat::Q4_1 => {
                type $F = Q4_1;
                $body
            }
            QuantFormat::Q5_0 => {
                type $F = Q5_0;
                $body
            }
            QuantFormat::Q4K => {
                type $F = Q4K;
                $body
            }
            QuantFormat::Q6K => {
                type $F = Q6K;
                $body
            }
        }
    };
}

/// Consecutive output rows in one format.
struct Segment {
    format: QuantFormat,
    first_row: usize,
    rows: usize,
    bytes: Vec<u8>,
}

impl Segment {
    fn row_bytes(&self, in_features: usize) -> usize {
        in_features / self.format.block_elems() * self.format.block_bytes()
    }
}

/// A quantized weight `W[N, K]` (output rows first), immutable once built.
pub struct QuantMatrix {
    in_features: usize,
    out_features: usize,
    segments: Vec<Segment>,
}

impl QuantMatrix {
    /// A weight of `in_features` columns from segments of whole rows, each `(format, bytes)` in
    /// the file's layout (rows of `in_features / block_elems` blocks), stacked in order.
    pub fn new(in_features: usize, parts: Vec<(QuantFormat, Vec<u8>)>) -> Result<Self> {
        if in_features == 0 || parts.is_empty() {
            return Err(Error::Shape(
                "a quantized weight needs columns and at least one segment".into(),
            ));
        }
        let mut segments = Vec::with_capacity(parts.len());
        let mut first_row = 0;
        for (format, bytes) in parts {
            if !in_features.is_multiple_of(format.block_elems()) {
                return Err(Error::Shape(format!(
                    "{} rows of {in_features} weights are not whole blocks of {}",
                    format.name(),
                    format.block_elems()
                )));
            }
            // Checked: a row longer than memory could hold is refused, not wrapped.
            let row_bytes = (in_features / format.block_elems())
                .checked_mul(format.block_bytes())
                .ok_or_else(|| {
                    Error::Shape(format!(
                        "rows of {in_features} weights do not fit in memory"
                    ))
                })?;
            if bytes.is_empty() || !bytes.len().is_multiple_of(row_bytes) {
                return Err(Error::Shape(format!(
                    "{} bytes are not whole {} rows of {in_features} weights ({row_bytes} bytes each)",
                    bytes.len(),
                    format.name()
                )));
            }
            let rows = bytes.len() / row_bytes;
            segments.push(Segment {
                format,
                first_row,
                rows,
                bytes,
            });
            first_row += rows;
        }
        Ok(QuantMatrix {
            in_features,
            out_features: first_row,
            segments,
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

    /// Bytes of the weight (what one call streams from memory).
    pub fn nbytes(&self) -> usize {
        self.segments.iter().map(|s| s.bytes.len()).sum()
    }

    /// The segments' formats, in row order, each once per segment.
    pub fn formats(&self) -> Vec<QuantFormat> {
        self.segments.iter().map(|s| s.format).collect()
    }

    /// Rows `ids` of `W` as f32 into `out` (`ids.len() · K`), bit-exact with ggml's
    /// dequantization: a tied embedding table gathers its rows from here.
    pub fn dequantize_rows(&self, ids: &[usize], out: &mut [f32]) -> Result<()> {
        let k = self.in_features;
        if Some(out.len()) != ids.len().checked_mul(k) {
            return Err(Error::Shape(format!(
                "{} rows of {k} into {} values",
                ids.len(),
                out.len()
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&id| id >= self.out_features) {
            return Err(Error::InvalidArgument(format!(
                "row {bad} is out of range for {} rows",
                self.out_features
            )));
        }
        for (&id, out) in ids.iter().zip(out.chunks_exact_mut(k)) {
            let segment = self
                .segments
                .iter()
                .find(|s| id < s.first_row + s.rows)
                .expect("ids are checked against out_features");
            let row_bytes = segment.row_bytes(k);
            let row = &segment.bytes[(id - segment.first_row) * row_bytes..][..row_bytes];
            with_format!(segment.format, F => format::dequantize::<F>(row, out));
        }
        Ok(())
    }

    /// `y = x · Wᵀ` for `x` row-major `[m, K]` into `y` row-major `[m, N]`, on [`default_isa`].
    pub fn forward(&self, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        self.forward_with(default_isa(), x, m, y)
    }

    /// [`QuantMatrix::forward`] on a chosen instruction set.
    pub fn forward_with(&self, isa: Isa, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        let (k, n) = (self.in_features, self.out_features);
        check_shapes(k, n, x, m, y)?;
        isa.check_for("quantized linear", &ISAS)?;
        if m == 0 {
            return Ok(());
        }
        let acts = kernels::Activations::quantize(x, m, k);
        let pool = pool()?;
        let tasks = self.tasks(pool.current_num_threads());
        let out = SharedOut(y.as_mut_ptr());
        pool.install(|| {
            tasks.par_iter().for_each(|&(segment, start, end)| {
                let segment = &self.segments[segment];
                let row_bytes = segment.row_bytes(k);
                let rows = &segment.bytes[start * row_bytes..end * row_bytes];
                let column = segment.first_row + start;
                // SAFETY: `isa` runs on this CPU (checked above); the task's columns
                // `column .. column + end - start` are its own, and the call owning `y` waits.
                with_format!(segment.format, F => unsafe {
                    kernels::columns::<F>(isa, rows, row_bytes, &acts, out.get(), n, column)
                });
            });
        });
        Ok(())
    }

    /// `(segment, first row, end row)` ranges of about equal bytes, ~4 per thread for balance
    /// under load.
    fn tasks(&self, threads: usize) -> Vec<(usize, usize, usize)> {
        let share = self.nbytes().div_ceil(threads * 4).max(1);
        let mut tasks = Vec::new();
        for (index, segment) in self.segments.iter().enumerate() {
            let per_task = (share / segment.row_bytes(self.in_features)).max(1);
            let mut start = 0;
            while start < segment.rows {
                let end = (start + per_task).min(segment.rows);
                tasks.push((index, start, end));
                start = end;
            }
        }
        tasks
    }
}

// After `with_format!`, which the tests use.
#[cfg(test)]
mod tests;
