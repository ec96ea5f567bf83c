//! `pagedkv.KVCache`: K/V storage of every layer, in `[num_blocks, num_kv_heads, block_size,
//! head_dim]` tiles, f32/f16/bf16. Every argument goes through `args` (arrays read in C order
//! whatever their layout; ids and pairs as numpy arrays or Python sequences alike), every call
//! through `sync::locked`; the core validates every value. A cache made here is the caller's
//! alone (no disk tier can share it: a tier attaches only to a scheduler's own K/V).

use std::sync::Mutex;

use numpy::ndarray::{Ix1, Ix3};
use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyString};

use super::args::{arg, c_order, expect_shape, invalid, shape_error, typed_array, Param};
use super::attention_call::{Arrays, Tables};
use super::sync::{detached, locked};
use crate::ids::CopyOp;
use crate::store::dtype::KvDtype;
use crate::store::kv_cache::{KvCache, KvShape};

/// Paged K/V storage for all layers of a model, owned by Rust. Token slot `s` is row
/// `s % block_size` of block `s // block_size`. Thread-safe.
#[pyclass(name = "KVCache", module = "pagedkv", frozen)]
pub struct PyKVCache {
    inner: Mutex<KvCache>,
    shape: KvShape,
    dtype: KvDtype,
    nbytes: usize,
}

type F32Array<'py, D> = numpy::PyReadonlyArray<'py, f32, D>;

