//! Attention from Python besides `KVCache.attention`: the thread-count setting, and the helpers
//! the benchmark needs (read bandwidth, contiguous K/V, kernel time without Python). Arguments are
//! converted by `attention_call` (arrays borrowed without copies when C-contiguous); the GIL is
//! released while computing.

use std::time::Instant;

use pyo3::prelude::*;

use super::args::{arg, invalid, Param};
use super::attention_call::{Arrays, Tables};
use super::kv_cache::PyKVCache;
use super::sync::detached;
use crate::compute::attention::{self, ContiguousKv};
use crate::compute::cpu::{self, Isa};

/// Seconds per call of the kernel alone (no argument conversion, no Python), averaged over
/// `iterations` calls made from Rust with the GIL released: `KVCache.attention` from Python
/// costs this plus the call overhead. `window` as in `KVCache.attention`.
#[pyfunction]
#[pyo3(
    signature = (cache, layer, query, block_tables, context_lens, query_start_loc, iterations=Param::Absent, scale=None, *, window=None),
    text_signature = "(cache, layer, query, block_tables, context_lens, query_start_loc, iterations=100, scale=None, *, window=None)"
)]
#[allow(clippy::too_many_arguments)]
fn attention_kernel_seconds(
    py: Python<'_>,
    cache: &PyKVCache,
    layer: &Bound<'_, PyAny>,
    query: &Bound<'_, PyAny>,
    block_tables: &Bound<'_, PyAny>,
    context_lens: &Bound<'_, PyAny>,
    query_start_loc: &Bound<'_, PyAny>,
    iterations: Param<'_>,
    scale: Option<&Bound<'_, PyAny>>,
    window: Option<&Bound<'_, PyAny>>,
) -> PyResult<f64> {
    let layer: usize = arg(layer, "layer")?;
    let iterations: usize = iterations.or("iterations", 100)?;
    if iterations == 0 {
        return Err(invalid("iterations must be positive".into()));
    }
    let arrays = Arrays::extract(query, context_lens, query_start_loc)?;
    let tables = Tables::extract(block_tables)?;
    let call = arrays.call(cache.shape().head_dim, scale, window, None)?;
    let (tables, width) = tables.rows()?;
    let mut out = call.out()?;
    cache.with(py, |c| {
        let start = Instant::now();
        for _ in 0..iterations {
            call.run_paged(c, layer, &tables, width, &mut out)?;
        }
        Ok(start.elapsed().as_secs_f64() / iterations as f64)
    })
}

/// Sets the number of threads the worker pool (attention, linear, sampling) uses, 1 to 1024 (default: `PAGEDKV_NUM_THREADS`, else
/// every CPU). Raises InvalidArgumentError for a count outside that range, MemoryError for one
/// the system cannot start; the previous count stays then.
#[pyfunction]
fn set_num_threads(py: Python<'_>, threads: &Bound<'_, PyAny>) -> PyResult<()> {
    let threads: usize = arg(threads, "threads")?;
    detached(py, || cpu::set_num_threads(threads))
}

/// The number of threads the worker pool uses.
#[pyfunction]
fn get_num_threads() -> usize {
    cpu::num_threads()
}

/// The instruction sets attention has kernels for that this CPU runs, best first (e.g.
/// `["avx2", "portable"]`).
#[pyfunction]
fn available_kernels() -> Vec<&'static str> {
    Isa::available_of(&attention::ISAS)
        .into_iter()
        .map(Isa::name)
        .collect()
}

/// What each kernel family runs on by default: `{"ceiling": ..., "attention": ..., "linear":
/// ..., "quantized": ..., "sampling": ...}` (linear: float weights; quantized: GGUF-format
/// weights), the ceiling
/// being `PAGEDKV_ISA` when set, valid and available, else the best set this CPU has (read once
/// per process).
#[pyfunction]
fn default_isas() -> Vec<(&'static str, &'static str)> {
    vec![
        ("ceiling", cpu::ceiling().name()),
        ("attention", attention::default_isa().name()),
        ("linear", crate::compute::linear::default_isa().name()),
        (
            "quantized",
            Isa::default_of(&crate::compute::linear::QUANTIZED_ISAS).name(),
        ),
        ("sampling", crate::compute::sampling::default_isa().name()),
    ]
}

/// Every instruction set this CPU runs, best first: the values `PAGEDKV_ISA` may take here.
#[pyfunction]
fn available_isas() -> Vec<&'static str> {
    Isa::available_of(&Isa::ALL)
        .into_iter()
        .map(Isa::name)
        .collect()
}

/// Read-only memory bandwidth in GB/s of each of `sweeps` sweeps over a fresh `nbytes` buffer, on
/// the attention threads.
#[pyfunction]
#[pyo3(signature = (nbytes, sweeps=Param::Absent), text_signature = "(nbytes, sweeps=5)")]
fn measure_read_bandwidth(
    py: Python<'_>,
    nbytes: &Bound<'_, PyAny>,
    sweeps: Param<'_>,
) -> PyResult<Vec<f64>> {
    let nbytes: usize = arg(nbytes, "nbytes")?;
    let sweeps: usize = sweeps.or("sweeps", 5)?;
    detached(py, || cpu::measure_read_bandwidth(nbytes, sweeps))
}

