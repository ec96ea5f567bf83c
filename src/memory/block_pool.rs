//! The pool of physical KV blocks: reference counts, the four block states, eviction, offload.
//!
//! Every block is in exactly one state:
//! - free and clean: ref count 0, no hash, on the lock-free free list;
//! - free and cached: ref count 0, hashed, in the prefix map and in the evictable set;
//! - in use: ref count >= 1, held by that many block tables (or by a load in flight); hashed only
//!   if full;
//! - offloading: ref count 0, no hash, handed to a lower tier ([`crate::tier`]) whose I/O thread
//!   copies it out and then pushes it onto the shared free list, counting it in
//!   [`TierLink::returned`].
//!
//! So `clean + evictable.len() + in_use + offloading == num_blocks` always, where `clean` counts
//! the free list as the pool last saw it and `offloading` the blocks handed out and not yet seen
//! back. The pool adds `returned` to `clean` (swapping it to 0) when it allocates; what it reports
//! reads `returned` without taking it. The tier pushes before it counts, so `clean` plus `returned`
//! never exceeds the list's real length, and an allocation that finds `clean > 0` always pops a
//! block. With the tier quiescent (every offloaded block returned), the list holds exactly the
//! clean blocks (`check_free_list`).
//!
//! Allocation takes a clean block first and evicts a cached block (the one the [`EvictionPolicy`]
//! puts first, its K/V dropped) only when none is clean; `start_offload` moves that same victim to
//! the offloading state instead. A released block with a hash becomes evictable, one without goes
//! back to the free list. With events on, registration records `BlockStored{Ram}` and eviction or
//! offload `BlockRemoved{Ram}`, so replaying them gives the prefix map's hashes.

use std::sync::Arc;

use crate::alloc::{try_vec_with, try_zeroed_vec};
use crate::error::Result as CoreResult;
use crate::ids::{BlockId, TokenId};
use crate::memory::events::{KvEvent, Medium};
use crate::memory::eviction::{Evictable, EvictionPolicy};
use crate::memory::free_list::FreeList;
use crate::memory::prefix_cache::{BlockHash, BlockKey, PrefixCache};
use crate::sync::{AtomicUsize, Ordering};
use crate::tier::{OffloadJob, TierLink};

/// Counters of what the pool has done since it was made.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PoolCounters {
    /// Blocks handed out by `allocate` (clean or evicted).
    pub allocations: u64,
    /// Cached blocks evicted (their K/V dropped) to satisfy an allocation.
    pub evictions: u64,
    /// Cached blocks handed to a tier by `start_offload`.
    pub offloads: u64,
}

/// The parent hash and tokens of each registered block, kept only when something needs them
/// (an offload job carries them): room for `block_size` tokens per block, flat, of which a block
/// of a KV cache group carving its pages (`crate::kv::spec`) fills its first `lens[block]`.
struct Content {
    block_size: usize,
    parents: Vec<BlockHash>,
    tokens: Vec<TokenId>,
    lens: Vec<u32>,
}

