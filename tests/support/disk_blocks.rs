//! What the disk store's test binaries share: test block `i` (bytes, tokens and parent all
//! derived from `i`, so a reader can check them), a fresh directory per test, and storing and
//! loading those blocks. Each binary includes this file (`#[path]`) and uses part of it.

use std::path::PathBuf;

use pagedkv::memory::eviction::EvictionPolicy;
use pagedkv::tier::disk::{DiskStore, Fetch, NewBlock};

pub const SLOT: usize = 4096;
pub const ID: &[u8] = b"model-a/f16/bs16";

pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pagedkv-disk-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The bytes, tokens and parent of test block `i`: all derived from `i`, so a reader can check.
pub fn block(i: u64) -> (u128, u128, Vec<u32>, Vec<u8>) {
    let data: Vec<u8> = (0..SLOT).map(|b| (i as usize * 31 + b * 7) as u8).collect();
    let tokens = vec![i as u32, i as u32 + 1, i as u32 + 2, i as u32 + 3];
    (1000 + i as u128, i as u128, tokens, data)
}

pub fn open(dir: &std::path::Path, slots: u64) -> DiskStore {
    DiskStore::open(dir, ID, SLOT, slots * SLOT as u64, EvictionPolicy::Slru)
        .unwrap()
        .0
}

pub type Block = (u128, u128, Vec<u32>, Vec<u8>);

pub fn new_block((hash, parent, tokens, data): &Block) -> NewBlock<'_> {
    NewBlock {
        hash: *hash,
        parent: *parent,
        group: 0,
        tokens,
        data,
    }
}

pub fn store(s: &mut DiskStore, i: u64) -> bool {
    s.store(new_block(&block(i))).unwrap()
}

/// Stores blocks `ids` as one group.
pub fn store_group(s: &mut DiskStore, ids: &[u64]) -> Vec<bool> {
    let blocks: Vec<Block> = ids.iter().map(|&i| block(i)).collect();
    let group: Vec<NewBlock<'_>> = blocks.iter().map(new_block).collect();
    s.store_group(&group).unwrap()
}

/// Loads block `i`; if served, asserts its bytes are exactly those written.
pub fn fetch(s: &mut DiskStore, i: u64) -> Fetch {
    let (hash, parent, tokens, data) = block(i);
    let mut out = vec![0; SLOT];
    let fetched = s.load(hash, parent, 0, &tokens, &mut out).unwrap();
    if fetched == Fetch::Verified {
        assert_eq!(out, data, "block {i} served with other bytes");
    }
    fetched
}

pub fn load(s: &mut DiskStore, i: u64) -> bool {
    fetch(s, i) == Fetch::Verified
}
