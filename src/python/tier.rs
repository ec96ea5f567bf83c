//! What the `Scheduler` binding shows of a KV tier: KV events as tuples, the blocks held, the
//! tier's figures in `stats()`, and opening the disk tier over a `KVCache`. The methods themselves
//! are `PyScheduler`'s (`scheduler.rs`); this module holds their conversions.

use std::path::Path;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::memory::events::{KvEvent, Medium};
use crate::memory::prefix_cache::BlockHash;
use crate::scheduler::{Scheduler, SchedulerStats};
use crate::store::kv_cache::KvBlockIo;
use crate::tier::disk::{DiskTier, DiskTierConfig, Opened};
use crate::tier::TierCounters;

/// An event as `("stored", hash, parent, token_ids, medium)`, `("removed", hash, medium)` or
/// `("cleared", medium)`.
fn event<'py>(py: Python<'py>, event: &KvEvent) -> PyResult<Bound<'py, PyTuple>> {
    match event {
        KvEvent::BlockStored {
            hash,
            parent,
            tokens,
            medium,
        } => ("stored", *hash, *parent, tokens.clone(), medium.name()).into_pyobject(py),
        KvEvent::BlockRemoved { hash, medium } => {
            ("removed", *hash, medium.name()).into_pyobject(py)
        }
        KvEvent::AllBlocksCleared { medium } => ("cleared", medium.name()).into_pyobject(py),
    }
}

/// Events as a list of tuples (see `event`).
pub fn events<'py>(py: Python<'py>, events: &[KvEvent]) -> PyResult<Bound<'py, PyList>> {
    let items = events
        .iter()
        .map(|e| event(py, e))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

/// Blocks as `(hash, medium)` tuples.
pub fn blocks<'py>(
    py: Python<'py>,
    blocks: &[(BlockHash, Medium)],
) -> PyResult<Bound<'py, PyList>> {
    PyList::new(
        py,
        blocks.iter().map(|&(hash, medium)| (hash, medium.name())),
    )
}

/// Adds the tier's figures (`disk_*` keys) to a `stats()` dict: the manager's counts from `s`,
/// the tier's own from `tier` (the live tier's, or those it had when detached).
pub fn add_stats(
    dict: &Bound<'_, PyDict>,
    s: &SchedulerStats,
    tier: &TierCounters,
) -> PyResult<()> {
    dict.set_item("disk_hits", s.tier_hit_blocks)?;
    dict.set_item("disk_hit_tokens", s.tier_hit_tokens)?;
    dict.set_item("disk_loads", tier.loads)?;
    dict.set_item("disk_loads_dropped", s.loads_dropped)?;
    dict.set_item("disk_dropped_corrupt", tier.dropped_corrupt)?;
    dict.set_item("disk_load_misses", tier.load_misses)?;
    dict.set_item("disk_offloads_issued", s.offloads_issued)?;
    dict.set_item("disk_offloads", tier.offloads)?;
    dict.set_item("disk_offloads_lost", tier.offloads_lost)?;
    dict.set_item(
        "disk_evictions_without_offload",
        s.evictions_without_offload,
    )?;
    dict.set_item("disk_evictions", tier.evictions)?;
    dict.set_item("disk_bytes_written", tier.bytes_written)?;
    dict.set_item("disk_bytes_read", tier.bytes_read)?;
    dict.set_item("disk_blocks", tier.blocks)?;
    dict.set_item("disk_jobs_in_flight", tier.jobs_in_flight)?;
    Ok(())
}

/// What opening found, as a dict.
pub fn opened<'py>(py: Python<'py>, opened: &Opened) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("recovered", opened.recovered)?;
    dict.set_item("cleared", opened.cleared)?;
    Ok(dict)
}

/// Opens the disk tier in `dir` over the blocks of `kv` and attaches it to `s`, its eviction
/// order the scheduler's. Fails, attaching nothing, as `DiskTier::open` and
/// `Scheduler::attach_tier` do (a tier opened and then refused is closed again).
pub fn attach_disk_tier(
    s: &mut Scheduler,
    dir: &Path,
    kv: KvBlockIo,
    capacity_bytes: u64,
    identity: Vec<u8>,
) -> crate::Result<Opened> {
    let config = DiskTierConfig {
        identity,
        capacity_bytes,
        policy: s.config().eviction_policy,
    };
    crate::error::ensure(kv.shape().block_size == s.config().block_size, || {
        format!(
            "the KV cache has blocks of {} tokens, the scheduler {}",
            kv.shape().block_size,
            s.config().block_size
        )
    })?;
    // SAFETY: the scheduler's block manager drives the tier by the protocol of `crate::tier`, and
    // the engine keeps to it as the binding's documented contract demands (`_core.pyi`,
    // `Scheduler.attach_disk_tier`): K/V are written only at the slots of a step's `slot_mapping`
    // and read only through its block tables, which never hold a block being offloaded or loaded.
    let (tier, opened) = unsafe { DiskTier::open(dir, config, kv, s.tier_link())? };
    s.attach_tier(Box::new(tier))?;
    Ok(opened)
}
