//! The arguments of one attention call from Python, converted once for `KVCache.attention`,
//! `ContiguousKV.attention` and `attention_kernel_seconds` alike: the numpy arrays (kept alive
//! while borrowed), read in C order whatever their layout ([`c_order`]), the scale, the sliding
//! window and the kernel path. Values are validated by the core
//! (`attention::paged_attention_with`: a window of 0 tokens is refused there), not here.

use std::borrow::Cow;

use numpy::ndarray::{Ix1, Ix2, Ix3};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::args::{c_order, expect_shape, opt, typed_array};
use super::errors::IntoPyResult;
use crate::compute::attention::{self, AttentionBatch};
use crate::compute::cpu::Isa;
use crate::store::kv_cache::KvCache;

/// The numpy arrays of a call, kept alive while their data is borrowed.
pub(crate) struct Arrays<'py> {
    query: PyReadonlyArray<'py, f32, Ix3>,
    context_lens: PyReadonlyArray<'py, i32, Ix1>,
    query_start_loc: PyReadonlyArray<'py, i32, Ix1>,
}

/// The converted arguments of one attention call.
pub(crate) struct Call<'a> {
    pub query: Cow<'a, [f32]>,
    num_tokens: usize,
    pub num_heads: usize,
    head_dim: usize,
    pub context_lens: Cow<'a, [i32]>,
    pub query_start_loc: Cow<'a, [i32]>,
    pub scale: f32,
    /// Positions each query attends to, its own included (None: full attention).
    pub window: Option<usize>,
    pub path: Isa,
}

/// A call's block tables (int32 `[num_seqs, max_blocks_per_seq]`), kept alive while borrowed.
pub(crate) struct Tables<'py>(PyReadonlyArray<'py, i32, Ix2>);

impl<'py> Arrays<'py> {
    pub fn extract(
        query: &Bound<'py, PyAny>,
        context_lens: &Bound<'py, PyAny>,
        query_start_loc: &Bound<'py, PyAny>,
    ) -> PyResult<Self> {
        Ok(Arrays {
            query: typed_array(query, "query", "float32")?,
            context_lens: typed_array(context_lens, "context_lens", "int32")?,
            query_start_loc: typed_array(query_start_loc, "query_start_loc", "int32")?,
        })
    }

    /// The call over K/V of `head_dim`: `scale` (a float or None) defaults to
    /// `1/sqrt(head_dim)`, `window` (an int or None) to full attention, `kernel` (a path name or
    /// None) to the process's default path.
    pub fn call(
        &self,
        head_dim: usize,
        scale: Option<&Bound<'_, PyAny>>,
        window: Option<&Bound<'_, PyAny>>,
        kernel: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Call<'_>> {
        let shape = self.query.shape();
        expect_shape(shape, &[None, None, Some(head_dim)], "query")?;
        let (scale, path) = scale_and_path(head_dim, scale, kernel)?;
        let window = opt(window, "window")?;
        Ok(Call {
            query: c_order(&self.query)?,
            num_tokens: shape[0],
            num_heads: shape[1],
            head_dim,
            context_lens: c_order(&self.context_lens)?,
            query_start_loc: c_order(&self.query_start_loc)?,
            scale,
            window,
            path,
        })
    }
}

/// A query argument: a float32 `[num_tokens, num_heads, head_dim]` array.
pub(crate) fn query_array<'py>(
    query: &Bound<'py, PyAny>,
    head_dim: usize,
) -> PyResult<PyReadonlyArray<'py, f32, Ix3>> {
    let query: PyReadonlyArray<'py, f32, Ix3> = typed_array(query, "query", "float32")?;
    expect_shape(query.shape(), &[None, None, Some(head_dim)], "query")?;
    Ok(query)
}

/// The scale (a float or None: `1/sqrt(head_dim)`) and kernel path (a name or None: the
/// process's default path) of a call.
pub(crate) fn scale_and_path(
    head_dim: usize,
    scale: Option<&Bound<'_, PyAny>>,
    kernel: Option<&Bound<'_, PyAny>>,
) -> PyResult<(f32, Isa)> {
    let scale = opt::<f64>(scale, "scale")?.unwrap_or(1.0 / (head_dim as f64).sqrt()) as f32;
    let path = match opt::<String>(kernel, "kernel")? {
        None => attention::default_isa(),
        Some(name) => name.parse().py_err()?,
    };
    Ok((scale, path))
}

impl<'py> Tables<'py> {
    pub fn extract(block_tables: &Bound<'py, PyAny>) -> PyResult<Self> {
        Ok(Tables(typed_array(block_tables, "block_tables", "int32")?))
    }

    /// The entries in C order and the row width.
    pub fn rows(&self) -> PyResult<(Cow<'_, [i32]>, usize)> {
        Ok((c_order(&self.0)?, self.0.shape()[1]))
    }
}

impl Call<'_> {
    /// A zeroed output buffer shaped like the query (`MemoryError` when it cannot be had).
    pub fn out(&self) -> PyResult<Vec<f32>> {
        crate::alloc::try_zeroed_vec(self.query.len(), "the attention output").py_err()
    }

    /// Runs the kernel over `layer` of `cache` through `block_tables` (`[_, width]`) into `out`.
    pub fn run_paged(
        &self,
        cache: &KvCache,
        layer: usize,
        block_tables: &[i32],
        width: usize,
        out: &mut [f32],
    ) -> crate::error::Result<()> {
        let batch = AttentionBatch {
            block_tables,
            max_blocks_per_seq: width,
            context_lens: &self.context_lens,
            query_start_loc: &self.query_start_loc,
        };
        attention::paged_attention_with(
            self.path,
            cache,
            layer,
            &self.query,
            self.num_heads,
            &batch,
            self.scale,
            self.window,
            out,
        )
    }

    /// `data` as a float32 array shaped like the query.
    pub fn output<'py>(&self, py: Python<'py>, data: Vec<f32>) -> PyResult<Bound<'py, PyAny>> {
        Ok(PyArray1::from_vec(py, data)
            .reshape([self.num_tokens, self.num_heads, self.head_dim])?
            .into_any())
    }
}
