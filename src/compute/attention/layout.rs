//! Where the K/V tile of (sequence, KV head, logical block) lives: through a block table (the
//! paged cache) or at a computed offset (contiguous K/V, the baseline paging is compared with).
//!
//! Invariants: a tile is `rows × head_dim` elements, rows contiguous with stride `head_dim`; both
//! layouts hand the same loop the same shape of tile, so a comparison between them measures the
//! layout and nothing else. Callers only ask for blocks that validation proved in range.

use crate::store::dtype::KvElement;
use crate::store::kv_cache::PartAddress;

/// Maps (sequence, KV head, logical block) to its K and V tiles.
pub(crate) trait KvLayout<T>: Sync {
    /// Tokens per tile.
    fn block_size(&self) -> usize;
    /// The K and V tiles (each at least `valid rows × head_dim` elements).
    fn tile(&self, seq: usize, kv_head: usize, block: usize) -> (&[T], &[T]);

    /// [`KvLayout::tile`] when `block < end`, else two empty slices (nothing to prefetch).
    #[inline]
    fn tile_or_empty(&self, seq: usize, kv_head: usize, block: usize, end: usize) -> (&[T], &[T]) {
        if block < end {
            self.tile(seq, kv_head, block)
        } else {
            (&[], &[])
        }
    }
}

/// The paged cache: layer buffers `[num_blocks, num_kv_heads, block_size, head_dim]` — or one
/// part of every block of them (`PagePart`: blocks `page_elems` apart, the part `base` elements
/// into each) — and block tables `[num_seqs, max_blocks_per_seq]`.
pub(crate) struct Paged<'a, T> {
    pub keys: &'a [T],
    pub values: &'a [T],
    pub block_tables: &'a [i32],
    pub max_blocks_per_seq: usize,
    pub address: PartAddress,
}

impl<T: KvElement> KvLayout<T> for Paged<'_, T> {
    fn block_size(&self) -> usize {
        self.address.block_size
    }

    #[inline]
    fn tile(&self, seq: usize, kv_head: usize, block: usize) -> (&[T], &[T]) {
        let physical = self.block_tables[seq * self.max_blocks_per_seq + block] as usize;
        let a = &self.address;
        let len = a.block_size * a.head_dim;
        let start = physical * a.page_elems + a.base + kv_head * len;
        (
            &self.keys[start..start + len],
            &self.values[start..start + len],
        )
    }
}

/// Contiguous K/V: `[num_seqs, num_kv_heads, max_context, head_dim]`, cut into tiles of
/// `block_size` rows.
pub(crate) struct Contiguous<'a, T> {
    pub keys: &'a [T],
    pub values: &'a [T],
    pub num_kv_heads: usize,
    pub max_context: usize,
    pub block_size: usize,
    pub head_dim: usize,
}

impl<T: KvElement> KvLayout<T> for Contiguous<'_, T> {
    fn block_size(&self) -> usize {
        self.block_size
    }

    #[inline]
    fn tile(&self, seq: usize, kv_head: usize, block: usize) -> (&[T], &[T]) {
        let first_row = block * self.block_size;
        let rows = self.block_size.min(self.max_context - first_row);
        let start =
            ((seq * self.num_kv_heads + kv_head) * self.max_context + first_row) * self.head_dim;
        let end = start + rows * self.head_dim;
        (&self.keys[start..end], &self.values[start..end])
    }
}
