//! Physical K and V storage of every layer, owned by Rust.
//!
//! Layout per layer and per K or V: `[num_blocks, num_kv_heads, block_size, head_dim]`, so the
//! `block_size × head_dim` tile of one (block, KV head) is contiguous and the attention loop reads
//! it sequentially. Token slot `s` is row `s % block_size` of block `s / block_size`.
//!
//! Invariants:
//! - Each buffer holds exactly `num_blocks * block_elems()` elements of the cache's dtype.
//! - A cache exists only for a shape whose total K and V bytes fit `isize::MAX` and whose blocks
//!   are numbered by int32 ids (checked at construction, [`KvShape::validate`]): every size and
//!   offset derived from it, being a factor of that total, is then computed without overflow.
//! - Every stored element is finite: `write` refuses NaN, infinity, and finite values the dtype
//!   would round to infinity (beyond ±65504 in f16), so what is read back is what was written,
//!   rounded.
//! - A block table is read only in its first `ceil(num_tokens / block_size)` entries
//!   ([`KvShape::used_blocks`]); the rest is padding (-1 in the scheduler's tables), never read.

use half::{bf16, f16};

use crate::block_manager::{CopyOp, MAX_NUM_BLOCKS};
use crate::dtype::{KvDtype, KvElement};
use crate::error::{ensure, Error, Result};
use crate::{alloc, memory};

/// Dimensions of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvShape {
    /// Elements of one K (or V) block across all KV heads.
    pub fn block_elems(&self) -> usize {
        self.num_kv_heads * self.block_size * self.head_dim
    }

    /// Elements of one K (or V) token row across all KV heads.
    pub fn row_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Offset of (slot, head) in a layer buffer.
    pub fn offset(&self, slot: usize, head: usize) -> usize {
        let (block, row) = (slot / self.block_size, slot % self.block_size);
        ((block * self.num_kv_heads + head) * self.block_size + row) * self.head_dim
    }

    /// Checks that every dimension is positive and that the K and V bytes of all layers in
    /// `dtype`, the largest product the cache forms, fit `isize::MAX` (the most one allocation
    /// can hold).
    fn validate(&self, dtype: KvDtype) -> Result<()> {
        let dims = [
            self.num_layers,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        ];
        ensure(dims.iter().all(|&d| d > 0), || {
            format!("every KV cache dimension must be positive: {self:?}")
        })?;
        ensure(self.num_blocks <= MAX_NUM_BLOCKS, || {
            format!(
                "num_blocks {} exceeds {MAX_NUM_BLOCKS}: block tables hold int32 block ids",
                self.num_blocks
            )
        })?;
        let bytes = dims
            .iter()
            .try_fold(2 * dtype.size_of(), |total, &d| total.checked_mul(d))
            .filter(|&total| total <= isize::MAX as usize);
        ensure(bytes.is_some(), || {
            format!(
                "a {} KV cache of {self:?} needs more than isize::MAX bytes",
                dtype.name()
            )
        })
    }

    /// The entries of `table` that hold the first `num_tokens` tokens of a sequence, each checked
    /// to be a block of this cache; entries past them are padding and never read. `owner` names
    /// the table in errors (e.g. "sequence 3").
    pub fn used_blocks<'t>(
        &self,
        table: &'t [i32],
        num_tokens: usize,
        owner: impl Fn() -> String,
    ) -> Result<&'t [i32]> {
        let bs = self.block_size;
        let used = num_tokens.div_ceil(bs);
        ensure(used <= table.len(), || {
            format!(
                "{}: {num_tokens} tokens do not fit {} blocks of {bs}",
                owner(),
                table.len()
            )
        })?;
        let used = &table[..used];
        match used
            .iter()
            .find(|&&b| usize::try_from(b).map_or(true, |b| b >= self.num_blocks))
        {
            Some(bad) => Err(Error::InvalidArgument(format!(
                "{} uses block {bad}, outside 0..{}",
                owner(),
                self.num_blocks
            ))),
            None => Ok(used),
        }
    }
}

