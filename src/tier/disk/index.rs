//! The crash-safe index of the disk tier, in redb (a pure-Rust embedded store with ACID
//! transactions and copy-on-write pages, so a commit survives `kill -9` whole or not at all; chosen
//! over a hand-written log with CRCs because recovery and compaction come with it).
//!
//! Tables: `blocks` maps a block's 128-bit prefix hash to its [`BlockRecord`]; `meta` holds the
//! tier's identity under `"identity"`. Every commit is `Durability::Immediate`: when `commit`
//! returns, the entry is on disk.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::Arc;

use redb::backends::FileBackend;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::files::open_private;
use super::{DiskError, DiskResult};

use crate::ids::TokenId;
use crate::memory::prefix_cache::BlockHash;

const BLOCKS: TableDefinition<u128, &[u8]> = TableDefinition::new("blocks");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const IDENTITY: &str = "identity";

/// What the index knows of one stored block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRecord {
    /// Slot of the data file holding the block's K/V.
    pub slot: u32,
    /// xxh3-64 of the slot's bytes as written.
    pub checksum: u64,
    /// Hash of the previous block of the prefix (the chain root for a first block).
    pub parent: BlockHash,
    /// The KV cache group whose table held the block (`crate::kv`; 0 for a model of one group).
    pub group: u32,
    /// The block's tokens (shared with the `BlockKey` of its events).
    pub tokens: Arc<[TokenId]>,
}

impl BlockRecord {
    /// Little-endian `slot | checksum | parent | group | tokens`. (The group's four bytes held a
    /// cache salt's length once, always 0 with no salt after it: such a record reads as group 0.)
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + 4 * self.tokens.len());
        out.extend_from_slice(&self.slot.to_le_bytes());
        out.extend_from_slice(&self.checksum.to_le_bytes());
        out.extend_from_slice(&self.parent.to_le_bytes());
        out.extend_from_slice(&self.group.to_le_bytes());
        for t in self.tokens.iter() {
            out.extend_from_slice(&t.to_le_bytes());
        }
        out
    }

    /// The record `encode` wrote, or `None` for bytes it could not have written.
    fn decode(bytes: &[u8]) -> Option<Self> {
        let (slot, rest) = bytes.split_first_chunk::<4>()?;
        let (checksum, rest) = rest.split_first_chunk::<8>()?;
        let (parent, rest) = rest.split_first_chunk::<16>()?;
        let (group, tokens) = rest.split_first_chunk::<4>()?;
        if tokens.len() % 4 != 0 {
            return None;
        }
        Some(BlockRecord {
            slot: u32::from_le_bytes(*slot),
            checksum: u64::from_le_bytes(*checksum),
            parent: u128::from_le_bytes(*parent),
            group: u32::from_le_bytes(*group),
            tokens: tokens
                .chunks_exact(4)
                .map(|t| TokenId::from_le_bytes(t.try_into().expect("4 bytes")))
                .collect(),
        })
    }
}

/// The open index.
pub struct Index {
    db: Database,
}

impl Index {
    /// Opens (or creates) the index at `path` (opened by [`super::files::open_private`]) for a
    /// tier of `identity`, every page's checksum verified (redb's integrity check on open). An
    /// index written for another identity is cleared (a stale cache is only a cold one; its blocks
    /// can never be served), and so is one that is not a readable index of ours (truncated,
    /// zeroed, corrupt, another redb file): its file is emptied and a new index made in it. Returns
    /// whether it was cleared. Errors that say nothing about the file's content (another process
    /// holds it, an I/O error) are returned, clearing nothing.
    pub fn open(path: &Path, identity: &[u8]) -> DiskResult<(Self, bool)> {
        match Self::open_guarded(path, identity) {
            Ok(opened) => Ok(opened),
            Err(Unusable::Content(_)) => {
                let file = open_private(path)?;
                // Under an flock, which redb holds on an open index (Linux): never empty a file
                // another process has open as its index (that process found it readable).
                file.try_lock().map_err(|e| match e {
                    std::fs::TryLockError::WouldBlock => DiskError::Io(std::io::Error::new(
                        std::io::ErrorKind::ResourceBusy,
                        format!("{} is in use by another process", path.display()),
                    )),
                    std::fs::TryLockError::Error(e) => e.into(),
                })?;
                file.set_len(0)?;
                file.sync_all()?;
                drop(file); // and its lock
                match Self::open_guarded(path, identity) {
                    Ok((index, _)) => Ok((index, true)),
                    Err(Unusable::Content(error) | Unusable::Other(error)) => Err(error),
                }
            }
            Err(Unusable::Other(error)) => Err(error),
        }
    }

