//! The disk tier's blocks: `blocks.dat`, `capacity` slots of `slot_bytes` each (every layer's K and
//! V of one block, laid out by the caller), and `index.redb` saying which block each slot holds.
//!
//! Write order, so a crash at any point leaves nothing servable that is wrong: a slot being reused
//! loses its index entry first (committed), then the new bytes are written and `fdatasync`ed, then
//! the new entry is committed. A crash before the last commit leaves an unreferenced slot (free
//! again at the next open); a torn write can only be under an entry that does not exist yet.
//! Every load re-checks the entry's checksum, tokens and salt against the bytes and the caller's
//! expectation; a mismatch or a short read drops the entry (counted) and is a miss.
//!
//! Capacity is bounded; a full tier evicts under the same [`EvictionPolicy`] as the RAM pool,
//! over slots (a load is a hit). The eviction order is not persisted: a reopened tier starts it
//! afresh in hash order, all blocks unhit.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;

use rustc_hash::FxHashMap;

use super::index::{BlockRecord, Index};
use super::{DiskError, DiskResult};
use crate::lru::{Evictable, EvictionPolicy};
use crate::prefix_cache::BlockHash;
use crate::TokenId;

/// Counters of what the tier has done since it was opened.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DiskCounters {
    pub stores: u64,
    pub loads: u64,
    /// Entries dropped because their bytes, tokens or salt did not verify (or did not decode).
    pub dropped_corrupt: u64,
    pub evictions: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
}

/// What opening found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    /// Blocks recovered from the index.
    pub recovered: usize,
    /// Whether a tier of another identity was cleared.
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
    /// Hashes whose entries were removed (evicted or dropped) since the last `take_removed`.
    removed: Vec<BlockHash>,
}

impl DiskStore {
    /// Opens (or creates) the tier in directory `dir` for a model of `identity` (the caller's
    /// fingerprint: config and weights hash, KV dtype, block size), with `slot_bytes` per block and
    /// at most `capacity_bytes` of data. A tier written for another identity or slot size is
    /// cleared. Entries beyond the capacity, or that do not decode, are dropped.
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
        std::fs::create_dir_all(dir)?;
        let mut full_identity = identity.to_vec();
        full_identity.extend_from_slice(&(slot_bytes as u64).to_le_bytes());
        let (index, cleared) = Index::open(&dir.join("index.redb"), &full_identity)?;
        let data = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.join("blocks.dat"))?;
        let (records, undecodable) = index.load_all()?;
        let mut store = DiskStore {
            data,
            index,
            slot_bytes,
            slots: FxHashMap::default(),
            owners: vec![None; capacity],
            free: Vec::new(),
            order: Evictable::new(capacity, policy)
                .map_err(|e| DiskError::InvalidArgument(e.to_string()))?,
            counters: DiskCounters {
                dropped_corrupt: undecodable as u64,
                ..Default::default()
            },
            removed: Vec::new(),
        };
        for (hash, record) in records {
            let slot = record.slot as usize;
            if slot < capacity && store.owners[slot].is_none() {
                store.owners[slot] = Some(hash);
                store.order.push(record.slot);
                store.slots.insert(hash, record);
            } else {
                store.index.remove(hash)?;
            }
        }
        store.free = (0..capacity as u32)
            .rev()
            .filter(|&s| store.owners[s as usize].is_none())
            .collect();
        let recovered = store.slots.len();
        Ok((store, Opened { recovered, cleared }))
    }

    /// Bytes of one block.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
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

    /// Hashes whose entries `store` (evicting) or `load` (dropping) removed since the last call,
    /// in order, errors or not: what a caller reports as no longer held.
    pub fn take_removed(&mut self) -> Vec<BlockHash> {
        std::mem::take(&mut self.removed)
    }

    /// What the tier has done.
    pub fn counters(&self) -> DiskCounters {
        self.counters
    }

    /// Stores `data` (exactly `slot_bytes`) as the block `hash` of `salt` after `parent` holding
    /// `tokens`, evicting a block if the tier is full. Returns false if `hash` was already stored.
    /// On an I/O error the block is simply not stored.
    pub fn store(
        &mut self,
        hash: BlockHash,
        parent: BlockHash,
        salt: &[u8],
        tokens: &[TokenId],
        data: &[u8],
    ) -> DiskResult<bool> {
        if data.len() != self.slot_bytes {
            return Err(DiskError::InvalidArgument(format!(
                "a block is {} bytes, got {}",
                self.slot_bytes,
                data.len()
            )));
        }
        if self.slots.contains_key(&hash) {
            return Ok(false);
        }
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let victim = self.order.pop().expect("a full tier has blocks");
                self.forget(victim)?;
                self.counters.evictions += 1;
                self.free.pop().expect("just freed")
            }
        };
        let record = BlockRecord {
            slot,
            checksum: xxhash_rust::xxh3::xxh3_64(data),
            parent,
            salt: salt.to_vec(),
            tokens: tokens.to_vec(),
        };
        let written = self
            .data
            .write_all_at(data, self.offset(slot))
            .and_then(|()| self.data.sync_data());
        if let Err(error) = written
            .map_err(DiskError::from)
            .and_then(|()| Ok(self.index.insert(hash, &record)?))
        {
            self.free.push(slot);
            return Err(error);
        }
        self.owners[slot as usize] = Some(hash);
        self.order.push(slot);
        self.slots.insert(hash, record);
        self.counters.stores += 1;
        self.counters.bytes_written += data.len() as u64;
        Ok(true)
    }

    /// Reads block `hash` into `out` (`slot_bytes` long) if it is stored and verifies against its
    /// checksum and the expected `parent`, `salt` and `tokens`. A block that does not verify is
    /// dropped (counted). Returns whether `out` holds the block.
    pub fn load(
        &mut self,
        hash: BlockHash,
        parent: BlockHash,
        salt: &[u8],
        tokens: &[TokenId],
        out: &mut [u8],
    ) -> DiskResult<bool> {
        let Some(record) = self.slots.get(&hash) else {
            return Ok(false);
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
            && record.salt == salt
            && record.tokens == tokens;
        if !verified {
            self.order.remove(slot);
            self.forget(slot)?;
            self.counters.dropped_corrupt += 1;
            return Ok(false);
        }
        self.order.remove(slot);
        self.order.mark_hit(slot);
        self.order.push(slot);
        self.counters.loads += 1;
        self.counters.bytes_read += out.len() as u64;
        Ok(true)
    }

    /// Removes the entry of `slot` (no longer in `order`) from the index, then frees the slot.
    fn forget(&mut self, slot: u32) -> DiskResult<()> {
        let hash = self.owners[slot as usize].expect("an occupied slot");
        self.index.remove(hash)?;
        self.owners[slot as usize] = None;
        self.slots.remove(&hash);
        self.free.push(slot);
        self.removed.push(hash);
        Ok(())
    }

    fn offset(&self, slot: u32) -> u64 {
        slot as u64 * self.slot_bytes as u64
    }
}
