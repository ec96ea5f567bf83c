//! The disk tier's blocks: `blocks.dat`, `capacity` slots of `slot_bytes` each (every layer's K and
//! V of one block, laid out by the caller), and `index.redb` saying which block each slot holds.
//!
//! Write order of a store (of a group of blocks, [`DiskStore::store_group`]; a single store is a
//! group of one), so a crash at any point leaves nothing servable that is wrong: the slots being
//! reused lose their index entries first (one commit), then the new bytes of every block are
//! written and `fdatasync`ed (once), then the new entries are committed (one transaction). A crash
//! before the last commit leaves unreferenced slots (free again at the next open); a torn write can
//! only be under an entry that does not exist yet. Grouping shares the `fdatasync` and the commits'
//! `fsync`s, the bulk of a store's cost (see `benches/disk_tier.rs`).
//! Every load re-checks the entry's checksum, tokens and group against the bytes and the caller's
//! expectation; a mismatch or a short read drops the entry (counted) and is [`Fetch::Dropped`]; a
//! hash without an entry is [`Fetch::Missing`] (nothing dropped, nothing counted).
//!
//! Capacity is bounded; a full tier evicts under the same [`EvictionPolicy`] as the RAM pool,
//! over slots (a load is a hit). The eviction order is not persisted: a reopened tier starts it
//! afresh in hash order, all blocks unhit.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rustc_hash::{FxHashMap, FxHashSet};

use super::index::{BlockRecord, Index};
use super::{files, DiskError, DiskResult};
use crate::alloc::try_vec_with;
use crate::ids::TokenId;
use crate::memory::eviction::{Evictable, EvictionPolicy};
use crate::memory::prefix_cache::BlockHash;

/// Counters of what the tier has done since it was opened.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DiskCounters {
    pub stores: u64,
    pub loads: u64,
    /// Entries dropped because their bytes, tokens or group did not verify (or did not decode).
    pub dropped_corrupt: u64,
    pub evictions: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
}

/// What a load found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetch {
    /// The buffer holds the block, verified.
    Verified,
    /// No entry for the hash (never stored, or evicted or dropped since).
    Missing,
    /// The entry did not verify (bytes, tokens, parent or group): dropped, counted in
    /// `dropped_corrupt`.
    Dropped,
}

/// One block to store: the block `hash` of KV cache group `group` after `parent` holding
/// `tokens`, its bytes `data` (exactly `slot_bytes`).
#[derive(Debug, Clone, Copy)]
pub struct NewBlock<'a> {
    pub hash: BlockHash,
    pub parent: BlockHash,
    pub group: u32,
    pub tokens: &'a [TokenId],
    pub data: &'a [u8],
}

/// What opening found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    /// Blocks recovered from the index.
    pub recovered: usize,
    /// Whether a tier was cleared: one of another identity, or an unreadable index.
    pub cleared: bool,
}

/// An open disk tier.
pub struct DiskStore {
    data: File,
    index: Index,
    slot_bytes: usize,
    slots: FxHashMap<BlockHash, BlockRecord>,
    /// The hash each slot holds.
    owners: Vec<Option<BlockHash>>,
    free: Vec<u32>,
    order: Evictable,
    counters: DiskCounters,
    /// Hashes (and groups) whose entries were removed (evicted or dropped) since the last
    /// `take_removed`.
    removed: Vec<(BlockHash, u32)>,
}

