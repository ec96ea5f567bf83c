//! `pagedkv.KVCache`: K/V storage of every layer, in `[num_blocks, num_kv_heads, block_size,
//! head_dim]` tiles, f32/f16/bf16. Arrays are read in C order whatever their layout; ids and
//! pairs come as numpy arrays or Python sequences alike. The core validates every value.

use std::sync::RwLock;

use numpy::ndarray::{Ix1, Ix3};
use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::args::{
    c_order, expect_shape, invalid, non_negative, positive, shape_error, typed_array,
};
use super::attention_call::{Arrays, Tables};
use super::errors::IntoPyResult;
use crate::{CopyOp, KvCache, KvDtype, KvShape};

/// Paged K/V storage for all layers of a model, owned by Rust. Token slot `s` is row
/// `s % block_size` of block `s // block_size`. Thread-safe.
#[pyclass(name = "KVCache", module = "pagedkv", frozen)]
pub struct PyKVCache {
    pub(crate) inner: RwLock<KvCache>,
    shape: KvShape,
}

type F32Array<'py, D> = numpy::PyReadonlyArray<'py, f32, D>;

impl PyKVCache {
    pub(crate) fn read<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&KvCache) -> T + Send) -> T {
        py.detach(|| {
            f(&self
                .inner
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner()))
        })
    }

    pub(crate) fn shape(&self) -> KvShape {
        self.shape
    }

    fn write_lock<T: Send>(&self, py: Python<'_>, f: impl FnOnce(&mut KvCache) -> T + Send) -> T {
        py.detach(|| {
            f(&mut self
                .inner
                .write()
                .unwrap_or_else(|poisoned| poisoned.into_inner()))
        })
    }

    fn to_array<'py>(
        &self,
        py: Python<'py>,
        data: Vec<f32>,
        rows: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let s = self.shape;
        Ok(PyArray1::from_vec(py, data)
            .reshape([rows, s.num_kv_heads, s.head_dim])?
            .into_any())
    }
}

#[pymethods]
impl PyKVCache {
    /// Allocates zeroed K and V storage for `num_layers` layers. Raises InvalidArgumentError for
    /// sizes the cache cannot address (see `KvShape`), MemoryError when memory cannot be had.
    #[new]
    #[pyo3(signature = (num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype="float32"))]
    fn new(
        num_layers: i64,
        num_blocks: i64,
        block_size: i64,
        num_kv_heads: i64,
        head_dim: i64,
        dtype: &str,
    ) -> PyResult<Self> {
        let shape = KvShape {
            num_layers: positive(num_layers, "num_layers")?,
            num_blocks: positive(num_blocks, "num_blocks")?,
            block_size: positive(block_size, "block_size")?,
            num_kv_heads: positive(num_kv_heads, "num_kv_heads")?,
            head_dim: positive(head_dim, "head_dim")?,
        };
        let dtype: KvDtype = dtype.parse().py_err()?;
        let cache = KvCache::new(shape, dtype).py_err()?;
        Ok(PyKVCache {
            inner: RwLock::new(cache),
            shape,
        })
    }

    /// Stores `keys[i]` and `values[i]` (float32 `[n, num_kv_heads, head_dim]`) at
    /// `slot_mapping[i]` (int64 `[n]`) of `layer`, converting to the cache dtype. Raises
    /// InvalidArgumentError, writing nothing, for a value the dtype does not store as a finite
    /// number (NaN, infinity, beyond ±65504 in float16).
    fn write(
        &self,
        py: Python<'_>,
        layer: i64,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        slot_mapping: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let layer = non_negative(layer, "layer")? as usize;
        let keys: F32Array<'_, Ix3> = typed_array(keys, "keys", "float32")?;
        let values: F32Array<'_, Ix3> = typed_array(values, "values", "float32")?;
        let slots: numpy::PyReadonlyArray<'_, i64, Ix1> =
            typed_array(slot_mapping, "slot_mapping", "int64")?;
        let row = [
            Some(slots.as_array().len()),
            Some(self.shape.num_kv_heads),
            Some(self.shape.head_dim),
        ];
        expect_shape(keys.shape(), &row, "keys")?;
        expect_shape(values.shape(), &row, "values")?;
        let (keys, values, slots) = (c_order(&keys)?, c_order(&values)?, c_order(&slots)?);
        self.write_lock(py, |c| c.write(layer, &keys, &values, &slots))
            .py_err()
    }

    /// Copies whole blocks `src → dst` in every layer, in order: apply a step's copy-on-write ops
    /// before its attention runs. `ops` is a step's `copy_ops` (int64 `[C, 2]`) or any sequence
    /// of `(src, dst)` pairs.
    fn copy_blocks(&self, py: Python<'_>, ops: &Bound<'_, PyAny>) -> PyResult<()> {
        let ops = copy_ops(ops)?;
        self.write_lock(py, |c| c.copy_blocks(&ops)).py_err()
    }

