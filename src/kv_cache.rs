//! Physical K and V storage of every layer, owned by Rust.
//!
//! Layout per layer and per K or V: `[num_blocks, num_kv_heads, block_size, head_dim]`, so the
//! `block_size × head_dim` tile of one (block, KV head) is contiguous and the attention loop reads
//! it sequentially. Token slot `s` is row `s % block_size` of block `s / block_size`.
//!
//! Invariant: each buffer holds exactly `num_blocks * block_elems()` elements of the cache's dtype.

use half::{bf16, f16};

use crate::block_manager::CopyOp;
use crate::dtype::{KvDtype, KvElement};
use crate::error::{ensure, Error, Result};
use crate::memory::zeroed_vec;

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

    fn validate(&self) -> Result<()> {
        let dims = [
            self.num_layers,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        ];
        ensure(dims.iter().all(|&d| d > 0), || {
            format!("every KV cache dimension must be positive: {self:?}")
        })
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
    fn zeroed(dtype: KvDtype, len: usize) -> Self {
        match dtype {
            KvDtype::F32 => KvBuffer::F32(zeroed_vec(len)),
            KvDtype::F16 => KvBuffer::F16(zeroed_vec(len)),
            KvDtype::Bf16 => KvBuffer::Bf16(zeroed_vec(len)),
        }
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
    /// A zero-filled cache.
    pub fn new(shape: KvShape, dtype: KvDtype) -> Result<Self> {
        shape.validate()?;
        let len = shape
            .num_blocks
            .checked_mul(shape.block_elems())
            .ok_or_else(|| Error::InvalidArgument(format!("KV cache of {shape:?} overflows")))?;
        let make = || {
            (0..shape.num_layers)
                .map(|_| KvBuffer::zeroed(dtype, len))
                .collect()
        };
        Ok(KvCache {
            shape,
            dtype,
            keys: make(),
            values: make(),
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

    /// Stores rows `keys[i]`, `values[i]` (each `[num_kv_heads, head_dim]`, f32, finite) at
    /// `slots[i]` of `layer`. Nothing is written unless every argument is valid.
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
        ensure(keys.iter().chain(values).all(|x| x.is_finite()), || {
            "keys or values contain NaN or infinity".into()
        })?;
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

    /// Reads back the first `num_tokens` K and V rows of a sequence through its block table, as
    /// f32 `[num_tokens, num_kv_heads, head_dim]` each.
    pub fn gather(
        &self,
        layer: usize,
        block_table: &[u32],
        num_tokens: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        self.check_layer(layer)?;
        let bs = self.shape.block_size;
        ensure(num_tokens <= block_table.len() * bs, || {
            format!(
                "{num_tokens} tokens do not fit {} blocks of {bs}",
                block_table.len()
            )
        })?;
        let used = &block_table[..num_tokens.div_ceil(bs)];
        if let Some(bad) = used.iter().find(|&&b| b as usize >= self.shape.num_blocks) {
            return Err(Error::InvalidArgument(format!(
                "block {bad} outside 0..{}",
                self.shape.num_blocks
            )));
        }
        let slots: Vec<usize> = (0..num_tokens)
            .map(|p| used[p / bs] as usize * bs + p % bs)
            .collect();
        let read = |buffer: &KvBuffer| with_kv_buffer!(buffer, buf => gather_rows(buf, &slots, &self.shape));
        Ok((read(&self.keys[layer]), read(&self.values[layer])))
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
            with_kv_buffer!(buffer, buf => crate::attention::fill_random_values(buf, seed));
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

fn gather_rows<T: KvElement>(buf: &[T], slots: &[usize], shape: &KvShape) -> Vec<f32> {
    let d = shape.head_dim;
    let mut out = Vec::with_capacity(slots.len() * shape.row_elems());
    for &slot in slots {
        for head in 0..shape.num_kv_heads {
            let at = shape.offset(slot, head);
            out.extend(buf[at..at + d].iter().map(|x| x.to_f32()));
        }
    }
    out
}
