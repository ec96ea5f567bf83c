//! The crate's vocabulary: ids of blocks, tokens and sequences, the copy a step asks for, and the
//! limit every block id obeys. Every module takes them from here (none reaches up to the crate
//! root).
//!
//! Invariants: a block id is below [`MAX_NUM_BLOCKS`], so it fits the int32 block tables the
//! scheduler hands out (padded with -1).

/// Index of a physical KV block.
pub type BlockId = u32;
/// A token id.
pub type TokenId = u32;
/// A sequence id in the block manager.
pub type SeqId = u64;

/// A K/V copy the model runner must perform before the next attention call: the whole block `src`
/// into block `dst` (copy-on-write of a shared partial block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    pub src: BlockId,
    pub dst: BlockId,
}

/// Most blocks a manager holds: block tables are int32 arrays padded with -1, so every block id
/// (`0..num_blocks`) must fit in an i32.
pub const MAX_NUM_BLOCKS: usize = i32::MAX as usize;