/// Physical blocks with reference counts, a free list, and the evictable set of cached blocks.
pub struct BlockPool {
    /// Shared with a tier's I/O thread, which pushes offloaded blocks back.
    free: Arc<FreeList>,
    /// Blocks the tier pushed that `clean` does not count yet.
    returned: Arc<AtomicUsize>,
    evictable: Evictable,
    ref_counts: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    /// The KV cache group of each registered block (what its events name).
    groups: Vec<u32>,
    prefix: PrefixCache,
    content: Option<Content>,
    /// `Some` when events are recorded.
    events: Option<Vec<KvEvent>>,
    clean: usize,
    in_use: usize,
    offloading: usize,
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
            free: Arc::new(FreeList::full(num_blocks)?),
            returned: Arc::new(AtomicUsize::new(0)),
            hashes,
            groups: try_zeroed_vec(num_blocks, "the block groups")?,
            prefix: PrefixCache::default(),
            content: None,
            events: None,
            clean: num_blocks,
            in_use: 0,
            offloading: 0,
            counters: PoolCounters::default(),
        })
    }

    /// What a tier needs to return offloaded blocks: the free list and the returned count.
    pub fn tier_link(&self) -> TierLink {
        TierLink {
            free: self.free.clone(),
            returned: self.returned.clone(),
        }
    }

    /// Keeps, from now on, each registered block's parent hash and `block_size` tokens, which
    /// `start_offload` needs (`OutOfMemory` if they cannot be allocated, changing nothing).
    pub fn keep_content(&mut self, block_size: usize) -> CoreResult<()> {
        if self.content.is_none() {
            let n = self.num_blocks();
            let tokens = try_zeroed_vec(n.saturating_mul(block_size), "the block tokens")?;
            self.content = Some(Content {
                block_size,
                parents: try_zeroed_vec(n, "the block parents")?,
                tokens,
                lens: try_zeroed_vec(n, "the block token counts")?,
            });
        }
        Ok(())
    }

    /// Records KV events from now on (see the module doc); `take_events` moves them out.
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// Moves the events recorded since the last call into `out`, in order.
    pub fn take_events(&mut self, out: &mut Vec<KvEvent>) {
        if let Some(events) = &mut self.events {
            out.append(events);
        }
    }

    /// Total number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks that are free and clean, counting those a tier returned since the pool last looked.
    pub fn num_clean(&self) -> usize {
        self.clean + self.returned_now()
    }

    /// Blocks that are free but still hold a cached prefix.
    pub fn num_cached(&self) -> usize {
        self.evictable.len()
    }

    /// Blocks that some table (or load) holds.
    pub fn num_in_use(&self) -> usize {
        self.in_use
    }

    /// Blocks handed to a tier and not yet returned.
    pub fn num_offloading(&self) -> usize {
        self.offloading - self.returned_now()
    }

    /// Blocks an allocation can obtain: clean plus evictable (not those still offloading).
    pub fn num_available(&self) -> usize {
        self.num_clean() + self.evictable.len()
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

    /// The hashes of every registered block (findable by prefix lookup), in no order.
    pub fn cached_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.prefix.hashes()
    }

    /// The hash and KV cache group of every registered block, in no order.
    pub fn cached_blocks(&self) -> impl Iterator<Item = (BlockHash, u32)> + '_ {
        (self.prefix.entries()).map(|(hash, block)| (hash, self.groups[block as usize]))
    }

    /// What the pool has done so far.
    pub fn counters(&self) -> PoolCounters {
        self.counters
    }

    /// The eviction policy of the cached blocks.
    pub fn eviction_policy(&self) -> EvictionPolicy {
        self.evictable.policy()
    }

    /// `returned` as read now, bounded by what is out (a tier cannot return more than it was given).
    fn returned_now(&self) -> usize {
        self.returned.load(Ordering::Acquire).min(self.offloading)
    }

    /// Counts the blocks a tier returned as clean. Acquire pairs with the tier's Release increment,
    /// which follows its push, so every block counted here is on the list.
    fn absorb_returned(&mut self) {
        if self.offloading > 0 {
            let returned = self.returned.swap(0, Ordering::Acquire);
            debug_assert!(
                returned <= self.offloading,
                "a tier returned more than it took"
            );
            self.offloading -= returned;
            self.clean += returned;
        }
    }

    /// Takes a block with ref count 1: a clean one if any (returned ones included), else the
    /// cached one the policy evicts, its K/V dropped.
    pub fn allocate(&mut self) -> Option<BlockId> {
        self.absorb_returned();
        let block = if self.clean > 0 {
            self.clean -= 1;
            self.free
                .pop()
                .expect("every counted clean block is on the free list")
        } else {
            let block = self.evictable.pop()?;
            self.unregister(block);
            self.counters.evictions += 1;
            block
        };
        self.ref_counts[block as usize] = 1;
        self.in_use += 1;
        self.counters.allocations += 1;
        Some(block)
    }

    /// Moves the cached block the policy evicts next out of the prefix map into the offloading
    /// state, returning its job for the tier (`None` if nothing is cached). Needs `keep_content`.
    pub fn start_offload(&mut self) -> Option<OffloadJob> {
        let block = self.evictable.pop()?;
        let hash = self.unregister(block);
        self.offloading += 1;
        self.counters.offloads += 1;
        let content = self.content.as_ref().expect("offload needs keep_content");
        let (at, len) = (
            block as usize * content.block_size,
            content.lens[block as usize] as usize,
        );
        Some(OffloadJob {
            block,
            key: BlockKey {
                hash,
                parent: content.parents[block as usize],
                tokens: content.tokens[at..][..len].into(),
            },
            group: self.groups[block as usize],
        })
    }

    /// Takes `block`'s hash out of the prefix map (recording the removal); returns it.
    fn unregister(&mut self, block: BlockId) -> BlockHash {
        let hash = self.hashes[block as usize]
            .take()
            .expect("cached block has a hash");
        self.prefix.remove(hash);
        if let Some(events) = &mut self.events {
            events.push(KvEvent::BlockRemoved {
                hash,
                medium: Medium::Ram,
                group: self.groups[block as usize],
            });
        }
        hash
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

    /// Records that in-use `block`, of KV cache group `group`, holds the full prefix `hash` (the
    /// block after `parent`, holding `tokens`), unless it already has a hash or another block
    /// holds `hash`. Returns whether it registered.
    pub fn register(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        parent: BlockHash,
        tokens: &[TokenId],
        group: u32,
    ) -> bool {
        debug_assert!(self.ref_counts[block as usize] > 0);
        if self.hashes[block as usize].is_some() || !self.prefix.insert(hash, block) {
            return false;
        }
        self.hashes[block as usize] = Some(hash);
        self.groups[block as usize] = group;
        if let Some(content) = &mut self.content {
            debug_assert!(tokens.len() <= content.block_size);
            let at = block as usize * content.block_size;
            content.parents[block as usize] = parent;
            content.tokens[at..][..tokens.len()].copy_from_slice(tokens);
            content.lens[block as usize] = tokens.len() as u32;
        }
        if let Some(events) = &mut self.events {
            let key = BlockKey {
                hash,
                parent,
                tokens: tokens.into(),
            };
            events.push(KvEvent::BlockStored {
                key,
                medium: Medium::Ram,
                group,
            });
        }
        true
    }

    /// Checks the state invariants of the module doc; `Err` names the first one broken.
    pub fn check_invariants(&self) -> Result<(), String> {
        let total = self.num_blocks();
        if self.clean + self.evictable.len() + self.in_use + self.offloading != total {
            return Err(format!(
                "free {} + cached {} + in use {} + offloading {} != total {}",
                self.clean,
                self.evictable.len(),
                self.in_use,
                self.offloading,
                total
            ));
        }
        if self.returned.load(Ordering::Acquire) > self.offloading {
            return Err(format!(
                "a tier returned more blocks than the {} offloading",
                self.offloading
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

    /// With the tier quiescent (every offloaded block returned, no push in flight): checks that the
    /// free list holds exactly the clean blocks, each once, all unreferenced, unhashed and not
    /// evictable. It pops the whole list and pushes it back in the same order.
    pub fn check_free_list(&mut self) -> Result<(), String> {
        self.absorb_returned();
        if self.offloading != 0 {
            return Err(format!(
                "{} blocks still offloading: the tier is not quiescent",
                self.offloading
            ));
        }
        let ids: Vec<u32> = std::iter::from_fn(|| self.free.pop()).collect();
        for &id in ids.iter().rev() {
            self.free.push(id);
        }
        if ids.len() != self.clean {
            return Err(format!(
                "free list holds {} ids, clean says {}",
                ids.len(),
                self.clean
            ));
        }
        let mut seen = vec![false; self.num_blocks()];
        for id in ids {
            let b = id as usize;
            if std::mem::replace(&mut seen[b], true) {
                return Err(format!("block {id} is on the free list twice"));
            }
            if self.ref_counts[b] != 0 || self.hashes[b].is_some() || self.evictable.contains(id) {
                return Err(format!("block {id} is on the free list but not clean"));
            }
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
        pool.register(blocks[0], 100, 0, &[], 0);
        pool.register(blocks[1], 101, 0, &[], 0);
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
        pool.register(block, 5, 0, &[], 0);
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

    /// A cached block offloaded leaves the prefix map (one Removed event), is neither clean nor
    /// available until the tier returns it, and once returned is allocated like any clean block.
    #[test]
    fn an_offloaded_block_counts_again_once_returned() {
        let mut pool = BlockPool::new(2).unwrap();
        pool.keep_content(2).unwrap();
        pool.record_events();
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        assert!(pool.register(a, 11, 3, &[5, 6], 2));
        pool.release(a);
        let job = pool.start_offload().unwrap();
        assert_eq!(
            job,
            OffloadJob {
                block: a,
                key: BlockKey {
                    hash: 11,
                    parent: 3,
                    tokens: vec![5, 6].into()
                },
                group: 2,
            }
        );
        assert_eq!(pool.lookup(11), None);
        assert_eq!(
            (
                pool.num_clean(),
                pool.num_available(),
                pool.num_offloading()
            ),
            (0, 0, 1)
        );
        assert_eq!(pool.allocate(), None, "nothing to take while a is out");
        pool.check_invariants().unwrap();
        let link = pool.tier_link();
        link.free.push(a);
        link.returned.fetch_add(1, Ordering::Release);
        assert_eq!((pool.num_clean(), pool.num_offloading()), (1, 0));
        assert_eq!(pool.allocate(), Some(a));
        pool.release(a);
        pool.release(b);
        pool.check_free_list().unwrap();
        let mut events = Vec::new();
        pool.take_events(&mut events);
        assert_eq!(
            events,
            vec![
                KvEvent::BlockStored {
                    key: BlockKey {
                        hash: 11,
                        parent: 3,
                        tokens: vec![5, 6].into()
                    },
                    medium: Medium::Ram,
                    group: 2,
                },
                KvEvent::BlockRemoved {
                    hash: 11,
                    medium: Medium::Ram,
                    group: 2,
                }
            ]
        );
        assert_eq!(pool.counters().offloads, 1);
    }

    #[test]
    fn the_free_list_check_finds_a_block_held_twice() {
        let mut pool = BlockPool::new(3).unwrap();
        let a = pool.allocate().unwrap();
        pool.check_free_list().unwrap();
        pool.free.push(a); // a caller bug: `a` is in use and on the list
        pool.clean += 1;
        assert!(pool.check_free_list().is_err());
    }

    #[test]
    fn a_second_block_with_the_same_hash_stays_unregistered() {
        let mut pool = BlockPool::new(2).unwrap();
        let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
        assert!(pool.register(a, 9, 0, &[], 0));
        assert!(!pool.register(b, 9, 0, &[], 0));
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
