//! What the `Scheduler` binding shows of a KV tier: KV events as tuples, the blocks held, the
//! tier's figures in `stats()`, what opening the disk tier found. The methods themselves are
//! `PyScheduler`'s (`scheduler.rs`); this module holds their conversions.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::memory::events::{KvEvent, Medium};
use crate::memory::prefix_cache::BlockHash;
use crate::scheduler::SchedulerStats;
use crate::tier::disk::Opened;
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
