//! One sequence's block table: logical block i → physical block id, plus what is needed to keep
//! hashing its blocks as they fill.
//!
//! Invariants: `blocks.len() == ceil(tokens.len() / block_size)` (no empty trailing block);
//! `hashes.len() == tokens.len() / block_size` (one hash per full block, chained from `root`);
//! token `p` lives at slot `blocks[p / block_size] * block_size + p % block_size`, which fits an
//! i64 because `BlockManager::new` checks `num_blocks * block_size` does for its largest size.
//! `block_size` is the table's own: the tables of a KV cache group whose pages are carved into
//! smaller blocks (`crate::kv::spec`) count fewer tokens per block than the manager's default.
//!
//! A sliding window releases a table's leading blocks once no query will read them again: the
//! first `released` entries then hold [`RELEASED`] (an int32 table shows -1 there), the table
//! holds only `blocks[released..]`, and its tokens and hashes stay whole (the later blocks' hashes
//! chain through them). Released blocks are always a prefix: a window only moves forward.

use crate::ids::{BlockId, TokenId};
use crate::memory::prefix_cache::BlockHash;

/// The entry of a released block (module invariants): no block has this id
/// (`MAX_NUM_BLOCKS` is below it).
pub const RELEASED: BlockId = BlockId::MAX;

/// The blocks, tokens and full-block hashes of one sequence.
#[derive(Debug, Clone, Default)]
pub struct BlockTable {
    pub(crate) blocks: Vec<BlockId>,
    pub(crate) tokens: Vec<TokenId>,
    pub(crate) hashes: Vec<BlockHash>,
    pub(crate) root: BlockHash,
    /// Tokens per block (module invariants).
    pub(crate) block_size: usize,
    /// The KV cache group the table is in (its blocks' events name it).
    pub(crate) group: u32,
    /// Leading blocks released by a sliding window (module invariants).
    pub(crate) released: usize,
}

impl BlockTable {
    /// Physical block ids in logical order, [`RELEASED`] for the leading blocks a window released.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// The blocks the table holds: every block after the released ones.
    pub fn held(&self) -> &[BlockId] {
        &self.blocks[self.released..]
    }

    /// Leading blocks a sliding window has released.
    pub fn num_released(&self) -> usize {
        self.released
    }

    /// Tokens per block of this table.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Releases the blocks wholly before token position `first_needed` (those not released yet)
    /// and returns them, in order; their entries become [`RELEASED`]. A block holding a token at
    /// or after `first_needed` is kept, and so is the partly filled tail whatever `first_needed`
    /// says (a later append writes into it).
    pub(crate) fn release_before(&mut self, first_needed: usize) -> Vec<BlockId> {
        let upto = first_needed.min(self.tokens.len()) / self.block_size;
        let start = self.released.min(upto);
        let gone = self.blocks[start..upto].to_vec();
        self.blocks[start..upto].fill(RELEASED);
        self.released = self.released.max(upto);
        gone
    }

    /// Token ids whose K/V this table holds (or will hold once the step that wrote them runs).
    pub fn tokens(&self) -> &[TokenId] {
        &self.tokens
    }

    /// The block ids as entries of an int32 block-table array (where -1 pads). They fit:
    /// `BlockManager::new` bounds `num_blocks` by `MAX_NUM_BLOCKS`.
    pub fn entries(&self) -> impl Iterator<Item = i32> + '_ {
        self.blocks.iter().map(|&b| {
            if b == RELEASED {
                return -1;
            }
            debug_assert!(b <= i32::MAX as BlockId);
            b as i32
        })
    }

    /// Number of tokens with a slot.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Blocks to add so that `extra` more tokens have slots.
    pub fn blocks_to_grow(&self, extra: usize) -> usize {
        (self.tokens.len() + extra).div_ceil(self.block_size) - self.blocks.len()
    }

    /// The last block if it is partly filled (the only block a later append writes into).
    pub fn partial_tail(&self) -> Option<BlockId> {
        (!self.tokens.len().is_multiple_of(self.block_size))
            .then(|| *self.blocks.last().expect("tokens imply blocks"))
    }

    /// Cache slot of token position `position` (which must be below `num_tokens`).
    pub fn slot(&self, position: usize) -> i64 {
        let block_size = self.block_size;
        debug_assert!(
            position / block_size >= self.released,
            "a released block has no slots"
        );
        let block = self.blocks[position / block_size] as i64;
        block * block_size as i64 + (position % block_size) as i64
    }

    /// Appends the slots of token positions `start..end` to `out`.
    pub fn extend_slots(&self, start: usize, end: usize, out: &mut Vec<i64>) {
        let block_size = self.block_size;
        // One division per block touched rather than per token: prefill chunks are long.
        debug_assert!(
            start >= end || start / block_size >= self.released,
            "a released block has no slots"
        );
        let mut position = start;
        while position < end {
            let (index, offset) = (position / block_size, position % block_size);
            let run = (block_size - offset).min(end - position);
            let base = self.blocks[index] as i64 * block_size as i64 + offset as i64;
            out.extend(base..base + run as i64);
            position += run;
        }
    }
}
