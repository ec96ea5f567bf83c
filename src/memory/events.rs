//! KV cache events: what a block manager and its tiers tell the outside (a router) about the
//! blocks they hold, named as vLLM names them (BlockStored / BlockRemoved / AllBlocksCleared).
//!
//! Invariant: replaying a manager's events in order over an empty set of (hash, medium) pairs
//! gives exactly the blocks it holds findable in each medium. One event per block: a `Stored` when
//! a full block becomes findable by prefix lookup in that medium, a `Removed` when it stops being
//! findable there, `Cleared` when a whole medium is emptied (a tier of another model cleared).
//!
//! A block event names the KV cache group whose table registered the block (`crate::kv`; 0 for a
//! model of one group, and for every block of a disk tier, which serves one group): a group's
//! hashes chain from its own root, so only group 0's are those a router computes for a prompt
//! (`crate::kv::spec` puts a full-attention group first).

use crate::memory::prefix_cache::{BlockHash, BlockKey};

/// Where a block is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    Ram,
    Disk,
}

impl Medium {
    pub const ALL: [Medium; 2] = [Medium::Ram, Medium::Disk];

    /// The medium named `name` ("ram" or "disk"); `InvalidArgument` for any other.
    pub fn from_name(name: &str) -> crate::error::Result<Medium> {
        Medium::ALL
            .into_iter()
            .find(|m| m.name() == name)
            .ok_or_else(|| {
                crate::error::Error::InvalidArgument(format!(
                    "medium must be one of ram, disk, got {name:?}"
                ))
            })
    }

    /// The name events carry (vLLM's `medium` field).
    pub fn name(self) -> &'static str {
        match self {
            Medium::Ram => "ram",
            Medium::Disk => "disk",
        }
    }
}

/// One change to the set of findable blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// The block `key` names, of KV cache group `group`, is now findable in `medium`.
    BlockStored {
        key: BlockKey,
        medium: Medium,
        group: u32,
    },
    /// The block of prefix `hash`, of KV cache group `group`, is no longer findable in `medium`.
    BlockRemoved {
        hash: BlockHash,
        medium: Medium,
        group: u32,
    },
    /// No block is findable in `medium` any more.
    AllBlocksCleared { medium: Medium },
}
