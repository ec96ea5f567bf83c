//! `pagedkv._core.Decoder` and `DecoderLayer`: a thin shell over [`crate::model::Decoder`]. The
//! constructor converts the weights (norms copied once, projections shared with their `Linear`
//! objects); a call takes a step — a scheduler's `SchedulerOutput`, or a step over a `KVCache` of
//! one's own (`pagedkv.models.CacheStep`: its `kv_cache`, `windows` and arrays) — and runs the
//! whole forward pass with the GIL released.

use std::sync::Arc;

use numpy::ndarray::{Ix1, Ix2};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

use super::args::{arg, c_order, typed_array, Param};
use super::attention_call::Tables;
use super::errors::IntoPyResult;
use super::kv_cache::{copy_ops, PyKVCache};
use super::linear::PyLinear;
use super::scheduler::PySchedulerOutput;
use crate::compute::attention::{self, AttentionBatch};
use crate::model::{
    CacheStepKv, Decoder, DecoderConfig, Embedding, LayerWeights, Output, RuntimeStepKv,
};

/// A float32 1-D array (a norm's multipliers) copied into the core.
fn vector(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<f32>> {
    let array: PyReadonlyArray<'_, f32, Ix1> = typed_array(obj, name, "float32")?;
    Ok(c_order(&array)?.into_owned())
}

fn optional_vector(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<Vec<f32>>> {
    obj.filter(|o| !o.is_none())
        .map(|o| vector(o, name))
        .transpose()
}

fn linear(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Arc<crate::compute::linear::Linear>> {
    let linear = obj.cast::<PyLinear>().map_err(|_| {
        PyTypeError::new_err(format!("{name} must be a Linear, got {}", type_name(obj)))
    })?;
    Ok(Arc::clone(&linear.get().inner))
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".into(), |n| n.to_string())
}

/// Token embeddings: a float32 table ``[vocab, hidden]`` (copied once, so build it as the
/// tensor arrives and drop the array) or a quantized :class:`Linear` whose rows (its output
/// features) are gathered, dequantized bit-exactly as ggml does (a tied lm_head's own).
#[pyclass(name = "Embedding", module = "pagedkv", frozen)]
pub struct PyEmbedding {
    inner: Arc<Embedding>,
}

#[pymethods]
impl PyEmbedding {
    #[new]
    fn new(py: Python<'_>, table: &Bound<'_, PyAny>) -> PyResult<Self> {
        let inner = match table.cast::<PyLinear>() {
            Ok(rows) => Embedding::rows(Arc::clone(&rows.get().inner)).py_err()?,
            Err(_) => {
                let array: PyReadonlyArray<'_, f32, Ix2> = typed_array(table, "table", "float32")?;
                let hidden = array.shape()[1];
                let rows = c_order(&array)?;
                py.detach(|| Embedding::table(rows.into_owned(), hidden))
                    .py_err()?
            }
        };
        Ok(PyEmbedding {
            inner: Arc::new(inner),
        })
    }

    /// The float32 rows ``[len(ids), hidden_size]`` of token ``ids`` (ints in ``0..vocab_size``).
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids: Vec<usize> = arg(ids, "ids")?;
        let hidden = self.inner.shape().1;
        let mut out =
            crate::alloc::try_zeroed_vec(ids.len() * hidden, "the embedding rows").py_err()?;
        py.detach(|| self.inner.gather(&ids, &mut out)).py_err()?;
        Ok(PyArray1::from_vec(py, out)
            .reshape([ids.len(), hidden])?
            .into_any())
    }

    /// ``(vocab_size, hidden_size)``.
    #[getter]
    fn shape(&self) -> (usize, usize) {
        self.inner.shape()
    }

    /// Bytes held (a shared quantized weight counts in full).
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }
}

/// One decoder layer's weights (see :class:`Decoder`): norms as float32 multipliers, projections
/// as :class:`Linear` of ``x @ W`` shapes, ``rope`` the index of its set of rotary frequencies.
#[pyclass(name = "DecoderLayer", module = "pagedkv", frozen)]
pub struct PyDecoderLayer {
    inner: LayerWeights,
}

#[pymethods]
impl PyDecoderLayer {
    #[new]
    #[pyo3(signature = (*, input_norm, qkv, o, pre_mlp_norm, gate_up, down, rope=Param::Absent,
                        q_norm=None, k_norm=None, post_attention_norm=None, post_mlp_norm=None),
           text_signature = "(*, input_norm, qkv, o, pre_mlp_norm, gate_up, down, rope=0, q_norm=None, \
                             k_norm=None, post_attention_norm=None, post_mlp_norm=None)")]
    #[allow(clippy::too_many_arguments)]
    fn new(
        input_norm: &Bound<'_, PyAny>,
        qkv: &Bound<'_, PyAny>,
        o: &Bound<'_, PyAny>,
        pre_mlp_norm: &Bound<'_, PyAny>,
        gate_up: &Bound<'_, PyAny>,
        down: &Bound<'_, PyAny>,
        rope: Param<'_>,
        q_norm: Option<&Bound<'_, PyAny>>,
        k_norm: Option<&Bound<'_, PyAny>>,
        post_attention_norm: Option<&Bound<'_, PyAny>>,
        post_mlp_norm: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Ok(PyDecoderLayer {
            inner: LayerWeights {
                input_norm: vector(input_norm, "input_norm")?,
                qkv: linear(qkv, "qkv")?,
                q_norm: optional_vector(q_norm, "q_norm")?,
                k_norm: optional_vector(k_norm, "k_norm")?,
                o: linear(o, "o")?,
                post_attention_norm: optional_vector(post_attention_norm, "post_attention_norm")?,
                pre_mlp_norm: vector(pre_mlp_norm, "pre_mlp_norm")?,
                gate_up: linear(gate_up, "gate_up")?,
                down: linear(down, "down")?,
                post_mlp_norm: optional_vector(post_mlp_norm, "post_mlp_norm")?,
                rope: rope.or("rope", 0)?,
            },
        })
    }
}

