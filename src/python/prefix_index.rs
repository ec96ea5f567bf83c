//! `pagedkv.PrefixIndex`: a router's index of which replica holds which block hash in which
//! medium, and the longest cached prefix of a prompt per replica ([`crate::route::prefix_index`]).
//!
//! Every argument goes through `args`; every call runs through `sync::locked_with_gil`, which
//! keeps the GIL: each call costs a few µs (a route at R = 256 over a 504k-block index, one event
//! applied), less than releasing and retaking the GIL, which with another Python thread running
//! can wait out a whole switch interval (5 ms).

use std::sync::Mutex;

use pyo3::prelude::*;

use super::args::{arg, invalid, opt};
use super::sync::locked_with_gil;
use crate::ids::TokenId;
use crate::memory::events::Medium;
use crate::memory::prefix_cache::BlockHash;
use crate::route::prefix_index::{PrefixIndex, ReplicaId};

/// Block hash → the replicas (small int ids) holding it in RAM and on disk; finds the longest
/// cached prefix of a prompt on each replica. Thread-safe.
#[pyclass(name = "PrefixIndex", module = "pagedkv", frozen)]
pub struct PyPrefixIndex {
    inner: Mutex<PrefixIndex>,
}

/// A medium by the name events carry: "ram" or "disk".
fn medium(obj: &Bound<'_, PyAny>) -> PyResult<Medium> {
    let name: String = arg(obj, "medium")?;
    [Medium::Ram, Medium::Disk]
        .into_iter()
        .find(|m| m.name() == name)
        .ok_or_else(|| invalid(format!("medium must be \"ram\" or \"disk\", got {name:?}")))
}

/// The three arguments of an event on one block.
fn block_event(
    replica: &Bound<'_, PyAny>,
    block_hash: &Bound<'_, PyAny>,
    medium_name: &Bound<'_, PyAny>,
) -> PyResult<(ReplicaId, BlockHash, Medium)> {
    Ok((
        arg(replica, "replica")?,
        arg(block_hash, "block_hash")?,
        medium(medium_name)?,
    ))
}

#[pymethods]
impl PyPrefixIndex {
    /// An empty index.
    #[new]
    fn new() -> Self {
        PyPrefixIndex {
            inner: Mutex::new(PrefixIndex::new()),
        }
    }

    /// Replica `replica` now holds `block_hash` in `medium`; returns whether that is new.
    fn apply_stored(
        &self,
        replica: &Bound<'_, PyAny>,
        block_hash: &Bound<'_, PyAny>,
        medium: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let (replica, hash, medium) = block_event(replica, block_hash, medium)?;
        locked_with_gil(&self.inner, |i| Ok(i.apply_stored(replica, hash, medium)))
    }

    /// Replica `replica` no longer holds `block_hash` in `medium`; returns whether it did.
    fn apply_removed(
        &self,
        replica: &Bound<'_, PyAny>,
        block_hash: &Bound<'_, PyAny>,
        medium: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let (replica, hash, medium) = block_event(replica, block_hash, medium)?;
        locked_with_gil(&self.inner, |i| Ok(i.apply_removed(replica, hash, medium)))
    }

    /// Replica `replica` holds nothing in `medium` any more.
    #[pyo3(name = "clear")]
    fn clear_medium(&self, replica: &Bound<'_, PyAny>, medium: &Bound<'_, PyAny>) -> PyResult<()> {
        let (replica, medium) = (arg(replica, "replica")?, self::medium(medium)?);
        locked_with_gil(&self.inner, |i| {
            i.clear(replica, medium);
            Ok(())
        })
    }

    /// Forgets replica `replica` and everything it holds.
    fn remove_replica(&self, replica: &Bound<'_, PyAny>) -> PyResult<()> {
        let replica = arg(replica, "replica")?;
        locked_with_gil(&self.inner, |i| {
            i.remove_replica(replica);
            Ok(())
        })
    }

    /// The `(block_hash, medium)` pairs replica `replica` holds, in no order.
    fn blocks_of(&self, replica: &Bound<'_, PyAny>) -> PyResult<Vec<(BlockHash, &'static str)>> {
        let replica = arg(replica, "replica")?;
        locked_with_gil(&self.inner, |i| {
            Ok(i.blocks_of(replica)
                .into_iter()
                .map(|(h, m)| (h, m.name()))
                .collect())
        })
    }

    /// `(replica, ram_blocks, disk_blocks)` for each replica holding the first reusable block of
    /// `token_ids` (hashed under `cache_salt` as the block manager hashes it), by replica id: its
    /// leading `ram_blocks` in RAM, then `disk_blocks` more held in some medium. The block of the
    /// last token never counts (a hit never covers it). Raises InvalidArgumentError unless
    /// `block_size` is positive.
    #[pyo3(signature = (token_ids, block_size, cache_salt=None))]
    fn longest_prefixes(
        &self,
        token_ids: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<(ReplicaId, usize, usize)>> {
        let tokens: Vec<TokenId> = arg(token_ids, "token_ids")?;
        let block_size: usize = arg(block_size, "block_size")?;
        let salt = opt::<String>(cache_salt, "cache_salt")?;
        let runs = locked_with_gil(&self.inner, |i| {
            i.longest_prefixes(&tokens, block_size, salt.as_deref().map(str::as_bytes))
        })?;
        Ok(runs
            .into_iter()
            .map(|r| (r.replica, r.ram_blocks, r.disk_blocks))
            .collect())
    }
}
