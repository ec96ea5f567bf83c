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
//! - A block table is read only in the entries of the tokens a reader needs
//!   ([`KvShape::used_blocks`]): at most its first `ceil(num_tokens / block_size)`, fewer when a
//!   sliding window starts past the first block. The rest (padding, -1 in the scheduler's tables;
//!   blocks wholly before a window) is never read.
//!
//! Sharing with a tier's I/O thread ([`KvBlockIo`], from [`KvCache::block_io`]). The buffers are
//! raw allocations ([`SharedBuf`]) behind an `Arc`, so the I/O thread can copy one block out
//! (offload) or in (load) while the engine thread writes and reads other blocks. Soundness rests on
//! three facts:
//! - Every write path forms `&mut` only over what it writes: one (row, head) run of `head_dim`
//!   elements in [`KvCache::write`], one block in [`KvCache::fill_random`], raw `ptr::copy` of one
//!   block in [`KvCache::copy_blocks`], one block's tiles in [`KvBlockIo::write_block`]. No `&mut`
//!   ever covers a whole layer buffer, so none overlaps a block another thread touches.
//! - The block an I/O job touches is touched by no other thread while the job runs. That is the
//!   protocol of [`crate::tier`], which the creator of the tier promises to follow (the
//!   `unsafe` of [`crate::tier::disk::DiskTier::open`]): a block being offloaded is in no table and not
//!   on the free list; the block of an in-flight load belongs to the I/O thread until its
//!   `LoadDone` is taken. The readers of the engine (attention, `gather`) hold a `&[T]` over a
//!   whole layer, but access only the blocks of the tables they are given, never such a block;
//!   two threads never access one location with one of them writing, so there is no data race.
//!   (Under Tree Borrows, the model Miri checks, a shared reference's permission applies only to
//!   the locations it has accessed, so the I/O thread's writes elsewhere do not conflict with it.)
//! - Each hand-over orders the accesses. The engine's last write of a block happens before the
//!   manager queues its offload (the job crosses a channel); the I/O thread's copy-out happens
//!   before it pushes the block on the free list (a `Release` exchange), which happens before the
//!   scheduler's `Acquire` pop, which happens before the block's next write. A load's write
//!   happens before its `LoadDone` is published under the tier's mutex, which the scheduler takes
//!   before the sequence runs.

use std::mem::ManuallyDrop;
use std::ops::{Deref, Range};
use std::ptr::NonNull;
use std::sync::Arc;

use half::{bf16, f16};

use super::buffer;
use crate::alloc;
use crate::error::{ensure, Error, Result};
use crate::ids::BlockId;
use crate::ids::{CopyOp, MAX_NUM_BLOCKS};
use crate::store::dtype::{KvDtype, KvElement};

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

    /// Bytes of one block in every layer, as a tier stores it: for each layer, the block's K tile
    /// then its V tile (`[num_kv_heads, block_size, head_dim]` each, in `dtype`, native byte
    /// order).
    pub fn slot_bytes(&self, dtype: KvDtype) -> usize {
        self.num_layers * 2 * self.block_elems() * dtype.size_of()
    }

    /// Offset of (slot, head) in a layer buffer.
    pub fn offset(&self, slot: usize, head: usize) -> usize {
        self.part(PagePart::WHOLE).offset(slot, head)
    }

    /// The shape `part` of every block sees: blocks of `block_size / part.of` tokens (the
    /// `num_blocks` pages, each carved). `InvalidArgument` unless `part.of` divides the block
    /// size and `part.index < part.of`.
    pub fn carved(&self, part: PagePart) -> Result<KvShape> {
        ensure(
            part.index < part.of && self.block_size.is_multiple_of(part.of),
            || {
                format!(
                    "part {} of {} of a {}-token block: the parts must divide it",
                    part.index, part.of, self.block_size
                )
            },
        )?;
        Ok(KvShape {
            block_size: self.block_size / part.of,
            ..*self
        })
    }

    /// How `part` of every block of a layer buffer is addressed (`part` valid for this shape).
    pub fn part(&self, part: PagePart) -> PartAddress {
        let block_elems = self.block_elems();
        PartAddress {
            block_size: self.block_size / part.of,
            page_elems: block_elems,
            base: part.index * block_elems / part.of,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
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

    /// The entries of `table` that hold tokens `tokens` of a sequence (`tokens.end` its length),
    /// each checked to be a block of this cache. Entries before them (blocks wholly before a
    /// sliding window, which may be released) and past them (padding) are never read. `owner`
    /// names the table in errors (e.g. "sequence 3").
    pub fn used_blocks<'t>(
        &self,
        table: &'t [i32],
        tokens: Range<usize>,
        owner: impl Fn() -> String,
    ) -> Result<&'t [i32]> {
        let bs = self.block_size;
        let end = tokens.end.div_ceil(bs);
        ensure(end <= table.len(), || {
            format!(
                "{}: {} tokens do not fit {} blocks of {bs}",
                owner(),
                tokens.end,
                table.len()
            )
        })?;
        let used = &table[(tokens.start / bs).min(end)..end];
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

/// One part of every block of a store layer (`crate::kv::spec`: a KV cache group carving its
/// pages): the `index`-th of `of` equal parts, `[num_kv_heads, block_size / of, head_dim]` each,
/// holding one model layer's K (or V) in blocks of `block_size / of` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagePart {
    pub index: usize,
    pub of: usize,
}

