//! What the `Scheduler` binding shows of a KV tier: the blocks held and what opening the disk
//! tier found. The methods themselves are
//! `PyScheduler`'s (`scheduler.rs`); this module holds their conversions.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::memory::events::Medium;
use crate::memory::prefix_cache::BlockHash;
use crate::tier::disk::Opened;

/// The blocks of KV cache group `group` (every group's: None) as `(hash, medium)` tuples.
pub fn blocks<'py>(
    py: Python<'py>,
    blocks: &[(BlockHash, Medium, u32)],
    group: Option<u32>,
) -> PyResult<Bound<'py, PyList>> {
    let of_group = blocks
        .iter()
        .filter(|&&(_, _, g)| group.is_none_or(|wanted| g == wanted));
    PyList::new(py, of_group.map(|&(hash, medium, _)| (hash, medium.name())))
}

/// What opening found, as a dict.
pub fn opened<'py>(py: Python<'py>, opened: &Opened) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("recovered", opened.recovered)?;
    dict.set_item("cleared", opened.cleared)?;
    Ok(dict)
}