/// One layer's K or V buffer in its storage type.
#[derive(Debug, Clone)]
pub enum KvBuffer {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

/// Runs `$body` with `$buf` bound to the typed slice inside a `KvBuffer` (or `&mut` with `mut`).
#[macro_export]
macro_rules! with_kv_buffer {
    ($buffer:expr, $buf:ident => $body:expr) => {
        match $buffer {
            $crate::kv_cache::KvBuffer::F32($buf) => $body,
            $crate::kv_cache::KvBuffer::F16($buf) => $body,
            $crate::kv_cache::KvBuffer::Bf16($buf) => $body,
        }
    };
}

impl KvBuffer {
    fn zeroed(dtype: KvDtype, len: usize) -> Result<Self> {
        Ok(match dtype {
            KvDtype::F32 => KvBuffer::F32(memory::zeroed_vec(len, "a KV cache layer")?),
            KvDtype::F16 => KvBuffer::F16(memory::zeroed_vec(len, "a KV cache layer")?),
            KvDtype::Bf16 => KvBuffer::Bf16(memory::zeroed_vec(len, "a KV cache layer")?),
        })
    }

    /// `len` pseudo-random elements in [-1, 1) from `seed`, every page touched.
    pub(crate) fn random(dtype: KvDtype, len: usize, seed: u64, what: &str) -> Result<Self> {
        Ok(match dtype {
            KvDtype::F32 => KvBuffer::F32(memory::random_vec(len, seed, what)?),
            KvDtype::F16 => KvBuffer::F16(memory::random_vec(len, seed, what)?),
            KvDtype::Bf16 => KvBuffer::Bf16(memory::random_vec(len, seed, what)?),
        })
    }

    /// Storage type.
    pub fn dtype(&self) -> KvDtype {
        match self {
            KvBuffer::F32(_) => KvDtype::F32,
            KvBuffer::F16(_) => KvDtype::F16,
            KvBuffer::Bf16(_) => KvDtype::Bf16,
        }
    }
}

/// K and V buffers for every layer.
pub struct KvCache {
    shape: KvShape,
    dtype: KvDtype,
    keys: Vec<KvBuffer>,
    values: Vec<KvBuffer>,
}

impl KvCache {
    /// A zero-filled cache. Refuses a shape whose sizes overflow, and returns the allocation
    /// failure (never aborts) when memory cannot be had.
    pub fn new(shape: KvShape, dtype: KvDtype) -> Result<Self> {
        shape.validate(dtype)?;
        let len = shape.num_blocks * shape.block_elems();
        let make = || -> Result<Vec<KvBuffer>> {
            // Reserved fallibly too: many layers of tiny blocks pass the byte bound above.
            let mut layers = Vec::new();
            layers
                .try_reserve_exact(shape.num_layers)
                .map_err(|_| Error::OutOfMemory(format!("{} KV cache layers", shape.num_layers)))?;
            for _ in 0..shape.num_layers {
                layers.push(KvBuffer::zeroed(dtype, len)?);
            }
            Ok(layers)
        };
        Ok(KvCache {
            shape,
            dtype,
            keys: make()?,
            values: make()?,
        })
    }

    /// Dimensions.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Storage type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Bytes of K and V storage in all.
    pub fn nbytes(&self) -> usize {
        2 * self.shape.num_layers
            * self.shape.num_blocks
            * self.shape.block_elems()
            * self.dtype.size_of()
    }

    /// The K and V buffers of `layer`.
    pub fn layer(&self, layer: usize) -> Result<(&KvBuffer, &KvBuffer)> {
        self.check_layer(layer)?;
        Ok((&self.keys[layer], &self.values[layer]))
    }