/// A pre-norm decoder whose whole forward pass over a step runs in the core, in one call:
/// embedding (a float32 ``[vocab, hidden]`` table, or a quantized :class:`Linear` whose rows are
/// gathered), per layer RMSNorm → ``[q|k|v]`` → optional per-head q/k norms → rotary embedding
/// (each layer's set of ``rope_frequencies``, float64 ``[head_dim // 2]``) → K/V write →
/// attention (the step's windows) → ``o`` → optional norm → residual → RMSNorm → ``[gate|up]`` →
/// ``activation`` ("silu" or "gelu_tanh") → ``down`` → optional norm → residual; then the final
/// norm and, for :meth:`logits`, ``lm_head``. Raises ``InvalidArgumentError`` naming the first
/// weight whose shape the dimensions do not imply.
#[pyclass(name = "Decoder", module = "pagedkv", frozen)]
pub struct PyDecoder {
    inner: Decoder,
}

#[pymethods]
impl PyDecoder {
    #[new]
    #[pyo3(signature = (*, vocab_size, hidden_size, intermediate_size, num_heads, num_kv_heads,
                        head_dim, rms_norm_eps, activation, attention_scale, embedding_scale,
                        max_positions, rope_frequencies, embedding, layers, final_norm, lm_head))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        vocab_size: &Bound<'_, PyAny>,
        hidden_size: &Bound<'_, PyAny>,
        intermediate_size: &Bound<'_, PyAny>,
        num_heads: &Bound<'_, PyAny>,
        num_kv_heads: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        rms_norm_eps: &Bound<'_, PyAny>,
        activation: &Bound<'_, PyAny>,
        attention_scale: &Bound<'_, PyAny>,
        embedding_scale: &Bound<'_, PyAny>,
        max_positions: &Bound<'_, PyAny>,
        rope_frequencies: Vec<Bound<'_, PyAny>>,
        embedding: &Bound<'_, PyAny>,
        layers: Vec<Bound<'_, PyAny>>,
        final_norm: &Bound<'_, PyAny>,
        lm_head: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let rope_frequencies = rope_frequencies
            .iter()
            .enumerate()
            .map(|(i, set)| {
                let array: PyReadonlyArray<'_, f64, Ix1> =
                    typed_array(set, &format!("rope_frequencies[{i}]"), "float64")?;
                Ok(c_order(&array)?.into_owned())
            })
            .collect::<PyResult<Vec<_>>>()?;
        let config = DecoderConfig {
            vocab_size: arg(vocab_size, "vocab_size")?,
            hidden_size: arg(hidden_size, "hidden_size")?,
            intermediate_size: arg(intermediate_size, "intermediate_size")?,
            num_heads: arg(num_heads, "num_heads")?,
            num_kv_heads: arg(num_kv_heads, "num_kv_heads")?,
            head_dim: arg(head_dim, "head_dim")?,
            rms_norm_eps: arg::<f64>(rms_norm_eps, "rms_norm_eps")? as f32,
            activation: arg::<String>(activation, "activation")?.parse().py_err()?,
            attention_scale: arg::<f64>(attention_scale, "attention_scale")? as f32,
            embedding_scale: arg::<f64>(embedding_scale, "embedding_scale")? as f32,
            max_positions: arg(max_positions, "max_positions")?,
            rope_frequencies,
        };
        let embedding = embedding.cast::<PyEmbedding>().map_err(|_| {
            PyTypeError::new_err(format!(
                "embedding must be an Embedding, got {}",
                type_name(embedding)
            ))
        })?;
        let embedding = Arc::clone(&embedding.get().inner);
        let layers = layers
            .iter()
            .enumerate()
            .map(|(i, layer)| {
                let layer = layer.cast::<PyDecoderLayer>().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "layers[{i}] must be a DecoderLayer, got {}",
                        type_name(layer)
                    ))
                })?;
                Ok(layer.get().inner.clone())
            })
            .collect::<PyResult<Vec<_>>>()?;
        let final_norm = vector(final_norm, "final_norm")?;
        let lm_head = linear(lm_head, "lm_head")?;
        let inner = py
            .detach(|| Decoder::new(config, embedding, layers, final_norm, lm_head))
            .py_err()?;
        Ok(PyDecoder { inner })
    }

    /// Runs ``step`` (every layer's K/V written at its slots and attended through its tables) and
    /// returns the final-normed hidden states float32 ``[len(rows), hidden_size]`` of token
    /// ``rows``. Raises ``InvalidArgumentError``, touching no K/V, for a token id outside the
    /// vocabulary, a position at or past ``max_positions`` or a row outside the step.
    fn hidden<'py>(
        &self,
        py: Python<'py>,
        step: &Bound<'py, PyAny>,
        rows: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.run(py, step, rows, Output::Hidden)
    }

    /// :meth:`hidden` projected by ``lm_head``: the float32 logits ``[len(rows), vocab_size]``.
    fn logits<'py>(
        &self,
        py: Python<'py>,
        step: &Bound<'py, PyAny>,
        rows: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.run(py, step, rows, Output::Logits)
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }
}