impl PyKVCache {
    /// Runs `f` on the cache with the GIL released (see `sync::locked`).
    pub(crate) fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut KvCache) -> crate::error::Result<T> + Send,
    ) -> PyResult<T> {
        locked(py, &self.inner, f)
    }

    pub(crate) fn shape(&self) -> KvShape {
        self.shape
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
    #[pyo3(
        signature = (num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=Param::Absent),
        text_signature = "(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype='float32')"
    )]
    fn new(
        py: Python<'_>,
        num_layers: &Bound<'_, PyAny>,
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        num_kv_heads: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        dtype: Param<'_>,
    ) -> PyResult<Self> {
        let shape = KvShape {
            num_layers: arg(num_layers, "num_layers")?,
            num_blocks: arg(num_blocks, "num_blocks")?,
            block_size: arg(block_size, "block_size")?,
            num_kv_heads: arg(num_kv_heads, "num_kv_heads")?,
            head_dim: arg(head_dim, "head_dim")?,
        };
        let dtype: String = dtype.or("dtype", "float32".into())?;
        let cache = detached(py, || KvCache::new(shape, dtype.parse()?))?;
        Ok(PyKVCache {
            shape,
            dtype: cache.dtype(),
            nbytes: cache.nbytes(),
            inner: Mutex::new(cache),
        })
    }

    /// Stores `keys[i]` and `values[i]` (float32 `[n, num_kv_heads, head_dim]`) at
    /// `slot_mapping[i]` (int64 `[n]`) of `layer`, converting to the cache dtype. Raises
    /// InvalidArgumentError, writing nothing, for a value the dtype does not store as a finite
    /// number (NaN, infinity, beyond ±65504 in float16).
    fn write(
        &self,
        py: Python<'_>,
        layer: &Bound<'_, PyAny>,
        keys: &Bound<'_, PyAny>,
        values: &Bound<'_, PyAny>,
        slot_mapping: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let layer: usize = arg(layer, "layer")?;
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
        self.with(py, |c| c.write(layer, &keys, &values, &slots))
    }

    /// Copies whole blocks `src → dst` in every layer, in order: apply a step's copy-on-write ops
    /// before its attention runs. `ops` is a step's `copy_ops` (int64 `[C, 2]`) or any sequence
    /// of `(src, dst)` pairs.
    fn copy_blocks(&self, py: Python<'_>, ops: &Bound<'_, PyAny>) -> PyResult<()> {
        let ops = copy_ops(ops)?;
        self.with(py, |c| c.copy_blocks(&ops))
    }

    /// Reads the first `num_tokens` K and V rows of a sequence through `block_table` (a 1-D
    /// integer array, e.g. a row of a step's `block_tables`, or a sequence of ints; entries past
    /// the used blocks are padding and never read), as float32 arrays `[num_tokens,
    /// num_kv_heads, head_dim]`.
    fn gather<'py>(
        &self,
        py: Python<'py>,
        layer: &Bound<'py, PyAny>,
        block_table: &Bound<'py, PyAny>,
        num_tokens: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
        let layer: usize = arg(layer, "layer")?;
        let table: Vec<i32> = arg(block_table, "block_table")?;
        let n: usize = arg(num_tokens, "num_tokens")?;
        let (k, v) = self.with(py, |c| c.gather(layer, &table, n))?;
        Ok((self.to_array(py, k, n)?, self.to_array(py, v, n)?))
    }

    /// Attention of `query` (float32 `[num_tokens, num_heads, head_dim]`) over `layer`, reading
    /// K/V through `block_tables` (int32 `[num_seqs, max_blocks_per_seq]`, padding never read).
    /// Sequence i owns query rows `query_start_loc[i]:query_start_loc[i + 1]` (int32
    /// `[num_seqs + 1]`) and `context_lens[i]` (int32) tokens of cache including those new tokens;
    /// its query j, at position `p = context_lens[i] - nq + j`, attends causally to keys `0..=p`,
    /// or with `window` (a positive int: a sliding-window layer) to the last `window` of them,
    /// `p - window < k <= p`; table entries of blocks wholly before every window of a sequence
    /// are never read. `scale` defaults to `1/sqrt(head_dim)`; `kernel` forces "avx2" or
    /// "portable". Returns a new float32 array shaped like `query`. Releases the GIL while
    /// computing.
    #[pyo3(signature = (layer, query, block_tables, context_lens, query_start_loc, scale=None, kernel=None, *, window=None))]
    #[allow(clippy::too_many_arguments)]
    fn attention<'py>(
        &self,
        py: Python<'py>,
        layer: &Bound<'py, PyAny>,
        query: &Bound<'py, PyAny>,
        block_tables: &Bound<'py, PyAny>,
        context_lens: &Bound<'py, PyAny>,
        query_start_loc: &Bound<'py, PyAny>,
        scale: Option<&Bound<'py, PyAny>>,
        kernel: Option<&Bound<'py, PyAny>>,
        window: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let layer: usize = arg(layer, "layer")?;
        let arrays = Arrays::extract(query, context_lens, query_start_loc)?;
        let tables = Tables::extract(block_tables)?;
        let call = arrays.call(self.shape.head_dim, scale, window, kernel)?;
        let (tables, width) = tables.rows()?;
        let mut out = call.out()?;
        self.with(py, |c| call.run_paged(c, layer, &tables, width, &mut out))?;
        call.output(py, out)
    }

    /// Overwrites every K and V element with pseudo-random values in [-1, 1) from `seed`
    /// (benchmarks: real data in every page).
    fn fill_random(&self, py: Python<'_>, seed: &Bound<'_, PyAny>) -> PyResult<()> {
        let seed: u64 = arg(seed, "seed")?;
        self.with(py, |c| {
            c.fill_random(seed);
            Ok(())
        })
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
    fn dtype(&self) -> &'static str {
        self.dtype.name()
    }

    /// Bytes of K and V storage.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    fn __repr__(&self) -> String {
        let s = self.shape;
        format!(
            "KVCache(num_layers={}, num_blocks={}, block_size={}, num_kv_heads={}, head_dim={}, dtype={:?})",
            s.num_layers, s.num_blocks, s.block_size, s.num_kv_heads, s.head_dim, self.dtype.name()
        )
    }
}

/// Copy ops from rows of two block ids: a step's int64 `[C, 2]` `copy_ops` (any integer dtype
/// and layout) or a sequence of pairs; each row converts like any int sequence (`args`).
pub(crate) fn copy_ops(ops: &Bound<'_, PyAny>) -> PyResult<Vec<CopyOp>> {
    let refuse =
        || invalid("ops must be an integer [C, 2] array or a sequence of (src, dst) pairs".into());
    if ops.is_instance_of::<PyString>()
        || ops.is_instance_of::<PyBytes>()
        || ops.is_instance_of::<PyByteArray>()
    {
        return Err(refuse());
    }
    let rows = ops.try_iter().map_err(|_| refuse())?;
    rows.enumerate()
        .map(|(i, row)| {
            let pair: Vec<u32> = arg(&row?, &format!("ops[{i}]"))?;
            match pair[..] {
                [src, dst] => Ok(CopyOp { src, dst }),
                _ => Err(shape_error(format!(
                    "ops[{i}] has {} entries, expected a (src, dst) pair",
                    pair.len()
                ))),
            }
        })
        .collect()
}