    /// Stores rows `keys[i]`, `values[i]` (each `[num_kv_heads, head_dim]`, f32) at `slots[i]` of
    /// `layer`. Every value must stay finite in the cache's dtype (see the module invariants).
    /// Nothing is written unless every argument is valid.
    pub fn write(
        &mut self,
        layer: usize,
        keys: &[f32],
        values: &[f32],
        slots: &[i64],
    ) -> Result<()> {
        self.check_layer(layer)?;
        let row = self.shape.row_elems();
        let expected = slots.len() * row;
        if keys.len() != expected || values.len() != expected {
            return Err(Error::Shape(format!(
                "{} slots need keys and values of {expected} elements, got {} and {}",
                slots.len(),
                keys.len(),
                values.len()
            )));
        }
        let num_slots = (self.shape.num_blocks * self.shape.block_size) as i64;
        if let Some(bad) = slots.iter().find(|&&s| s < 0 || s >= num_slots) {
            return Err(Error::InvalidArgument(format!(
                "slot {bad} outside 0..{num_slots}"
            )));
        }
        for (name, data) in [("keys", keys), ("values", values)] {
            self.check_storable(name, data)?;
        }
        let shape = self.shape;
        for (buffer, source) in [
            (&mut self.keys[layer], keys),
            (&mut self.values[layer], values),
        ] {
            with_kv_buffer!(buffer, buf => scatter_rows(buf, source, slots, &shape));
        }
        Ok(())
    }

    /// Copies whole blocks `src → dst` in every layer (copy-on-write ops, applied in order).
    pub fn copy_blocks(&mut self, ops: &[CopyOp]) -> Result<()> {
        let n = self.shape.num_blocks as u32;
        if let Some(op) = ops.iter().find(|op| op.src >= n || op.dst >= n) {
            return Err(Error::InvalidArgument(format!(
                "copy {} -> {} outside 0..{n}",
                op.src, op.dst
            )));
        }
        let block = self.shape.block_elems();
        for buffer in self.keys.iter_mut().chain(self.values.iter_mut()) {
            with_kv_buffer!(buffer, buf => for op in ops {
                let (src, dst) = (op.src as usize * block, op.dst as usize * block);
                buf.copy_within(src..src + block, dst);
            });
        }
        Ok(())
    }

    /// Reads back the first `num_tokens` K and V rows of a sequence through its block table
    /// (padding past the used entries is never read), as f32 `[num_tokens, num_kv_heads,
    /// head_dim]` each.
    pub fn gather(
        &self,
        layer: usize,
        block_table: &[i32],
        num_tokens: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check_layer(layer)?;
        let used = self
            .shape
            .used_blocks(block_table, num_tokens, || "the block table".into())?;
        let len = num_tokens
            .checked_mul(self.shape.row_elems())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{num_tokens} tokens overflow the output size"))
            })?;
        let read = |buffer: &KvBuffer| -> Result<Vec<f32>> {
            let mut out = alloc::try_zeroed_vec(len, "gathered K/V rows")?;
            with_kv_buffer!(buffer, buf => gather_rows(buf, used, &self.shape, &mut out));
            Ok(out)
        };
        Ok((read(&self.keys[layer])?, read(&self.values[layer])?))
    }

    /// Overwrites every K and V element with pseudo-random values in [-1, 1) from `seed`: gives
    /// benchmarks real data in every page (a fresh cache maps the shared zero page).
    pub fn fill_random(&mut self, seed: u64) {
        for (i, buffer) in self
            .keys
            .iter_mut()
            .chain(self.values.iter_mut())
            .enumerate()
        {
            let seed = seed.wrapping_add(i as u64);
            with_kv_buffer!(buffer, buf => memory::fill_random(buf, seed));
        }
    }

    /// Refuses `data` unless the cache's dtype stores each of its values as a finite number.
    fn check_storable(&self, name: &str, data: &[f32]) -> Result<()> {
        let (dtype, limit) = (self.dtype, self.dtype.overflow_threshold());
        // `abs() < limit` is false for NaN too. Whole chunks without an early exit vectorise (a
        // per-element `find` made the check cost twice the write); the culprit is looked up only
        // on failure.
        let storable = |chunk: &[f32]| chunk.iter().fold(true, |ok, &x| ok & (x.abs() < limit));
        if data.chunks(256).all(storable) {
            return Ok(());
        }
        match data.iter().find(|&&x| x.is_nan() || x.abs() >= limit) {
            None => Ok(()),
            Some(x) if x.is_finite() => Err(Error::InvalidArgument(format!(
                "{name} hold {x}, beyond the {} range ±{}: the cache would store infinity",
                dtype.name(),
                dtype.max_finite()
            ))),
            Some(x) => Err(Error::InvalidArgument(format!(
                "{name} contain {x}: the cache stores finite values only"
            ))),
        }
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        ensure(layer < self.shape.num_layers, || {
            format!("layer {layer} outside 0..{}", self.shape.num_layers)
        })
    }
}

