//! `pagedkv.BlockManager`: the block pool, prefix cache and block tables of one model.
//!
//! Every argument goes through `args`, every call through `sync::locked`; the logic is the core's.

use std::sync::Mutex;

use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{arg, opt, Param};
use super::sync::{detached, locked};
use crate::ids::{SeqId, TokenId};
use crate::memory::block_manager::DEFAULT_BLOCK_SIZE;
use crate::memory::block_manager::{BlockManager, BlockStats};

/// Paged KV block manager: allocates fixed-size blocks to sequences, shares full blocks between
/// sequences with equal prefixes, and copies shared blocks on write. Thread-safe.
#[pyclass(name = "BlockManager", module = "pagedkv", frozen)]
pub struct PyBlockManager {
    inner: Mutex<BlockManager>,
}

impl PyBlockManager {
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut BlockManager) -> crate::error::Result<T> + Send,
    ) -> PyResult<T> {
        locked(py, &self.inner, f)
    }
}

/// A prompt and its optional cache salt, as the core takes them.
fn prompt(
    token_ids: &Bound<'_, PyAny>,
    cache_salt: Option<&Bound<'_, PyAny>>,
) -> PyResult<(Vec<TokenId>, Option<String>)> {
    Ok((arg(token_ids, "token_ids")?, opt(cache_salt, "cache_salt")?))
}

