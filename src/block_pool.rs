//! The pool of physical KV blocks: reference counts, the three block states, eviction.
//!
//! Every block is in exactly one state:
//! - free and clean: ref count 0, no hash, on the lock-free free list;
//! - free and cached: ref count 0, hashed, in the prefix map and in the evictable set;
//! - in use: ref count >= 1, held by that many block tables; hashed only if full.
//!
//! So `clean + evictable.len() + in_use == num_blocks` always (`clean` counts the free list). Allocation
//! takes a clean block first and evicts a cached block (the one the [`EvictionPolicy`] puts first)
//! only when none is clean; a released block with a hash becomes evictable, one without goes back
//! to the free list.

use crate::alloc::{try_vec_with, try_zeroed_vec};
use crate::error::Result as CoreResult;
use crate::free_list::FreeList;
use crate::lru::{Evictable, EvictionPolicy};
use crate::prefix_cache::{BlockHash, PrefixCache};
use crate::BlockId;

/// Counters of what the pool has done since it was made.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PoolCounters {
    /// Blocks handed out by `allocate` (clean or evicted).
    pub allocations: u64,
    /// Cached blocks evicted to satisfy an allocation.
    pub evictions: u64,
}

/// Physical blocks with reference counts, a free list, and the evictable set of cached blocks.
pub struct BlockPool {
    free: FreeList,
    evictable: Evictable,
    ref_counts: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    prefix: PrefixCache,
    clean: usize,
    in_use: usize,
    counters: PoolCounters,
}

impl BlockPool {
    /// A pool of `num_blocks` clean blocks evicting least recently used first.
    pub fn new(num_blocks: usize) -> CoreResult<Self> {
        Self::with_policy(num_blocks, EvictionPolicy::Lru)
    }

    /// A pool of `num_blocks` clean blocks evicting under `policy`. Fails with `OutOfMemory` if its
    /// arrays cannot be allocated (the largest first, so a refused size fails before anything is
    /// written), or `InvalidArgument` if ids would not fit in `u32`.
    pub fn with_policy(num_blocks: usize, policy: EvictionPolicy) -> CoreResult<Self> {
        let hashes = try_vec_with(num_blocks, "the block hashes", |_| None)?;
        Ok(BlockPool {
            ref_counts: try_zeroed_vec(num_blocks, "the block ref counts")?,
            evictable: Evictable::new(num_blocks, policy)?,
            free: FreeList::full(num_blocks)?,
            hashes,
            prefix: PrefixCache::default(),
            clean: num_blocks,
            in_use: 0,
            counters: PoolCounters::default(),
        })
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks that are free and clean.
    pub fn num_clean(&self) -> usize {
        self.clean
    }

    /// Blocks that are free but still hold a cached prefix.
    pub fn num_cached(&self) -> usize {
        self.evictable.len()
    }

    /// Blocks that some table holds.
    pub fn num_in_use(&self) -> usize {
        self.in_use
    }

    /// Blocks an allocation can obtain: clean plus evictable.
    pub fn num_available(&self) -> usize {
        self.clean + self.evictable.len()
    }

    /// Reference count of `block`.
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Whether `block` is cached and unreferenced (so reviving it uses up one available block).
    pub fn is_evictable(&self, block: BlockId) -> bool {
        self.evictable.contains(block)
    }

    /// The hash registered for `block`, if it holds a cached full block.
    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.hashes[block as usize]
    }