    /// Reads the first `num_tokens` K and V rows of a sequence through `block_table` (a 1-D
    /// integer array, e.g. a row of a step's `block_tables`, or a sequence of ints; entries past
    /// the used blocks are padding and never read), as float32 arrays `[num_tokens,
    /// num_kv_heads, head_dim]`.
    fn gather<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        block_table: &Bound<'py, PyAny>,
        num_tokens: i64,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let layer = non_negative(layer, "layer")? as usize;
        let n = non_negative(num_tokens, "num_tokens")? as usize;
        let table = block_ids(block_table)?;
        let (k, v) = self.read(py, |c| c.gather(layer, &table, n)).py_err()?;
        Ok((self.to_array(py, k, n)?, self.to_array(py, v, n)?))
    }

    /// Attention of `query` (float32 `[num_tokens, num_heads, head_dim]`) over `layer`, reading
    /// K/V through `block_tables` (int32 `[num_seqs, max_blocks_per_seq]`, padding never read).
    /// Sequence i owns query rows `query_start_loc[i]:query_start_loc[i + 1]` (int32
    /// `[num_seqs + 1]`) and `context_lens[i]` (int32) tokens of cache including those new tokens;
    /// its query j attends causally to keys `0..=context_lens[i] - nq + j`. `scale` defaults to
    /// `1/sqrt(head_dim)`; `kernel` forces "avx2" or "portable". Returns a new float32 array
    /// shaped like `query`. Releases the GIL while computing.
    #[pyo3(signature = (layer, query, block_tables, context_lens, query_start_loc, scale=None, kernel=None))]
    #[allow(clippy::too_many_arguments)]
    fn attention<'py>(
        &self,
        py: Python<'py>,
        layer: i64,
        query: &Bound<'py, PyAny>,
        block_tables: &Bound<'py, PyAny>,
        context_lens: &Bound<'py, PyAny>,
        query_start_loc: &Bound<'py, PyAny>,
        scale: Option<f64>,
        kernel: Option<&str>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let layer = non_negative(layer, "layer")? as usize;
        let arrays = Arrays::extract(query, context_lens, query_start_loc)?;
        let tables = Tables::extract(block_tables)?;
        let call = arrays.call(self.shape.head_dim, scale, kernel)?;
        let (tables, width) = tables.rows()?;
        let mut out = call.out()?;
        self.read(py, |c| call.run_paged(c, layer, &tables, width, &mut out))
            .py_err()?;
        call.output(py, out)
    }

    /// Overwrites every K and V element with pseudo-random values in [-1, 1) from `seed`
    /// (benchmarks: real data in every page).
    fn fill_random(&self, py: Python<'_>, seed: u64) {
        self.write_lock(py, |c| c.fill_random(seed))
    }

    /// Layers.
    #[getter]
    fn num_layers(&self) -> usize {
        self.shape.num_layers
    }

    /// Blocks per layer.
    #[getter]
    fn num_blocks(&self) -> usize {
        self.shape.num_blocks
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.shape.block_size
    }

    /// K/V heads.
    #[getter]
    fn num_kv_heads(&self) -> usize {
        self.shape.num_kv_heads
    }

    /// Elements per head.
    #[getter]
    fn head_dim(&self) -> usize {
        self.shape.head_dim
    }

    /// Storage dtype name: "float32", "float16" or "bfloat16".
    #[getter]
    fn dtype(&self, py: Python<'_>) -> &'static str {
        self.read(py, |c| c.dtype().name())
    }

    /// Bytes of K and V storage.
    #[getter]
    fn nbytes(&self, py: Python<'_>) -> usize {
        self.read(py, |c| c.nbytes())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let s = self.shape;
        format!(
            "KVCache(num_layers={}, num_blocks={}, block_size={}, num_kv_heads={}, head_dim={}, dtype={:?})",
            s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim, self.dtype(py)
        )
    }
}

/// Copy ops from rows of two ints: a step's int64 `[C, 2]` `copy_ops` or a sequence of pairs.
fn copy_ops(ops: &Bound<'_, PyAny>) -> PyResult<Vec<CopyOp>> {
    let rows: Vec<Vec<i64>> = ops.extract().map_err(|_| {
        invalid("ops must be an int64 [C, 2] array or a sequence of (src, dst) int pairs".into())
    })?;
    rows.iter()
        .enumerate()
        .map(|(i, row)| match row[..] {
            [src, dst] => Ok(CopyOp {
                src: u32_block(src, i)?,
                dst: u32_block(dst, i)?,
            }),
            _ => Err(shape_error(format!(
                "ops[{i}] has {} entries, expected a (src, dst) pair",
                row.len()
            ))),
        })
        .collect()
}

/// A copy op's block id as the core's `u32`; the core checks it against the cache's blocks.
fn u32_block(id: i64, op: usize) -> PyResult<u32> {
    u32::try_from(id).map_err(|_| invalid(format!("ops[{op}]: block {id} is not a block id")))
}

/// A block table from a 1-D integer array or a sequence of ints, as the core's `i32` entries.
fn block_ids(table: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    let ids: Vec<i64> = table.extract().map_err(|_| {
        invalid("block_table must be a 1-D integer array or a sequence of ints".into())
    })?;
    ids.into_iter()
        .map(|b| {
            i32::try_from(b)
                .map_err(|_| invalid(format!("block_table entry {b} is not an int32 block id")))
        })
        .collect()
}
