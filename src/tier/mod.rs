//! The scheduler's view of a lower KV tier (the disk tier of [`crate::tier::disk`], or a fake in tests).
//!
//! Protocol, owned by the block manager (the only caller):
//! - **Offload.** A cached block (full, hashed, unreferenced) chosen for eviction leaves the RAM
//!   prefix map and enters the pool's *offloading* state: no table holds it, it is not on the free
//!   list, nothing writes it. The manager hands the tier an [`OffloadJob`]. The tier's I/O thread
//!   copies the block's K/V out of RAM, then pushes the block onto the pool's shared free list and
//!   counts it in [`TierLink::returned`] (in that order, so a count never runs ahead of the list);
//!   only then does it write the copy to its store. The pool adds the returned count to its clean
//!   blocks when it next looks, so its count of clean blocks never exceeds the list's length.
//! - **Load.** Admission's prefix lookup asks [`KvTier::contains`] for the blocks after the last RAM
//!   hit. Each block found is given a fresh RAM block (counted by admission like any new block) and
//!   a [`LoadJob`]; the sequence does not run until every load of it has completed
//!   ([`KvTier::completed_loads`]). A load that fails verification ([`LoadOutcome::Dropped`]) is a
//!   miss from that block on: those tokens are recomputed. While a load is in flight its RAM block
//!   belongs to the I/O thread: the manager neither frees nor reuses it until the load completes.
//! - `contains` is a hint: true means "stored or being stored"; only a load's verification decides.

pub mod disk;

use std::sync::Arc;

use crate::memory::events::KvEvent;
use crate::memory::free_list::FreeList;
use crate::memory::prefix_cache::{BlockHash, BlockKey};
// `std`'s, or loom's under `--cfg loom` (so the loom test checks the pool with a real I/O thread).
use crate::ids::BlockId;
use crate::sync::AtomicUsize;

/// What a tier needs of the pool: its free list, shared, and the count of blocks returned to it.
#[derive(Clone)]
pub struct TierLink {
    pub free: Arc<FreeList>,
    /// Blocks the tier pushed onto `free` that the pool has not yet counted (the pool swaps it to 0).
    pub returned: Arc<AtomicUsize>,
}

/// A full cached block leaving RAM for the tier: a whole page, whichever KV cache group held it
/// (`crate::kv`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadJob {
    pub block: BlockId,
    /// What the block holds (its group's block of tokens).
    pub key: BlockKey,
    /// The KV cache group whose table held it (the tier records it, and its events name it).
    pub group: u32,
}

/// A block to bring back into RAM block `block`: the entry of `hash`, verified to hold `tokens`
/// under `parent`, of KV cache group `group`, and its checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadJob {
    pub block: BlockId,
    pub key: BlockKey,
    pub group: u32,
}

/// How a load ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadOutcome {
    /// The block's K/V are in its RAM block, verified.
    Loaded,
    /// Missing, torn, corrupt or not what was asked: the entry is dropped and the tokens recomputed.
    Dropped,
}

/// A finished load, naming the RAM block its job named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadDone {
    pub block: BlockId,
    pub outcome: LoadOutcome,
}

/// What a tier has done since it was opened.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TierCounters {
    pub offloads: u64,
    pub loads: u64,
    /// Entries dropped because they did not verify (bytes, tokens or parent), or did not decode.
    pub dropped_corrupt: u64,
    /// Loads that ended [`LoadOutcome::Dropped`] with nothing corrupt: the block was not held (never
    /// stored, its copy lost, or evicted since `contains`), or the job failed (a block id outside
    /// the pool, an I/O error writing RAM, the I/O thread gone).
    pub load_misses: u64,
    pub evictions: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
    /// Blocks the tier holds now.
    pub blocks: u64,
    /// Offloaded blocks whose copy was lost (an I/O error, a full queue): their ids still returned.
    pub offloads_lost: u64,
    /// Jobs (offloads and loads) queued and not yet finished, now.
    pub jobs_in_flight: u64,
}

/// A lower KV tier driven by one block manager.
pub trait KvTier: Send {
    /// Whether the tier holds, or is storing, the block of prefix hash `hash` (a hint: see above).
    fn contains(&self, hash: BlockHash) -> bool;
    /// Queues `job`; returns at once.
    fn offload(&mut self, job: OffloadJob);
    /// Queues `job`; returns at once. Its completion comes from `completed_loads`.
    fn load(&mut self, job: LoadJob);
    /// Loads finished since the last call, in any order; never blocks.
    fn completed_loads(&mut self) -> Vec<LoadDone>;
    /// Blocks until every queued job has finished (its loads then appear in `completed_loads`).
    fn flush(&mut self);
    /// What the tier has done.
    fn counters(&self) -> TierCounters;
    /// Hashes (and KV cache groups) of the blocks whose store has committed: the set its `Disk`
    /// events describe.
    fn stored_blocks(&self) -> Vec<(BlockHash, u32)>;
    /// Moves the tier's KV events since the last call (medium `Disk`) into `out`, in order.
    fn drain_events(&mut self, out: &mut Vec<KvEvent>);
}