fn scatter_rows<T: KvElement>(buf: &mut [T], rows: &[f32], slots: &[i64], shape: &KvShape) {
    let d = shape.head_dim;
    for (&slot, row) in slots.iter().zip(rows.chunks_exact(shape.row_elems())) {
        for (head, src) in row.chunks_exact(d).enumerate() {
            let at = shape.offset(slot as usize, head);
            for (dst, &x) in buf[at..at + d].iter_mut().zip(src) {
                *dst = T::from_f32(x);
            }
        }
    }
}

/// Writes the rows of `used` blocks' tokens, in order, into `out` (`out.len()` / `row_elems`
/// tokens).
fn gather_rows<T: KvElement>(buf: &[T], used: &[i32], shape: &KvShape, out: &mut [f32]) {
    let (bs, d) = (shape.block_size, shape.head_dim);
    for (position, row) in out.chunks_exact_mut(shape.row_elems()).enumerate() {
        let slot = used[position / bs] as usize * bs + position % bs;
        for (head, dst) in row.chunks_exact_mut(d).enumerate() {
            let at = shape.offset(slot, head);
            for (o, x) in dst.iter_mut().zip(&buf[at..at + d]) {
                *o = x.to_f32();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(num_layers: usize, num_blocks: usize, block_size: usize, heads: usize) -> KvShape {
        KvShape {
            num_layers,
            num_blocks,
            block_size,
            num_kv_heads: heads,
            head_dim: 8,
        }
    }

    #[test]
    fn sizes_that_overflow_or_exceed_int32_block_ids_are_refused() {
        for bad in [
            shape(1, 1, 4, 1 << 62),
            shape(1 << 40, 1 << 30, 1, 1),
            shape(1, MAX_NUM_BLOCKS + 1, 1, 1),
        ] {
            assert!(matches!(
                KvCache::new(bad, KvDtype::F16),
                Err(Error::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn gather_reads_only_the_used_entries_of_a_padded_table() {
        let mut cache = KvCache::new(shape(1, 4, 2, 1), KvDtype::F32).unwrap();
        let rows: Vec<f32> = (0..8 * 8).map(|x| x as f32).collect();
        cache
            .write(0, &rows, &rows, &(0..8).collect::<Vec<_>>())
            .unwrap();
        let (k, v) = cache.gather(0, &[3, 1, -1, i32::MIN], 3).unwrap();
        let expected: Vec<f32> = [6, 7, 2]
            .iter()
            .flat_map(|&s| s * 8..s * 8 + 8)
            .map(|x| x as f32)
            .collect();
        assert_eq!((k, v), (expected.clone(), expected));
        for bad in [&[3, -1][..], &[4, 0], &[3]] {
            assert!(matches!(
                cache.gather(0, bad, 3),
                Err(Error::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn values_the_dtype_stores_as_infinity_are_refused_like_infinity() {
        let mut cache = KvCache::new(shape(1, 1, 1, 1), KvDtype::F16).unwrap();
        let ok = [65504.0f32; 8];
        cache.write(0, &ok, &ok, &[0]).unwrap();
        for bad in [65520.0, -1e6, f32::INFINITY, f32::NAN] {
            let mut row = ok;
            row[5] = bad;
            assert!(cache.write(0, &ok, &row, &[0]).is_err());
            assert_eq!(cache.gather(0, &[0], 1).unwrap().1, ok.to_vec());
        }
    }
}