/// f32 GFLOP/s (an FMA counts 2) of all attention threads running a register-only FMA loop.
#[pyfunction]
fn measure_fma_peak(py: Python<'_>) -> PyResult<f64> {
    detached(py, cpu::measure_fma_peak)
}

/// A freshly written buffer of `nbytes` of memory whose read-only sweeps measure bandwidth on
/// the attention threads; keep one and sweep it between the measurements it is compared with.
#[pyclass(name = "ReadBandwidthProbe", module = "pagedkv", frozen)]
pub struct PyReadBandwidthProbe {
    inner: cpu::ReadProbe,
}

#[pymethods]
impl PyReadBandwidthProbe {
    #[new]
    fn new(py: Python<'_>, nbytes: &Bound<'_, PyAny>) -> PyResult<Self> {
        let nbytes: usize = arg(nbytes, "nbytes")?;
        Ok(PyReadBandwidthProbe {
            inner: detached(py, || cpu::ReadProbe::new(nbytes))?,
        })
    }

    /// Reads the whole buffer once; returns GB/s (10^9 bytes per second).
    fn sweep(&self, py: Python<'_>) -> PyResult<f64> {
        detached(py, || self.inner.sweep())
    }

    /// Bytes one sweep reads.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }
}

/// K/V of a batch stored contiguously (`[num_seqs, num_kv_heads, max_context, head_dim]`), filled
/// with pseudo-random values: the unpaged baseline for benchmarks. Its `attention` runs the same
/// loop as `KVCache.attention`, in tiles of `block_size` rows.
#[pyclass(name = "ContiguousKV", module = "pagedkv", frozen)]
pub struct PyContiguousKV {
    inner: ContiguousKv,
    head_dim: usize,
}

#[pymethods]
impl PyContiguousKV {
    #[new]
    #[pyo3(
        signature = (num_seqs, num_kv_heads, max_context, head_dim, dtype=Param::Absent, seed=Param::Absent),
        text_signature = "(num_seqs, num_kv_heads, max_context, head_dim, dtype='float32', seed=0)"
    )]
    fn new(
        py: Python<'_>,
        num_seqs: &Bound<'_, PyAny>,
        num_kv_heads: &Bound<'_, PyAny>,
        max_context: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        dtype: Param<'_>,
        seed: Param<'_>,
    ) -> PyResult<Self> {
        let dims: [usize; 4] = [
            arg(num_seqs, "num_seqs")?,
            arg(num_kv_heads, "num_kv_heads")?,
            arg(max_context, "max_context")?,
            arg(head_dim, "head_dim")?,
        ];
        let dtype: String = dtype.or("dtype", "float32".into())?;
        let seed: u64 = seed.or("seed", 0)?;
        let inner = detached(py, || {
            ContiguousKv::random(dtype.parse()?, dims[0], dims[1], dims[2], dims[3], seed)
        })?;
        Ok(PyContiguousKV {
            inner,
            head_dim: dims[3],
        })
    }

    /// Attention of `query` (float32 `[num_tokens, num_heads, head_dim]`) over the first
    /// `context_lens[i]` rows of sequence i, same semantics (`window` included) as
    /// `KVCache.attention`.
    #[pyo3(
        signature = (query, context_lens, query_start_loc, block_size=Param::Absent, scale=None, kernel=None, *, window=None),
        text_signature = "($self, query, context_lens, query_start_loc, block_size=16, scale=None, kernel=None, *, window=None)"
    )]
    #[allow(clippy::too_many_arguments)]
    fn attention<'py>(
        &self,
        py: Python<'py>,
        query: &Bound<'py, PyAny>,
        context_lens: &Bound<'py, PyAny>,
        query_start_loc: &Bound<'py, PyAny>,
        block_size: Param<'py>,
        scale: Option<&Bound<'py, PyAny>>,
        kernel: Option<&Bound<'py, PyAny>>,
        window: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let block_size: usize = block_size.or("block_size", 16)?;
        let arrays = Arrays::extract(query, context_lens, query_start_loc)?;
        let call = arrays.call(self.head_dim, scale, window, kernel)?;
        let mut out = call.out()?;
        detached(py, || {
            self.inner.attention(
                call.path,
                &call.query,
                call.num_heads,
                &call.context_lens,
                &call.query_start_loc,
                block_size,
                call.scale,
                call.window,
                &mut out,
            )
        })?;
        call.output(py, out)
    }

    /// Storage dtype name.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype().name()
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyContiguousKV>()?;
    m.add_class::<PyReadBandwidthProbe>()?;
    m.add_function(wrap_pyfunction!(set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(get_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(available_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(default_isas, m)?)?;
    m.add_function(wrap_pyfunction!(available_isas, m)?)?;
    m.add_function(wrap_pyfunction!(measure_read_bandwidth, m)?)?;
    m.add_function(wrap_pyfunction!(measure_fma_peak, m)?)?;
    m.add_function(wrap_pyfunction!(attention_kernel_seconds, m)?)?;
    Ok(())
}