impl DiskStore {
    /// Opens (or creates) the tier in directory `dir` for a model of `identity` (the caller's
    /// fingerprint: config and weights hash, KV dtype, block size), with `slot_bytes` per block and
    /// at most `capacity_bytes` of data. A tier written for another identity or slot size, or
    /// whose index is unreadable (truncated, zeroed, corrupt), is cleared. Entries beyond the
    /// capacity, or that do not decode, are dropped. The directory and files are opened as
    /// [`files`] says. Fails, creating nothing, with `InvalidArgument` for an empty path, a
    /// capacity holding no slot or exceeding the file system, `OutOfMemory` if the slot table
    /// cannot be allocated; with `Io` for a directory or file refused or not opened.
    pub fn open(
        dir: &Path,
        identity: &[u8],
        slot_bytes: usize,
        capacity_bytes: u64,
        policy: EvictionPolicy,
    ) -> DiskResult<(Self, Opened)> {
        let capacity = (capacity_bytes / slot_bytes.max(1) as u64).min(u32::MAX as u64) as usize;
        if slot_bytes == 0 || capacity == 0 {
            return Err(DiskError::InvalidArgument(format!(
                "{capacity_bytes} bytes hold no slot of {slot_bytes} bytes"
            )));
        }
        files::check_args(dir, capacity_bytes)?;
        // The slot table is sized by the capacity: allocated fallibly, before any file is made.
        let out_of_memory = |e: crate::error::Error| match e {
            crate::error::Error::OutOfMemory(m) => DiskError::OutOfMemory(m),
            other => DiskError::InvalidArgument(other.to_string()),
        };
        let owners = try_vec_with(capacity, "the disk tier's slot table", |_| None)
            .map_err(out_of_memory)?;
        let mut free = Vec::new();
        free.try_reserve_exact(capacity).map_err(|_| {
            DiskError::OutOfMemory(format!("the disk tier's free list of {capacity} slots"))
        })?;
        let order = Evictable::new(capacity, policy).map_err(out_of_memory)?;
        files::prepare_dir(dir)?;
        let mut full_identity = identity.to_vec();
        full_identity.extend_from_slice(&(slot_bytes as u64).to_le_bytes());
        let (index, cleared) = Index::open(&dir.join("index.redb"), &full_identity)?;
        let data = files::open_private(&dir.join("blocks.dat"))?;
        let (records, undecodable) = index.load_all()?;
        let mut store = DiskStore {
            data,
            index,
            slot_bytes,
            slots: FxHashMap::default(),
            owners,
            free,
            order,
            counters: DiskCounters {
                dropped_corrupt: undecodable as u64,
                ..Default::default()
            },
            removed: Vec::new(),
        };
        let mut stray = Vec::new();
        for (hash, record) in records {
            let slot = record.slot as usize;
            if slot < capacity && store.owners[slot].is_none() {
                store.owners[slot] = Some(hash);
                store.order.push(record.slot);
                store.slots.insert(hash, record);
            } else {
                stray.push(hash);
            }
        }
        store.index.remove(&stray)?;
        let unused = (0..capacity as u32)
            .rev()
            .filter(|&s| store.owners[s as usize].is_none());
        store.free.extend(unused);
        let recovered = store.slots.len();
        Ok((store, Opened { recovered, cleared }))
    }

    /// Bytes of one block.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Most blocks the tier holds.
    pub fn capacity(&self) -> usize {
        self.owners.len()
    }