impl PagePart {
    /// The whole block (a layer not carved).
    pub const WHOLE: PagePart = PagePart { index: 0, of: 1 };
}

/// A store layer, or one part of each of its blocks: what a reader addresses (a bare layer
/// number is the whole of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerPart {
    pub layer: usize,
    pub part: PagePart,
}

impl From<usize> for LayerPart {
    fn from(layer: usize) -> Self {
        LayerPart {
            layer,
            part: PagePart::WHOLE,
        }
    }
}

/// Where (slot, head) of one [`PagePart`] lies in a layer buffer: slot `s` is row
/// `s % block_size` of block `s / block_size`, blocks `page_elems` apart, the part `base`
/// elements into its page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartAddress {
    pub block_size: usize,
    pub page_elems: usize,
    pub base: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl PartAddress {
    /// Offset of (slot, head) in the layer buffer.
    pub fn offset(&self, slot: usize, head: usize) -> usize {
        let (block, row) = (slot / self.block_size, slot % self.block_size);
        block * self.page_elems + self.base + (head * self.block_size + row) * self.head_dim
    }
}

/// A fixed-length buffer of `T` that the engine and a tier's I/O thread share (see the module
/// doc): reads through `Deref`, writes only through the `unsafe` methods, each over a range the
/// caller has to itself.
pub struct SharedBuf<T> {
    ptr: NonNull<T>,
    len: usize,
    capacity: usize,
}

// SAFETY: the buffer owns its elements like a `Vec` (sent with it), and shared use is governed by
// the contracts of the `unsafe` write methods, the only way to mutate through `&SharedBuf`.
unsafe impl<T: Send> Send for SharedBuf<T> {}
// SAFETY: as above; `T: Sync` for the shared reads of `Deref`.
unsafe impl<T: Send + Sync> Sync for SharedBuf<T> {}

impl<T> Drop for SharedBuf<T> {
    fn drop(&mut self) {
        // SAFETY: the parts are those of the `Vec` `from_vec` took apart, never freed before.
        drop(unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, self.capacity) });
    }
}

