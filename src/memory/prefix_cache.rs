//! Content addressing of full blocks for prefix sharing.
//!
//! A full block's hash chains its parent's: `H(parent, tokens)`, with the chain's root derived from
//! an optional cache salt (so tenants or adapters never share blocks). Equal hashes therefore mean
//! equal whole prefixes, not just equal blocks. The hash is 128-bit xxh3: with at most 2^32 blocks
//! ever registered the chance of any collision is below 2^-64, which is the guard against a wrong
//! hit (the alternative, comparing stored tokens on every hit, costs a copy of every cached block's
//! tokens).
//!
//! Invariant: the map holds at most one block per hash, and a block is in the map iff the pool has
//! recorded that hash for it.

use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::error::{ensure, Result};
use crate::ids::{BlockId, TokenId};

/// 128-bit content hash of a whole prefix ending at a block boundary.
pub type BlockHash = u128;

/// A full block as the prefix cache names it: its hash, its parent's (the chain root for a first
/// block) and its tokens — the one key every hand-off carries (the pool's events, the tier's jobs,
/// a load in flight), its tokens shared, never copied, from one holder to the next.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BlockKey {
    pub hash: BlockHash,
    pub parent: BlockHash,
    pub tokens: Arc<[TokenId]>,
}

/// The root of a hash chain: the salt's hash, or a fixed value without salt.
pub fn root_hash(salt: Option<&[u8]>) -> BlockHash {
    match salt {
        None => 0,
        Some(bytes) => xxhash_rust::xxh3::xxh3_128_with_seed(bytes, 0x5a17),
    }
}

/// Hash of a full block given its parent's hash. Hashes outlive the process (the disk tier's
/// index keeps them across restarts) and cross it (KV events to a router, which hashes prompts
/// with [`salted_block_hashes`]), so the bytes hashed are little-endian on every machine: the
/// parent's and each token's.
pub fn chain_hash(parent: BlockHash, tokens: &[TokenId]) -> BlockHash {
    let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
    hasher.update(&parent.to_le_bytes());
    if cfg!(target_endian = "little") {
        hasher.update(bytemuck::cast_slice(tokens)); // already little-endian: no copy
    } else {
        for token in tokens {
            hasher.update(&token.to_le_bytes());
        }
    }
    hasher.digest128()
}

/// Hashes of every full block of `tokens`, in order.
pub fn block_hashes(root: BlockHash, tokens: &[TokenId], block_size: usize) -> Vec<BlockHash> {
    let mut hashes = Vec::with_capacity(tokens.len() / block_size);
    extend_block_hashes(root, &mut hashes, tokens, block_size);
    hashes
}

/// Hashes of every full block of `tokens` under cache salt `salt`, exactly as the block manager
/// computes them (a router hashes prompts with this to find the replica holding them). Fails with
/// `InvalidArgument` unless `block_size` is positive.
pub fn salted_block_hashes(
    tokens: &[TokenId],
    block_size: usize,
    salt: Option<&[u8]>,
) -> Result<Vec<BlockHash>> {
    ensure(block_size > 0, || "block_size must be positive".into())?;
    Ok(block_hashes(root_hash(salt), tokens, block_size))
}

/// Extends `hashes`, the hashes of the leading full blocks of `tokens`, to every full block of
/// `tokens` (hashing only the blocks not yet covered).
pub fn extend_block_hashes(
    root: BlockHash,
    hashes: &mut Vec<BlockHash>,
    tokens: &[TokenId],
    block_size: usize,
) {
    let mut parent = hashes.last().copied().unwrap_or(root);
    for block in tokens.chunks_exact(block_size).skip(hashes.len()) {
        parent = chain_hash(parent, block);
        hashes.push(parent);
    }
}

/// Map from prefix hash to the block holding that prefix's last block of K/V.
#[derive(Debug, Default, Clone)]
pub struct PrefixCache {
    /// The keys are already uniform 128-bit hashes: a cheap multiplicative hash is enough.
    blocks: FxHashMap<BlockHash, BlockId>,
}

impl PrefixCache {
    /// The block registered for `hash`, if any.
    pub fn get(&self, hash: BlockHash) -> Option<BlockId> {
        self.blocks.get(&hash).copied()
    }

    /// Registers `block` for `hash` unless another block already holds it; returns whether it did.
    pub fn insert(&mut self, hash: BlockHash, block: BlockId) -> bool {
        match self.blocks.entry(hash) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(block);
                true
            }
        }
    }

    /// Forgets `hash`.
    pub fn remove(&mut self, hash: BlockHash) {
        self.blocks.remove(&hash);
    }

    /// Every registered hash, in no order.
    pub fn hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.blocks.keys().copied()
    }

    /// Every registered (hash, block), in no order.
    pub fn entries(&self) -> impl Iterator<Item = (BlockHash, BlockId)> + '_ {
        self.blocks.iter().map(|(&hash, &block)| (hash, block))
    }

    /// Number of registered blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_the_whole_prefix_and_the_salt() {
        let a = block_hashes(root_hash(None), &[1, 2, 3, 4, 5, 6, 7, 8], 4);
        let b = block_hashes(root_hash(None), &[9, 2, 3, 4, 5, 6, 7, 8], 4);
        assert_eq!(a.len(), 2);
        assert_ne!(
            a[1], b[1],
            "same second block after different first blocks must differ"
        );
        let salted = block_hashes(root_hash(Some(b"tenant")), &[1, 2, 3, 4], 4);
        assert_ne!(a[0], salted[0]);
        assert!(block_hashes(root_hash(None), &[1, 2, 3], 4).is_empty());
    }

    #[test]
    fn extending_hashes_matches_hashing_at_once() {
        let tokens: Vec<TokenId> = (0..23).collect();
        let mut hashes = block_hashes(7, &tokens[..9], 4);
        assert_eq!(hashes.len(), 2);
        extend_block_hashes(7, &mut hashes, &tokens, 4);
        assert_eq!(hashes, block_hashes(7, &tokens, 4));
    }

    #[test]
    fn first_registration_wins() {
        let mut cache = PrefixCache::default();
        assert!(cache.insert(7, 1));
        assert!(!cache.insert(7, 2));
        assert_eq!(cache.get(7), Some(1));
        cache.remove(7);
        assert!(cache.is_empty());
    }
}