    /// Blocks stored.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Whether the index has an entry for `hash` (not yet verified).
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.slots.contains_key(&hash)
    }

    /// The stored hashes, in no order.
    pub fn hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.slots.keys().copied()
    }

    /// The stored entries with their hashes, in no order.
    pub fn records(&self) -> impl Iterator<Item = (BlockHash, &BlockRecord)> + '_ {
        self.slots.iter().map(|(&hash, record)| (hash, record))
    }

    /// Hashes (and KV cache groups) whose entries `store` (evicting) or `load` (dropping) removed
    /// since the last call, in order, errors or not: what a caller reports as no longer held.
    pub fn take_removed(&mut self) -> Vec<(BlockHash, u32)> {
        std::mem::take(&mut self.removed)
    }

    /// What the tier has done.
    pub fn counters(&self) -> DiskCounters {
        self.counters
    }

    /// Stores one block: [`DiskStore::store_group`] of `[block]`. Returns false if its hash was
    /// already stored.
    pub fn store(&mut self, block: NewBlock<'_>) -> DiskResult<bool> {
        Ok(self.store_group(&[block])?[0])
    }

    /// Stores `blocks` (at most `capacity`, each exactly `slot_bytes`), evicting as many blocks as
    /// the tier needs room for, in the write order of the module doc: one commit removing the
    /// victims' entries (if any), one `fdatasync` of the data, one commit of the new entries.
    /// Returns, per block, whether it was stored (false: its hash was already stored, or came
    /// earlier in `blocks`). Fails with `InvalidArgument`, changing nothing, for a block of another
    /// size or too many blocks; on an I/O error no block of the group is stored (victims already
    /// evicted stay evicted, reported by `take_removed`).
    pub fn store_group(&mut self, blocks: &[NewBlock<'_>]) -> DiskResult<Vec<bool>> {
        if let Some(bad) = blocks.iter().find(|b| b.data.len() != self.slot_bytes) {
            return Err(DiskError::InvalidArgument(format!(
                "a block is {} bytes, got {}",
                self.slot_bytes,
                bad.data.len()
            )));
        }
        if blocks.len() > self.capacity() {
            return Err(DiskError::InvalidArgument(format!(
                "a group of {} blocks exceeds the tier's {} slots",
                blocks.len(),
                self.capacity()
            )));
        }
        let mut new = vec![false; blocks.len()];
        let mut seen = FxHashSet::default();
        for (is_new, block) in new.iter_mut().zip(blocks) {
            *is_new = !self.slots.contains_key(&block.hash) && seen.insert(block.hash);
        }
        let count = seen.len();
        if count == 0 {
            return Ok(new);
        }
        let shortfall = count.saturating_sub(self.free.len());
        if shortfall > 0 {
            let victims: Vec<u32> = (0..shortfall)
                .map(|_| self.order.pop().expect("a full tier has blocks"))
                .collect();
            if let Err(error) = self.forget(&victims) {
                victims.iter().for_each(|&slot| self.order.push(slot));
                return Err(error);
            }
            self.counters.evictions += shortfall as u64;
        }
        let slots: Vec<u32> = (0..count)
            .map(|_| self.free.pop().expect("room was made"))
            .collect();
        let fresh: Vec<(&NewBlock<'_>, u32)> = blocks
            .iter()
            .zip(&new)
            .filter_map(|(block, &is_new)| is_new.then_some(block))
            .zip(slots.iter().copied())
            .collect();
        let written = fresh
            .iter()
            .try_for_each(|&(block, slot)| self.data.write_all_at(block.data, self.offset(slot)))
            .and_then(|()| self.data.sync_data());
        let entries: Vec<(BlockHash, BlockRecord)> = fresh
            .iter()
            .map(|&(block, slot)| {
                let record = BlockRecord {
                    slot,
                    checksum: xxhash_rust::xxh3::xxh3_64(block.data),
                    parent: block.parent,
                    group: block.group,
                    tokens: block.tokens.into(),
                };
                (block.hash, record)
            })
            .collect();
        if let Err(error) = written
            .map_err(DiskError::from)
            .and_then(|()| Ok(self.index.insert(&entries)?))
        {
            self.free.extend(slots.iter().rev());
            return Err(error);
        }
        for (hash, record) in entries {
            self.owners[record.slot as usize] = Some(hash);
            self.order.push(record.slot);
            self.slots.insert(hash, record);
        }
        self.counters.stores += count as u64;
        self.counters.bytes_written += (count * self.slot_bytes) as u64;
        Ok(new)
    }

    /// Reads block `hash` into `out` (`slot_bytes` long) if it is stored and verifies it against
    /// its checksum and the expected `parent`, `group` and `tokens`; a block that does not verify is
    /// dropped (counted). Only on [`Fetch::Verified`] does `out` hold the block.
    pub fn load(
        &mut self,
        hash: BlockHash,
        parent: BlockHash,
        group: u32,
        tokens: &[TokenId],
        out: &mut [u8],
    ) -> DiskResult<Fetch> {
        let Some(record) = self.slots.get(&hash) else {
            return Ok(Fetch::Missing);
        };
        if out.len() != self.slot_bytes {
            return Err(DiskError::InvalidArgument(format!(
                "a block is {} bytes, got a buffer of {}",
                self.slot_bytes,
                out.len()
            )));
        }
        let slot = record.slot;
        let read = self.data.read_exact_at(out, self.offset(slot));
        let verified = read.is_ok()
            && xxhash_rust::xxh3::xxh3_64(out) == record.checksum
            && record.parent == parent
            && record.group == group
            && *record.tokens == *tokens;
        self.order.remove(slot);
        if !verified {
            self.forget(&[slot])?;
            self.counters.dropped_corrupt += 1;
            return Ok(Fetch::Dropped);
        }
        self.order.mark_hit(slot);
        self.order.push(slot);
        self.counters.loads += 1;
        self.counters.bytes_read += out.len() as u64;
        Ok(Fetch::Verified)
    }

    /// Removes the entries of `slots` (occupied, no longer in `order`) from the index in one
    /// commit, then frees the slots.
    fn forget(&mut self, slots: &[u32]) -> DiskResult<()> {
        let hashes: Vec<BlockHash> = slots
            .iter()
            .map(|&slot| self.owners[slot as usize].expect("an occupied slot"))
            .collect();
        self.index.remove(&hashes)?;
        for (&slot, hash) in slots.iter().zip(hashes) {
            self.owners[slot as usize] = None;
            let record = self.slots.remove(&hash).expect("an occupied slot's record");
            self.free.push(slot);
            self.removed.push((hash, record.group));
        }
        Ok(())
    }

    fn offset(&self, slot: u32) -> u64 {
        slot as u64 * self.slot_bytes as u64
    }
}