#[pymethods]
impl PyBlockManager {
    /// Creates a manager of `num_blocks` blocks of `block_size` tokens.
    #[new]
    #[pyo3(
        signature = (num_blocks, block_size=Param::Absent, enable_prefix_caching=Param::Absent),
        text_signature = "(num_blocks, block_size=16, enable_prefix_caching=True)"
    )]
    fn new(
        py: Python<'_>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: Param<'_>,
        enable_prefix_caching: Param<'_>,
    ) -> PyResult<Self> {
        let (num_blocks, block_size, caching) = (
            arg(num_blocks, "num_blocks")?,
            block_size.or("block_size", DEFAULT_BLOCK_SIZE)?,
            enable_prefix_caching.or("enable_prefix_caching", true)?,
        );
        let manager = detached(py, || BlockManager::new(num_blocks, block_size, caching))?;
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
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let seq: SeqId = arg(seq_id, "seq_id")?;
        let (tokens, salt) = prompt(token_ids, cache_salt)?;
        self.with(py, |m| {
            m.allocate(seq, &tokens, salt.as_deref().map(str::as_bytes))
        })
    }

    /// Whether `allocate` of `token_ids` would succeed now (counting evictable prefix hits).
    #[pyo3(signature = (token_ids, cache_salt=None))]
    fn can_allocate(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let (tokens, salt) = prompt(token_ids, cache_salt)?;
        self.with(py, |m| {
            Ok(m.can_allocate(&tokens, salt.as_deref().map(str::as_bytes)))
        })
    }

    /// Number of leading tokens of `token_ids` that `allocate` would serve from the cache.
    #[pyo3(signature = (token_ids, cache_salt=None))]
    fn cached_prefix_len(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        cache_salt: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let (tokens, salt) = prompt(token_ids, cache_salt)?;
        self.with(py, |m| {
            Ok(m.match_prefix(&tokens, salt.as_deref().map(str::as_bytes))
                .num_cached_tokens())
        })
    }

    /// Gives `token_ids` slots at the end of `seq_id`. Returns the copy-on-write op `(src, dst)`
    /// to apply to the KV cache first when the tail block was shared, else None.
    fn append(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(u32, u32)>> {
        let seq: SeqId = arg(seq_id, "seq_id")?;
        let tokens: Vec<TokenId> = arg(token_ids, "token_ids")?;
        let copy = self.with(py, |m| m.append(seq, &tokens))?;
        Ok(copy.map(|op| (op.src, op.dst)))
    }

    /// Makes `child_id` share every block of `parent_id` (copy-on-write on the next append).
    fn fork(
        &self,
        py: Python<'_>,
        parent_id: &Bound<'_, PyAny>,
        child_id: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (parent, child) = (arg(parent_id, "parent_id")?, arg(child_id, "child_id")?);
        self.with(py, |m| m.fork(parent, child))
    }

    /// Releases the blocks of `seq_id` wholly before token position `first_needed` (what a
    /// sliding window no longer reads; hashed ones stay cached); their entries become -1.
    /// Returns how many were released.
    fn release_before(
        &self,
        py: Python<'_>,
        seq_id: &Bound<'_, PyAny>,
        first_needed: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let seq: SeqId = arg(seq_id, "seq_id")?;
        let first: usize = arg(first_needed, "first_needed")?;
        self.with(py, |m| m.release_before(seq, first))
    }

    /// Frees `seq_id`; its full blocks stay cached for later prefix hits, tail block evicted first.
    fn free(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let seq: SeqId = arg(seq_id, "seq_id")?;
        self.with(py, |m| m.free(seq))
    }

    /// Physical block ids of `seq_id`, in logical order (int32).
    fn block_table<'py>(
        &self,
        py: Python<'py>,
        seq_id: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let seq: SeqId = arg(seq_id, "seq_id")?;
        let blocks = self.with(py, |m| Ok(m.table(seq)?.entries().collect::<Vec<_>>()))?;
        Ok(PyArray1::from_vec(py, blocks))
    }

    /// Tokens with a slot in `seq_id`.
    fn num_tokens(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<usize> {
        let seq: SeqId = arg(seq_id, "seq_id")?;
        self.with(py, |m| Ok(m.table(seq)?.num_tokens()))
    }

    /// The token ids of `seq_id`.
    fn token_ids(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        let seq: SeqId = arg(seq_id, "seq_id")?;
        self.with(py, |m| Ok(m.table(seq)?.tokens().to_vec()))
    }

    /// Block tables of `seq_ids` as one int32 array `[len(seq_ids), max_blocks]`, padded with -1.
    fn block_tables<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let seqs: Vec<SeqId> = arg(seq_ids, "seq_ids")?;
        let (width, data) = self.with(py, |m| {
            let mut out = Vec::new();
            m.batch_block_tables(&seqs, 0, &mut out).map(|w| (w, out))
        })?;
        PyArray1::from_vec(py, data).reshape([seqs.len(), width])
    }

    /// Cache slots (int64, block × block_size + offset) of the last `num_new_tokens[i]` tokens of
    /// each `seq_ids[i]`, concatenated: the slot mapping of one step.
    fn slot_mapping<'py>(
        &self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        num_new_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let seqs: Vec<SeqId> = arg(seq_ids, "seq_ids")?;
        let counts: Vec<usize> = arg(num_new_tokens, "num_new_tokens")?;
        let slots = self.with(py, |m| m.slot_mapping(&seqs, &counts))?;
        Ok(PyArray1::from_vec(py, slots))
    }

    /// Occupancy and activity counters as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s: BlockStats = self.with(py, |m| Ok(m.stats()))?;
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
        dict.set_item("window_released_blocks", s.window_released_blocks)?;
        Ok(dict)
    }

    /// Raises AssertionError naming the first broken invariant of the pool or the tables.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |m| Ok(m.check_invariants()))?
            .map_err(pyo3::exceptions::PyAssertionError::new_err)
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |m| Ok(m.block_size()))
    }

    /// Total blocks.
    #[getter]
    fn num_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |m| Ok(m.num_blocks()))
    }

    /// Blocks an allocation can obtain now: clean plus evictable cached blocks.
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |m| Ok(m.num_available_blocks()))
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.with(py, |m| Ok(m.num_sequences()))
    }

    /// Membership never raises for the key: anything that is not a valid sequence id (a
    /// negative int, one of 2**64 or more, a non-int) is simply not in the manager.
    fn __contains__(&self, py: Python<'_>, seq_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        match arg::<SeqId>(seq_id, "seq_id") {
            Ok(seq) => self.with(py, |m| Ok(m.contains(seq))),
            Err(_) => Ok(false),
        }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let s = self.with(py, |m| Ok(m.stats()))?;
        Ok(format!(
            "BlockManager(num_blocks={}, used={}, cached={}, free={})",
            s.num_blocks, s.used_blocks, s.cached_blocks, s.free_blocks
        ))
    }
}
