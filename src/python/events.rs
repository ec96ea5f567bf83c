//! The KV events as Python sees them: `BlockStored`, `BlockRemoved` and `AllBlocksCleared`,
//! frozen classes made straight from the core's `KvEvent` (one shape from the block manager to
//! the router: no tuple or dataclass in between). Each compares and hashes by value, pickles (a
//! replica's events cross to the front end through Ray), and refuses a medium other than "ram" or
//! "disk" when made by hand. A block event names its KV cache group (`group`, 0 unless the model
//! has several: `crate::memory::events`); its repr shows it only when not 0.

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::args::{arg, opt};
use super::errors::IntoPyResult;
use crate::ids::TokenId;
use crate::memory::events::{KvEvent, Medium};
use crate::memory::prefix_cache::{BlockHash, BlockKey};

fn medium(name: &Bound<'_, PyAny>) -> PyResult<Medium> {
    let name: String = arg(name, "medium")?;
    Medium::from_name(&name).py_err()
}

/// ", group=N" for a group other than 0 (reprs of one-group models stay as they were).
fn group_suffix(group: u32) -> String {
    match group {
        0 => String::new(),
        g => format!(", group={g}"),
    }
}

/// The block of prefix hash `block_hash` (after `parent_block_hash`, holding `token_ids`), of KV
/// cache group `group`, is now findable in `medium`.
#[pyclass(name = "BlockStored", module = "pagedkv", frozen, eq, hash)]
#[derive(PartialEq, Eq, Hash)]
pub struct PyBlockStored {
    key: BlockKey,
    medium: Medium,
    #[pyo3(get)]
    group: u32,
}

#[pymethods]
impl PyBlockStored {
    #[new]
    #[pyo3(signature = (block_hash, parent_block_hash, token_ids, medium, group=None))]
    fn new(
        block_hash: &Bound<'_, PyAny>,
        parent_block_hash: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        medium: &Bound<'_, PyAny>,
        group: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let tokens: Vec<TokenId> = arg(token_ids, "token_ids")?;
        Ok(PyBlockStored {
            key: BlockKey {
                hash: arg(block_hash, "block_hash")?,
                parent: arg(parent_block_hash, "parent_block_hash")?,
                tokens: tokens.into(),
            },
            medium: self::medium(medium)?,
            group: opt(group, "group")?.unwrap_or(0),
        })
    }

    #[getter]
    fn block_hash(&self) -> BlockHash {
        self.key.hash
    }

    #[getter]
    fn parent_block_hash(&self) -> BlockHash {
        self.key.parent
    }

    /// The block's tokens.
    #[getter]
    fn token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.key.tokens.iter())
    }

    #[getter]
    fn medium(&self) -> &'static str {
        self.medium.name()
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let e = slf.get();
        let args = (
            e.key.hash,
            e.key.parent,
            e.token_ids(slf.py())?,
            e.medium.name(),
            e.group,
        );
        Ok((slf.get_type().into_any(), args.into_pyobject(slf.py())?))
    }

    fn __repr__(&self) -> String {
        let tokens: Vec<String> = self.key.tokens.iter().map(u32::to_string).collect();
        let comma = if tokens.len() == 1 { "," } else { "" };
        format!(
            "BlockStored(block_hash={}, parent_block_hash={}, token_ids=({}{comma}), medium='{}'{})",
            self.key.hash,
            self.key.parent,
            tokens.join(", "),
            self.medium.name(),
            group_suffix(self.group)
        )
    }
}

/// The block of prefix hash `block_hash`, of KV cache group `group`, is no longer findable in
/// `medium`.
#[pyclass(name = "BlockRemoved", module = "pagedkv", frozen, eq, hash)]
#[derive(PartialEq, Eq, Hash)]
pub struct PyBlockRemoved {
    #[pyo3(get)]
    block_hash: BlockHash,
    medium: Medium,
    #[pyo3(get)]
    group: u32,
}

#[pymethods]
impl PyBlockRemoved {
    #[new]
    #[pyo3(signature = (block_hash, medium, group=None))]
    fn new(
        block_hash: &Bound<'_, PyAny>,
        medium: &Bound<'_, PyAny>,
        group: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Ok(PyBlockRemoved {
            block_hash: arg(block_hash, "block_hash")?,
            medium: self::medium(medium)?,
            group: opt(group, "group")?.unwrap_or(0),
        })
    }

    #[getter]
    fn medium(&self) -> &'static str {
        self.medium.name()
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let e = slf.get();
        let args = (e.block_hash, e.medium.name(), e.group);
        Ok((slf.get_type().into_any(), args.into_pyobject(slf.py())?))
    }

    fn __repr__(&self) -> String {
        format!(
            "BlockRemoved(block_hash={}, medium='{}'{})",
            self.block_hash,
            self.medium.name(),
            group_suffix(self.group)
        )
    }
}

/// No block is findable in `medium` any more.
#[pyclass(name = "AllBlocksCleared", module = "pagedkv", frozen, eq, hash)]
#[derive(PartialEq, Eq, Hash)]
pub struct PyAllBlocksCleared {
    medium: Medium,
}

#[pymethods]
impl PyAllBlocksCleared {
    #[new]
    fn new(medium: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyAllBlocksCleared {
            medium: self::medium(medium)?,
        })
    }

    #[getter]
    fn medium(&self) -> &'static str {
        self.medium.name()
    }

    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyTuple>)> {
        let args = (slf.get().medium.name(),);
        Ok((slf.get_type().into_any(), args.into_pyobject(slf.py())?))
    }

    fn __repr__(&self) -> String {
        format!("AllBlocksCleared(medium='{}')", self.medium.name())
    }
}

/// A core event as its Python class.
fn event<'py>(py: Python<'py>, event: &KvEvent) -> PyResult<Bound<'py, PyAny>> {
    Ok(match event {
        KvEvent::BlockStored { key, medium, group } => Bound::new(
            py,
            PyBlockStored {
                key: key.clone(),
                medium: *medium,
                group: *group,
            },
        )?
        .into_any(),
        KvEvent::BlockRemoved {
            hash,
            medium,
            group,
        } => Bound::new(
            py,
            PyBlockRemoved {
                block_hash: *hash,
                medium: *medium,
                group: *group,
            },
        )?
        .into_any(),
        KvEvent::AllBlocksCleared { medium } => {
            Bound::new(py, PyAllBlocksCleared { medium: *medium })?.into_any()
        }
    })
}

/// Events as a list of their Python classes, in order.
pub fn events<'py>(py: Python<'py>, events: &[KvEvent]) -> PyResult<Bound<'py, PyList>> {
    let items = events
        .iter()
        .map(|e| event(py, e))
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, items)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyBlockStored>()?;
    m.add_class::<PyBlockRemoved>()?;
    m.add_class::<PyAllBlocksCleared>()?;
    Ok(())
}
