//! `pagedkv.BlockManager`: the block pool, prefix cache and block tables of one model.

use std::sync::Mutex;

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{non_negative, positive, token_ids};
use super::errors::IntoPyResult;
use crate::{BlockManager, Error, SeqId};

/// Paged KV block manager: allocates fixed-size blocks to sequences, shares full blocks between
/// sequences with equal prefixes, and copies shared blocks on write. Thread-safe.
#[pyclass(name = "BlockManager", module = "pagedkv", frozen)]
pub struct PyBlockManager {
    inner: Mutex<BlockManager>,
}

impl PyBlockManager {
    fn with<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut BlockManager) -> T + Send) -> T {
        py.detach(|| {
            f(&mut self
                .inner
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()))
        })
    }
}

fn seq_id(value: i64) -> PyResult<SeqId> {
    non_negative(value, "seq_id")
}

#[pymethods]
impl PyBlockManager {
    /// Creates a manager of `num_blocks` blocks of `block_size` tokens.
    #[new]
    #[pyo3(signature = (num_blocks, block_size=16, enable_prefix_caching=true))]
    fn new(num_blocks: i64, block_size: i64, enable_prefix_caching: bool) -> PyResult<Self> {
        let manager = BlockManager::new(
            positive(num_blocks, "num_blocks")?,
            positive(block_size, "block_size")?,
            enable_prefix_caching,
        )
        .py_err()?;
        Ok(PyBlockManager {
            inner: Mutex::new(manager),
        })
    }

    /// Creates sequence `seq_id` holding `token_ids`, reusing cached prefix blocks. Returns how
    /// many leading tokens were served from the cache (a multiple of the block size, never all).
    #[pyo3(signature = (seq_id, token_ids, cache_salt=None))]
    fn allocate(
        &self,
        py: Python<'_>,
        seq_id: i64,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<String>,
    ) -> PyResult<usize> {
        let (seq, tokens) = (
            self::seq_id(seq_id)?,
            self::token_ids(token_ids, "token_ids")?,
        );
        self.with(py, |m| {
            m.allocate(seq, &tokens, cache_salt.as_deref().map(str::as_bytes))
        })
        .py_err()
    }