    /// The cached block holding the prefix that ends in `hash`.
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.prefix.get(hash)
    }

    /// What the pool has done so far.
    pub fn counters(&self) -> PoolCounters {
        self.counters
    }

    /// The eviction policy of the cached blocks.
    pub fn eviction_policy(&self) -> EvictionPolicy {
        self.evictable.policy()
    }

    /// Takes a block with ref count 1: a clean one if any, else the cached one the policy evicts.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let block = match self.free.pop() {
            Some(block) => {
                self.clean -= 1;
                block
            }
            None => {
                let block = self.evictable.pop()?;
                let hash = self.hashes[block as usize]
                    .take()
                    .expect("cached block has a hash");
                self.prefix.remove(hash);
                self.counters.evictions += 1;
                block
            }
        };
        self.ref_counts[block as usize] = 1;
        self.in_use += 1;
        self.counters.allocations += 1;
        Some(block)
    }

    /// `retain` of a cached block found by a prefix lookup: also records the hit for eviction.
    pub fn retain_hit(&mut self, block: BlockId) {
        self.evictable.mark_hit(block);
        self.retain(block);
    }

    /// Adds a reference to `block`, reviving it from the evictable set if it was cached and unreferenced.
    pub fn retain(&mut self, block: BlockId) {
        let count = &mut self.ref_counts[block as usize];
        if *count == 0 {
            let revived = self.evictable.remove(block);
            debug_assert!(revived, "retain of a clean free block {block}");
            self.in_use += 1;
        }
        *count += 1;
    }

    /// Drops a reference; at zero the block becomes cached (if hashed) or clean.
    pub fn release(&mut self, block: BlockId) {
        let count = &mut self.ref_counts[block as usize];
        debug_assert!(*count > 0, "release of unreferenced block {block}");
        *count -= 1;
        if *count == 0 {
            self.in_use -= 1;
            if self.hashes[block as usize].is_some() {
                self.evictable.push(block);
            } else {
                self.free.push(block);
                self.clean += 1;
            }
        }
    }

    /// Records that in-use `block` holds the full prefix `hash`, unless another block already does.
    pub fn register(&mut self, block: BlockId, hash: BlockHash) {
        debug_assert!(self.ref_counts[block as usize] > 0);
        if self.hashes[block as usize].is_none() && self.prefix.insert(hash, block) {
            self.hashes[block as usize] = Some(hash);
        }
    }

    /// Checks the state invariants of the module doc; `Err` names the first one broken.
    pub fn check_invariants(&self) -> Result<(), String> {
        let total = self.num_blocks();
        if self.clean + self.evictable.len() + self.in_use != total {
            return Err(format!(
                "free {} + cached {} + in use {} != total {}",
                self.clean,
                self.evictable.len(),
                self.in_use,
                total
            ));
        }
        let counted_in_use = self.ref_counts.iter().filter(|&&c| c > 0).count();
        if counted_in_use != self.in_use {
            return Err(format!(
                "{counted_in_use} blocks referenced, in_use says {}",
                self.in_use
            ));
        }
        for block in 0..total as BlockId {
            let (refs, hash) = (self.ref_counts[block as usize], self.hashes[block as usize]);
            if refs > 0 && self.evictable.contains(block) {
                return Err(format!("block {block} is referenced and evictable"));
            }
            if refs == 0 && self.evictable.contains(block) != hash.is_some() {
                return Err(format!(
                    "unreferenced block {block}: evictable iff hashed is broken"
                ));
            }
            if let Some(hash) = hash {
                if self.prefix.get(hash) != Some(block) {
                    return Err(format!(
                        "block {block} has a hash the prefix map does not point back to"
                    ));
                }
            }
        }
        let hashed = self.hashes.iter().filter(|h| h.is_some()).count();
        if hashed != self.prefix.len() {
            return Err(format!(
                "{hashed} hashed blocks but {} prefix entries",
                self.prefix.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_prefers_clean_blocks_and_evicts_lru_first() {
        let mut pool = BlockPool::new(3).unwrap();
        let blocks: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
        assert_eq!(pool.allocate(), None);
        pool.register(blocks[0], 100);
        pool.register(blocks[1], 101);
        pool.release(blocks[1]); // cached, older
        pool.release(blocks[0]); // cached, newer
        pool.release(blocks[2]); // clean
        assert_eq!(
            (pool.num_clean(), pool.num_cached(), pool.num_in_use()),
            (1, 2, 0)
        );
        assert_eq!(pool.allocate(), Some(blocks[2]), "clean block first");
        assert_eq!(
            pool.allocate(),
            Some(blocks[1]),
            "then the least recently used cached block"
        );
        assert_eq!(
            pool.lookup(101),
            None,
            "an evicted block leaves the prefix map"
        );
        assert_eq!(pool.lookup(100), Some(blocks[0]));
        assert_eq!(pool.counters().evictions, 1);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn retain_revives_a_cached_block() {
        let mut pool = BlockPool::new(2).unwrap();
        let block = pool.allocate().unwrap();
        pool.register(block, 5);
        pool.release(block);
        assert!(pool.is_evictable(block));
        pool.retain(block);
        assert_eq!(
            (pool.ref_count(block), pool.num_cached(), pool.num_in_use()),
            (1, 0, 1)
        );
        pool.retain(block);
        pool.release(block);
        assert_eq!(pool.ref_count(block), 1);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn a_second_block_with_the_same_hash_stays_unregistered() {
        let mut pool = BlockPool::new(2).unwrap();
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        pool.register(a, 9);
        pool.register(b, 9);
        assert_eq!(pool.hash_of(b), None);
        pool.release(b);
        assert_eq!(
            pool.num_clean(),
            1,
            "an unregistered duplicate goes back clean"
        );
        pool.check_invariants().unwrap();
    }
}