impl<T> Deref for SharedBuf<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` holds `len` initialised elements for the buffer's life.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: bytemuck::Pod> SharedBuf<T> {
    fn from_vec(values: Vec<T>) -> Self {
        let mut values = ManuallyDrop::new(values);
        SharedBuf {
            ptr: NonNull::from(values.as_mut_slice()).cast(),
            len: values.len(),
            capacity: values.capacity(),
        }
    }

    /// Runs `f` on the elements of `range` (panics if it is out of bounds).
    ///
    /// # Safety
    /// No other thread accesses an element of `range` during the call, and no reference into the
    /// buffer made by this thread accesses one either.
    unsafe fn write_with<R>(&self, range: Range<usize>, f: impl FnOnce(&mut [T]) -> R) -> R {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: in bounds (checked); exclusive for the call by the caller's contract.
        f(unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(range.start), range.len())
        })
    }

    /// Copies elements `src..src + len` over `dst..dst + len` (the ranges may overlap).
    ///
    /// # Safety
    /// No other thread writes the source, or accesses the destination, during the call.
    unsafe fn copy_within(&self, src: usize, dst: usize, len: usize) {
        assert!(src.max(dst) <= self.len && len <= self.len - src.max(dst));
        let base = self.ptr.as_ptr();
        // SAFETY: both ranges are in bounds (checked); `ptr::copy` allows overlap.
        unsafe { std::ptr::copy(base.add(src), base.add(dst), len) }
    }

    /// Copies the bytes of elements `start..start + out.len() / size_of::<T>()` into `out`
    /// (panics unless `out` is a whole number of elements in bounds).
    fn read_bytes(&self, start: usize, out: &mut [u8]) {
        let len = out.len() / std::mem::size_of::<T>();
        out.copy_from_slice(bytemuck::cast_slice(&self[start..start + len]));
    }

    /// Overwrites elements from `start` with `bytes` (a whole number of elements, in bounds).
    ///
    /// # Safety
    /// As [`SharedBuf::write_with`] over the elements written.
    unsafe fn write_bytes(&self, start: usize, bytes: &[u8]) {
        let len = bytes.len() / std::mem::size_of::<T>();
        // SAFETY: forwarded; every bit pattern is a valid `T: Pod`.
        unsafe {
            self.write_with(start..start + len, |dst| {
                bytemuck::cast_slice_mut::<T, u8>(dst).copy_from_slice(bytes)
            })
        }
    }
}

impl<T> std::fmt::Debug for SharedBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the elements: reading them all could race with a tier's I/O thread.
        write!(f, "SharedBuf({} elements)", self.len)
    }
}

/// One layer's K or V buffer in its storage type.
#[derive(Debug)]
pub enum KvBuffer {
    F32(SharedBuf<f32>),
    F16(SharedBuf<f16>),
    Bf16(SharedBuf<bf16>),
}

/// Runs `$body` with `$buf` bound to the typed [`SharedBuf`] inside a `KvBuffer`.
#[macro_export]
macro_rules! with_kv_buffer {
    ($buffer:expr, $buf:ident => $body:expr) => {
        match $buffer {
            $crate::store::kv_cache::KvBuffer::F32($buf) => $body,
            $crate::store::kv_cache::KvBuffer::F16($buf) => $body,
            $crate::store::kv_cache::KvBuffer::Bf16($buf) => $body,
        }
    };
}

impl KvBuffer {
    fn zeroed(dtype: KvDtype, len: usize) -> Result<Self> {
        const WHAT: &str = "a KV cache layer";
        Ok(match dtype {
            KvDtype::F32 => KvBuffer::F32(SharedBuf::from_vec(buffer::zeroed_vec(len, WHAT)?)),
            KvDtype::F16 => KvBuffer::F16(SharedBuf::from_vec(buffer::zeroed_vec(len, WHAT)?)),
            KvDtype::Bf16 => KvBuffer::Bf16(SharedBuf::from_vec(buffer::zeroed_vec(len, WHAT)?)),
        })
    }

    /// `len` pseudo-random elements in [-1, 1) from `seed`, every page touched.
    pub(crate) fn random(dtype: KvDtype, len: usize, seed: u64, what: &str) -> Result<Self> {
        Ok(match dtype {
            KvDtype::F32 => {
                KvBuffer::F32(SharedBuf::from_vec(buffer::random_vec(len, seed, what)?))
            }
            KvDtype::F16 => {
                KvBuffer::F16(SharedBuf::from_vec(buffer::random_vec(len, seed, what)?))
            }
            KvDtype::Bf16 => {
                KvBuffer::Bf16(SharedBuf::from_vec(buffer::random_vec(len, seed, what)?))
            }
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

/// The K and V buffers of every layer, shared by a cache and its block handles.
struct Layers {
    keys: Vec<KvBuffer>,
    values: Vec<KvBuffer>,
}

impl Layers {
    /// Each layer's K then V buffer: the order of a block's tiles in a tier's slot.
    fn tiles(&self) -> impl Iterator<Item = &KvBuffer> {
        self.keys.iter().zip(&self.values).flat_map(|(k, v)| [k, v])
    }
}

/// K and V buffers for every layer.
pub struct KvCache {
    shape: KvShape,
    dtype: KvDtype,
    layers: Arc<Layers>,
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
        let layers = Layers {
            keys: make()?,
            values: make()?,
        };
        Ok(KvCache {
            shape,
            dtype,
            layers: Arc::new(layers),
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
        self.shape.num_blocks * self.slot_bytes()
    }

    /// Bytes of one block across every layer: the size of a tier's slot ([`KvShape::slot_bytes`]).
    pub fn slot_bytes(&self) -> usize {
        self.shape.slot_bytes(self.dtype)
    }

    /// A handle copying whole blocks out of and into this cache's storage from another thread
    /// (a tier's I/O thread); see the module doc.
    pub fn block_io(&self) -> KvBlockIo {
        KvBlockIo {
            shape: self.shape,
            dtype: self.dtype,
            layers: Arc::clone(&self.layers),
        }
    }

    /// The K and V buffers of `layer`.
    pub fn layer(&self, layer: usize) -> Result<(&KvBuffer, &KvBuffer)> {
        self.check_layer(layer)?;
        Ok((&self.layers.keys[layer], &self.layers.values[layer]))
    }

    /// Stores rows `keys[i]`, `values[i]` (each `[num_kv_heads, head_dim]`, f32) at `slots[i]` of
    /// `layer` (or of one part of each of its blocks, whose slots count blocks of
    /// `block_size / part.of` tokens). Every value must stay finite in the cache's dtype (see the
    /// module invariants). Nothing is written unless every argument is valid.
    pub fn write(
        &mut self,
        layer: impl Into<LayerPart>,
        keys: &[f32],
        values: &[f32],
        slots: &[i64],
    ) -> Result<()> {
        let LayerPart { layer, part } = layer.into();
        self.check_layer(layer)?;
        let carved = self.shape.carved(part)?;
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
        let num_slots = (carved.num_blocks * carved.block_size) as i64;
        if let Some(bad) = slots.iter().find(|&&s| s < 0 || s >= num_slots) {
            return Err(Error::InvalidArgument(format!(
                "slot {bad} outside 0..{num_slots}"
            )));
        }
        for (name, data) in [("keys", keys), ("values", values)] {
            self.check_storable(name, data)?;
        }
        let address = self.shape.part(part);
        for (buffer, source) in [
            (&self.layers.keys[layer], keys),
            (&self.layers.values[layer], values),
        ] {
            // SAFETY: the engine writes only blocks of its tables, never one a tier's job holds
            // (module doc), and `&mut self` keeps every other engine access out.
            with_kv_buffer!(buffer, buf => unsafe { scatter_rows(buf, source, slots, &address) });
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
        for buffer in self.layers.tiles() {
            with_kv_buffer!(buffer, buf => for op in ops {
                let (src, dst) = (op.src as usize * block, op.dst as usize * block);
                // SAFETY: both blocks belong to the engine's tables (as in `write`).
                unsafe { buf.copy_within(src, dst, block) };
            });
        }
        Ok(())
    }

    /// Reads back the first `num_tokens` K and V rows of a sequence through its block table of
    /// `layer` (or of one part of each of its blocks), padding past the used entries never read,
    /// as f32 `[num_tokens, num_kv_heads, head_dim]` each.
    pub fn gather(
        &self,
        layer: impl Into<LayerPart>,
        block_table: &[i32],
        num_tokens: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let LayerPart { layer, part } = layer.into();
        self.check_layer(layer)?;
        let address = self.shape.part(part);
        let used = self
            .shape
            .carved(part)?
            .used_blocks(block_table, 0..num_tokens, || "the block table".into())?;
        let len = num_tokens
            .checked_mul(self.shape.row_elems())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{num_tokens} tokens overflow the output size"))
            })?;
        let read = |buffer: &KvBuffer| -> Result<Vec<f32>> {
            let mut out = alloc::try_zeroed_vec(len, "gathered K/V rows")?;
            with_kv_buffer!(buffer, buf => gather_rows(buf, used, &address, &mut out));
            Ok(out)
        };
        Ok((
            read(&self.layers.keys[layer])?,
            read(&self.layers.values[layer])?,
        ))
    }

    /// Overwrites every K and V element with pseudo-random values in [-1, 1) from `seed`: gives
    /// benchmarks real data in every page (a fresh cache maps the shared zero page). Each block
    /// of each buffer gets its own seed, so no write spans more than one block.
    pub fn fill_random(&mut self, seed: u64) {
        let (blocks, block) = (self.shape.num_blocks, self.shape.block_elems());
        for (i, buffer) in self.layers.tiles().enumerate() {
            for b in 0..blocks {
                let seed = seed.wrapping_add((i * blocks + b) as u64);
                let range = b * block..(b + 1) * block;
                // SAFETY: as in `write`.
                with_kv_buffer!(buffer, buf => unsafe {
                    buf.write_with(range, |values| buffer::fill_random(values, seed))
                });
            }
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

/// Whole-block access to a cache's storage for a tier's I/O thread: a block's bytes in the slot
/// layout of [`KvShape::slot_bytes`]. Cheap to clone; keeps the storage alive.
#[derive(Clone)]
pub struct KvBlockIo {
    shape: KvShape,
    dtype: KvDtype,
    layers: Arc<Layers>,
}

impl KvBlockIo {
    /// Dimensions of the cache.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Storage type of the cache.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Bytes of one block (`read_block` / `write_block` buffers).
    pub fn slot_bytes(&self) -> usize {
        self.shape.slot_bytes(self.dtype)
    }

    /// Copies block `block` of every layer into `out` (`slot_bytes` long).
    ///
    /// # Safety
    /// No thread writes `block` during the call (an offloading block: see the module doc).
    pub unsafe fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<()> {
        let tile = self.check_block(block, out.len())?;
        let start = block as usize * self.shape.block_elems();
        for (buffer, out) in self.layers.tiles().zip(out.chunks_exact_mut(tile)) {
            with_kv_buffer!(buffer, buf => buf.read_bytes(start, out));
        }
        Ok(())
    }

    /// Overwrites block `block` of every layer with `bytes` (`slot_bytes` long), which must be an
    /// image `read_block` produced for a cache of this shape and dtype (so every value is finite,
    /// as the module invariants require; a tier checks its checksum before writing).
    ///
    /// # Safety
    /// No other thread accesses `block` during the call (the block of an in-flight load).
    pub unsafe fn write_block(&self, block: BlockId, bytes: &[u8]) -> Result<()> {
        let tile = self.check_block(block, bytes.len())?;
        let start = block as usize * self.shape.block_elems();
        for (buffer, bytes) in self.layers.tiles().zip(bytes.chunks_exact(tile)) {
            // SAFETY: forwarded from the caller.
            with_kv_buffer!(buffer, buf => unsafe { buf.write_bytes(start, bytes) });
        }
        Ok(())
    }

    /// Checks `block` and a buffer of `len` bytes; returns the bytes of one tile.
    fn check_block(&self, block: BlockId, len: usize) -> Result<usize> {
        ensure((block as usize) < self.shape.num_blocks, || {
            format!("block {block} outside 0..{}", self.shape.num_blocks)
        })?;
        if len != self.slot_bytes() {
            return Err(Error::Shape(format!(
                "a block is {} bytes, got a buffer of {len}",
                self.slot_bytes()
            )));
        }
        Ok(self.shape.block_elems() * self.dtype.size_of())
    }
}

/// Writes `rows` at `slots`, one `&mut` per (row, head) run.
///
/// # Safety
/// No other thread accesses the rows of `slots` during the call.
unsafe fn scatter_rows<T: KvElement>(
    buf: &SharedBuf<T>,
    rows: &[f32],
    slots: &[i64],
    shape: &PartAddress,
) {
    let d = shape.head_dim;
    for (&slot, row) in slots.iter().zip(rows.chunks_exact(shape.num_kv_heads * d)) {
        for (head, src) in row.chunks_exact(d).enumerate() {
            let at = shape.offset(slot as usize, head);
            // SAFETY: forwarded from the caller.
            unsafe {
                buf.write_with(at..at + d, |dst| {
                    for (dst, &x) in dst.iter_mut().zip(src) {
                        *dst = T::from_f32(x);
                    }
                })
            };
        }
    }
}

/// Writes the rows of `used` blocks' tokens, in order, into `out` (`out.len()` / `row_elems`
/// tokens).
fn gather_rows<T: KvElement>(buf: &[T], used: &[i32], shape: &PartAddress, out: &mut [f32]) {
    let (bs, d) = (shape.block_size, shape.head_dim);
    for (position, row) in out.chunks_exact_mut(shape.num_kv_heads * d).enumerate() {
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
    fn the_parts_of_a_carved_layer_hold_their_own_rows_at_the_same_slots() {
        // Blocks of 4 tokens carved into 2 parts of 2: each part numbers its own 2-token slots.
        let mut cache = KvCache::new(shape(1, 4, 4, 2), KvDtype::F32).unwrap();
        let halves = [0, 1].map(|index| LayerPart {
            layer: 0,
            part: PagePart { index, of: 2 },
        });
        let rows = |base: f32| -> Vec<f32> { (0..4 * 16).map(|i| base + i as f32).collect() };
        let slots = [0, 1, 6, 7]; // blocks 0 and 3 of each part
        for (k, &half) in halves.iter().enumerate() {
            let base = 1000.0 * (k + 1) as f32;
            cache
                .write(half, &rows(base), &rows(-base), &slots)
                .unwrap();
        }
        for (k, &half) in halves.iter().enumerate() {
            let base = 1000.0 * (k + 1) as f32;
            let (keys, values) = cache.gather(half, &[0, 3], 4).unwrap();
            assert_eq!((keys, values), (rows(base), rows(-base)), "part {k}");
        }
        // A part has 4 blocks of 2 slots; an uneven carving is refused, nothing written.
        let refused = cache.write(halves[0], &rows(0.0)[..16], &rows(0.0)[..16], &[8]);
        assert!(matches!(refused, Err(Error::InvalidArgument(_))));
        let uneven = LayerPart {
            layer: 0,
            part: PagePart { index: 0, of: 3 },
        };
        assert!(cache.gather(uneven, &[0], 1).is_err());
        assert_eq!(cache.gather(halves[1], &[0, 3], 4).unwrap().0, rows(2000.0));
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