    /// [`Index::open_file`], a panic of redb caught and classed as the file's content.
    fn open_guarded(path: &Path, identity: &[u8]) -> Result<(Self, bool), Unusable> {
        // redb trusts its file and may panic on some corruptions (about 1 in 15 random ones before
        // the integrity check on open, which should catch the rest); the index is a cache that an
        // unreadable file only makes cold, so a panic here must not reach the engine. Nothing
        // outside the attempt is touched, so unwinding leaves no broken state.
        match catch_unwind(AssertUnwindSafe(|| Self::open_file(path, identity))) {
            Ok(result) => result,
            Err(_) => Err(Unusable::Content(DiskError::Index(redb::Error::Corrupted(
                format!("{}: redb panicked opening it", path.display()),
            )))),
        }
    }

    /// One attempt at opening the index, its errors classed.
    fn open_file(path: &Path, identity: &[u8]) -> Result<(Self, bool), Unusable> {
        let file = open_private(path).map_err(Unusable::Other)?;
        let backend = FileBackend::new(file).map_err(|e| Unusable::classify(e.into()))?;
        let db = Database::builder()
            .set_check_integrity_on_open(true)
            .create_with_backend(backend)
            .map_err(|e| Unusable::classify(e.into()))?;
        let (index, cleared) = Self::claim(db, identity).map_err(Unusable::classify)?;
        index.read_all().map_err(Unusable::classify)?;
        Ok((index, cleared))
    }

    /// Reads every entry once: a table redb cannot walk fails here, inside the guard of
    /// [`Index::open_guarded`], rather than later at [`Index::load_all`].
    fn read_all(&self) -> Result<(), redb::Error> {
        let txn = self.db.begin_read()?;
        for entry in txn.open_table(BLOCKS)?.iter()? {
            entry?;
        }
        Ok(())
    }

    /// Makes `db` the index of `identity`, clearing the blocks of another.
    fn claim(db: Database, identity: &[u8]) -> Result<(Self, bool), redb::Error> {
        let txn = db.begin_write()?;
        let cleared = {
            let mut meta = txn.open_table(META)?;
            let stored = meta.get(IDENTITY)?.map(|v| v.value().to_vec());
            let mismatch = stored.as_deref() != Some(identity);
            if mismatch {
                meta.insert(IDENTITY, identity)?;
            }
            mismatch && stored.is_some()
        };
        if cleared {
            txn.delete_table(BLOCKS)?;
        }
        txn.open_table(BLOCKS)?;
        txn.commit()?;
        Ok((Index { db }, cleared))
    }

    /// Every record, with its hash; records that do not decode are removed and counted.
    pub fn load_all(&self) -> Result<(Vec<(BlockHash, BlockRecord)>, usize), redb::Error> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(BLOCKS)?;
        let mut records = Vec::new();
        let mut bad = Vec::new();
        for entry in table.iter()? {
            let (hash, value) = entry?;
            match BlockRecord::decode(value.value()) {
                Some(record) => records.push((hash.value(), record)),
                None => bad.push(hash.value()),
            }
        }
        drop(table);
        drop(txn);
        self.remove(&bad)?;
        Ok((records, bad.len()))
    }

    /// Commits the entries `records` in one transaction (one commit's `fsync`s however many:
    /// what makes a group of stores cheap, see [`super::DiskStore::store_group`]); none, no
    /// transaction.
    pub fn insert(&self, records: &[(BlockHash, BlockRecord)]) -> Result<(), redb::Error> {
        if records.is_empty() {
            return Ok(());
        }
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(BLOCKS)?;
            for (hash, record) in records {
                table.insert(*hash, record.encode().as_slice())?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// Commits the removal of the entries of `hashes` in one transaction; none, no transaction.
    pub fn remove(&self, hashes: &[BlockHash]) -> Result<(), redb::Error> {
        if hashes.is_empty() {
            return Ok(());
        }
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(BLOCKS)?;
            for &hash in hashes {
                table.remove(hash)?;
            }
        }
        txn.commit()?;
        Ok(())
    }
}

/// Why an attempt at opening the index failed.
enum Unusable {
    /// The file is not a readable index of ours: clearing it is the remedy.
    Content(DiskError),
    /// Anything else (another process holds it, an I/O error, a refused path): returned as is.
    Other(DiskError),
}

impl Unusable {
    fn classify(error: redb::Error) -> Self {
        let content = match &error {
            redb::Error::Corrupted(_)
            | redb::Error::UpgradeRequired(_)
            | redb::Error::RepairAborted
            | redb::Error::TableTypeMismatch { .. }
            | redb::Error::TableIsMultimap(_)
            | redb::Error::TableIsNotMultimap(_)
            | redb::Error::TypeDefinitionChanged { .. } => true,
            // A file shorter than its header says, or bytes redb cannot parse.
            redb::Error::Io(e) => matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::InvalidData
            ),
            _ => false,
        };
        if content {
            Unusable::Content(error.into())
        } else {
            Unusable::Other(error.into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_garbage_does_not_decode() {
        let record = BlockRecord {
            slot: 7,
            checksum: 0xdead_beef,
            parent: 1 << 100,
            group: 5,
            tokens: vec![1, 2, u32::MAX].into(),
        };
        assert_eq!(BlockRecord::decode(&record.encode()), Some(record));
        assert_eq!(BlockRecord::decode(&[1, 2, 3]), None);
    }
}