impl PyDecoder {
    /// Runs `step` (a `SchedulerOutput`, or a cache step's `kv_cache`, `windows` and arrays)
    /// for token `rows`, into a new float32 array `[len(rows), width(output)]`.
    fn run<'py>(
        &self,
        py: Python<'py>,
        step: &Bound<'py, PyAny>,
        rows: &Bound<'py, PyAny>,
        output: Output,
    ) -> PyResult<Bound<'py, PyAny>> {
        let width = self.inner.width(output);
        let rows: Vec<usize> = arg(rows, "rows")?;
        let ids: Vec<i64> = arg(&step.getattr("input_ids")?, "input_ids")?;
        let positions: Vec<i64> = arg(&step.getattr("positions")?, "positions")?;
        let mut out =
            crate::alloc::try_zeroed_vec(rows.len() * width, "the forward's output").py_err()?;
        let decoder = &self.inner;
        let isa = attention::default_isa();
        if let Ok(scheduled) = step.cast::<PySchedulerOutput>() {
            scheduled.get().run(py, |runtime, step| {
                let mut kv = RuntimeStepKv { runtime, step, isa };
                decoder.forward(&mut kv, &ids, &positions, &rows, output, &mut out)
            })?;
        } else {
            let cache = step.getattr("kv_cache").ok();
            let cache = cache
                .as_ref()
                .and_then(|c| c.cast::<PyKVCache>().ok())
                .ok_or_else(|| {
                    PyTypeError::new_err(format!(
                        "step must be a SchedulerOutput or a CacheStep over a KVCache, got {}",
                        type_name(step)
                    ))
                })?;
            let slot_mapping: Vec<i64> = arg(&step.getattr("slot_mapping")?, "slot_mapping")?;
            let context_lens: Vec<i32> = arg(&step.getattr("context_lens")?, "context_lens")?;
            let query_start_loc: Vec<i32> =
                arg(&step.getattr("query_start_loc")?, "query_start_loc")?;
            let block_tables = step.getattr("block_tables")?;
            let tables = Tables::extract(&block_tables)?;
            let (tables, width) = tables.rows()?;
            let copy_ops = copy_ops(&step.getattr("copy_ops")?)?;
            let windows = step
                .getattr("windows")?
                .try_iter()?
                .map(|w| arg::<Option<usize>>(&w?, "windows"))
                .collect::<PyResult<Vec<_>>>()?;
            cache.get().with(py, |cache| {
                let mut kv = CacheStepKv {
                    cache,
                    slot_mapping: &slot_mapping,
                    batch: AttentionBatch {
                        block_tables: &tables,
                        max_blocks_per_seq: width,
                        context_lens: &context_lens,
                        query_start_loc: &query_start_loc,
                    },
                    copy_ops: &copy_ops,
                    windows: &windows,
                    isa,
                };
                decoder.forward(&mut kv, &ids, &positions, &rows, output, &mut out)
            })?;
        }
        Ok(PyArray1::from_vec(py, out)
            .reshape([rows.len(), width])?
            .into_any())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDecoder>()?;
    m.add_class::<PyEmbedding>()?;
    m.add_class::<PyDecoderLayer>()?;
    Ok(())
}