    /// Whether `allocate` of `token_ids` would succeed now (counting evictable prefix hits).
    #[pyo3(signature = (token_ids, cache_salt=None))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<String>,
    ) -> PyResult<bool> {
        let tokens = self::token_ids(token_ids, "token_ids")?;
        Ok(self.with(py, |m| {
            let found = m.match_prefix(&tokens, cache_salt.as_deref().map(str::as_bytes));
            m.blocks_to_admit(&found, tokens.len()) <= m.num_available_blocks()
        }))
    }

    /// Number of leading tokens of `token_ids` that `allocate` would serve from the cache.
    #[pyo3(signature = (token_ids, cache_salt=None))]
    fn cached_prefix_len(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<String>,
    ) -> PyResult<usize> {
        let tokens = self::token_ids(token_ids, "token_ids")?;
        Ok(self.with(py, |m| {
            m.match_prefix(&tokens, cache_salt.as_deref().map(str::as_bytes))
                .num_cached_tokens(m.block_size())
        }))
    }

    /// Gives `token_ids` slots at the end of `seq_id`. Returns the copy-on-write op `(src, dst)`
    /// to apply to the KV cache first when the tail block was shared, else None.
    fn append(
        &self,
        py: Python<'_>,
        seq_id: i64,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(u32, u32)>> {
        let (seq, tokens) = (
            self::seq_id(seq_id)?,
            self::token_ids(token_ids, "token_ids")?,
        );
        let copy = self.with(py, |m| m.append(seq, &tokens)).py_err()?;
        Ok(copy.map(|op| (op.src, op.dst)))
    }

    /// Makes `child_id` share every block of `parent_id` (copy-on-write on the next append).
    fn fork(&self, py: Python<'_>, parent_id: i64, child_id: i64) -> PyResult<()> {
        let (parent, child) = (seq_id(parent_id)?, seq_id(child_id)?);
        self.with(py, |m| m.fork(parent, child)).py_err()
    }

    /// Frees `seq_id`; its full blocks stay cached for later prefix hits, tail block evicted first.
    fn free(&self, py: Python<'_>, seq_id: i64) -> PyResult<()> {
        let seq = self::seq_id(seq_id)?;
        self.with(py, |m| m.free(seq)).py_err()
    }

    /// Physical block ids of `seq_id`, in logical order (int32).
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: i64,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let seq = self::seq_id(seq_id)?;
        let blocks = self.with(py, |m| {
            m.table(seq)
                .map(|t| t.blocks().iter().map(|&b| b as i32).collect::<Vec<_>>())
        });
        Ok(PyArray1::from_vec(py, blocks.py_err()?))
    }

    /// Tokens with a slot in `seq_id`.
    fn num_tokens(&self, py: Python<'_>, seq_id: i64) -> PyResult<usize> {
        let seq = self::seq_id(seq_id)?;
        self.with(py, |m| m.table(seq).map(|t| t.num_tokens()))
            .py_err()
    }

    /// The token ids of `seq_id`.
    fn token_ids(&self, py: Python<'_>, seq_id: i64) -> PyResult<Vec<u32>> {
        let seq = self::seq_id(seq_id)?;
        self.with(py, |m| m.table(seq).map(|t| t.tokens().to_vec()))
            .py_err()
    }

    /// Block tables of `seq_ids` as one int32 array `[len(seq_ids), max_blocks]`, padded with -1.
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Vec<i64>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let seqs = seq_ids
            .into_iter()
            .map(seq_id)
            .collect::<PyResult<Vec<_>>>()?;
        let (width, data) = self
            .with(py, |m| {
                let mut out = Vec::new();
                m.batch_block_tables(&seqs, 0, &mut out).map(|w| (w, out))
            })
            .py_err()?;
        let array = PyArray1::from_vec(py, data);
        array.reshape([seqs.len(), width])
    }

    /// Cache slots (int64, block × block_size + offset) of the last `num_new_tokens[i]` tokens of
    /// each `seq_ids[i]`, concatenated: the slot mapping of one step.
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq_ids: Vec<i64>,
        num_new_tokens: Vec<i64>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        if seq_ids.len() != num_new_tokens.len() {
            return Err(super::args::shape_error(format!(
                "{} seq_ids but {} num_new_tokens",
                seq_ids.len(),
                num_new_tokens.len()
            )));
        }
        let seqs = seq_ids
            .into_iter()
            .map(seq_id)
            .collect::<PyResult<Vec<_>>>()?;
        let counts = num_new_tokens
            .into_iter()
            .map(|n| non_negative(n, "num_new_tokens"))
            .collect::<PyResult<Vec<_>>>()?;
        let slots = self.with(py, |m| -> crate::Result<Vec<i64>> {
            let mut out = Vec::new();
            for (&seq, &count) in seqs.iter().zip(&counts) {
                let table = m.table(seq)?;
                let end = table.num_tokens();
                let start = end.checked_sub(count as usize).ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "sequence {seq} has {end} tokens, fewer than {count}"
                    ))
                })?;
                table.extend_slots(start, end, m.block_size(), &mut out);
            }
            Ok(out)
        });
        Ok(PyArray1::from_vec(py, slots.py_err()?))
    }

    /// Occupancy and activity counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, |m| m.stats());
        let dict = PyDict::new(py);
        dict.set_item("num_blocks", s.num_blocks)?;
        dict.set_item("free_blocks", s.free_blocks)?;
        dict.set_item("cached_blocks", s.cached_blocks)?;
        dict.set_item("used_blocks", s.used_blocks)?;
        dict.set_item("usage", s.usage)?;
        dict.set_item("prefix_queried_tokens", s.prefix_queried_tokens)?;
        dict.set_item("prefix_hit_tokens", s.prefix_hit_tokens)?;
        dict.set_item("allocations", s.allocations)?;
        dict.set_item("evictions", s.evictions)?;
        dict.set_item("cow_copies", s.cow_copies)?;
        Ok(dict)
    }

    /// Raises AssertionError naming the first broken invariant of the pool or the tables.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |m| m.check_invariants())
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self, py: Python<'_>) -> usize {
        self.with(py, |m| m.block_size())
    }

    /// Total blocks.
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> usize {
        self.with(py, |m| m.num_blocks())
    }

    /// Blocks an allocation can obtain now: clean plus evictable cached blocks.
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> usize {
        self.with(py, |m| m.num_available_blocks())
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.with(py, |m| m.num_sequences())
    }

    fn __contains__(&self, py: Python<'_>, seq_id: i64) -> bool {
        u64::try_from(seq_id).is_ok_and(|seq| self.with(py, |m| m.contains(seq)))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let s = self.with(py, |m| m.stats());
        format!(
            "BlockManager(num_blocks={}, used={}, cached={}, free={})",
            s.num_blocks, s.used_blocks, s.cached_blocks, s.free_blocks
        )
    }
}
