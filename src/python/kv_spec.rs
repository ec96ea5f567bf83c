//! `LayerSpec`, `KvSpec` and `GroupSpec`: what a model declares of its K/V, layer by layer, and
//! the groups of layers a scheduler derives from it (the core's `kv::spec`). Frozen values with
//! equality; conversion only.

use pyo3::prelude::*;
use pyo3::types::PySequence;

use super::args::{arg, invalid, opt, Param};
use super::errors::IntoPyResult;
use crate::kv::coordinator::capacity_tokens;
use crate::kv::spec::{AttentionKind, GroupSpec, KvCacheConfig, KvSpec, LayerSpec};
use crate::store::dtype::KvDtype;

/// What one layer keeps of K/V: `num_kv_heads` heads of `head_dim` elements, attending over every
/// earlier token (`window` None) or over the last `window` tokens (a sliding-window layer).
#[pyclass(name = "LayerSpec", module = "pagedkv", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyLayerSpec {
    pub inner: LayerSpec,
}

#[pymethods]
impl PyLayerSpec {
    #[new]
    #[pyo3(signature = (num_kv_heads, head_dim, window=None))]
    fn new(
        num_kv_heads: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        window: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let attention = match opt(window, "window")? {
            None => AttentionKind::Full,
            Some(window) => AttentionKind::Sliding { window },
        };
        Ok(PyLayerSpec {
            inner: LayerSpec {
                attention,
                num_kv_heads: arg(num_kv_heads, "num_kv_heads")?,
                head_dim: arg(head_dim, "head_dim")?,
            },
        })
    }

    #[getter]
    fn num_kv_heads(&self) -> usize {
        self.inner.num_kv_heads
    }

    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.head_dim
    }

    /// Tokens a sliding-window layer attends over, None for full attention.
    #[getter]
    fn window(&self) -> Option<usize> {
        self.inner.attention.window()
    }

    fn __repr__(&self) -> String {
        let l = &self.inner;
        let window = match self.window() {
            None => String::new(),
            Some(w) => format!(", window={w}"),
        };
        format!(
            "LayerSpec(num_kv_heads={}, head_dim={}{window})",
            l.num_kv_heads, l.head_dim
        )
    }
}

/// What a model keeps of K/V: one `LayerSpec` per layer, stored as `dtype` ("float32",
/// "float16" or "bfloat16"). A scheduler given one (`kv_spec=`) derives its KV cache groups from
/// it and owns K/V storage of that layout for its pool, reached only through its steps, whose
/// attention applies each layer's window from here.
#[pyclass(name = "KvSpec", module = "pagedkv", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyKvSpec {
    pub inner: KvSpec,
}

fn dtype_of(dtype: Param<'_>) -> PyResult<KvDtype> {
    let name: String = dtype.or("dtype", KvDtype::default().name().into())?;
    name.parse().py_err()
}

#[pymethods]
impl PyKvSpec {
    #[new]
    #[pyo3(
        signature = (layers, dtype=Param::Absent, *, hybrid=Param::Absent, sliding_block_size=None),
        text_signature = "(layers, dtype=..., *, hybrid=True, sliding_block_size=None)"
    )]
    fn new(
        layers: &Bound<'_, PyAny>,
        dtype: Param<'_>,
        hybrid: Param<'_>,
        sliding_block_size: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let sequence = layers
            .cast::<PySequence>()
            .map_err(|_| invalid("layers must be a sequence of LayerSpec".into()))?;
        let layers = (0..sequence.len()?)
            .map(|i| {
                let item = sequence.get_item(i)?;
                let layer = item
                    .cast::<PyLayerSpec>()
                    .map_err(|_| invalid(format!("layers[{i}] is not a LayerSpec")))?;
                Ok(layer.get().inner)
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyKvSpec {
            inner: KvSpec {
                layers,
                dtype: dtype_of(dtype)?,
                hybrid: hybrid.or("hybrid", true)?,
                sliding_block_size: sliding_block_size
                    .map(|size| arg(size, "sliding_block_size"))
                    .transpose()?,
            },
        })
    }

    /// `num_layers` alike layers of full attention.
    #[staticmethod]
    #[pyo3(
        signature = (num_layers, num_kv_heads, head_dim, dtype=Param::Absent),
        text_signature = "(num_layers, num_kv_heads, head_dim, dtype=...)"
    )]
    fn uniform(
        num_layers: &Bound<'_, PyAny>,
        num_kv_heads: &Bound<'_, PyAny>,
        head_dim: &Bound<'_, PyAny>,
        dtype: Param<'_>,
    ) -> PyResult<Self> {
        Ok(PyKvSpec {
            inner: KvSpec::uniform(
                arg(num_layers, "num_layers")?,
                arg(num_kv_heads, "num_kv_heads")?,
                arg(head_dim, "head_dim")?,
                dtype_of(dtype)?,
            ),
        })
    }

    #[getter]
    fn layers(&self) -> Vec<PyLayerSpec> {
        self.inner
            .layers
            .iter()
            .map(|&inner| PyLayerSpec { inner })
            .collect()
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.layers.len()
    }

    /// Storage dtype name.
    #[getter]
    fn dtype(&self) -> &'static str {
        self.inner.dtype.name()
    }

    /// Whether each attention kind gets KV cache groups of its own (False: every layer kept
    /// whole in one group).
    #[getter]
    fn hybrid(&self) -> bool {
        self.inner.hybrid
    }

    /// Tokens per block of sliding-window groups (a divisor of the cache's block size: their
    /// pages carved into that many tokens of more layers), or None for the default (half the
    /// block size when even).
    #[getter]
    fn sliding_block_size(&self) -> Option<usize> {
        self.inner.sliding_block_size
    }

    /// The longest sequence a cache of `num_blocks` blocks of `block_size` tokens holds for this
    /// spec, computing up to `max_num_batched_tokens` tokens a step: with one group of full
    /// attention, `num_blocks * block_size`; a sliding-window group holds only its window.
    /// Raises InvalidArgumentError for a spec the runtime refuses.
    fn capacity_tokens(
        &self,
        num_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        max_num_batched_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let block_size = arg(block_size, "block_size")?;
        let layout = KvCacheConfig::derive(&self.inner, block_size).py_err()?;
        Ok(capacity_tokens(
            &layout.kept(),
            arg(num_blocks, "num_blocks")?,
            arg(max_num_batched_tokens, "max_num_batched_tokens")?,
        ))
    }

    fn __repr__(&self) -> String {
        let layers: Vec<String> = self.layers().iter().map(PyLayerSpec::__repr__).collect();
        let hybrid = match self.inner.hybrid {
            true => "",
            false => ", hybrid=False",
        };
        let sliding = match self.inner.sliding_block_size {
            None => String::new(),
            Some(size) => format!(", sliding_block_size={size}"),
        };
        format!(
            "KvSpec([{}], dtype={:?}{hybrid}{sliding})",
            layers.join(", "),
            self.inner.dtype.name()
        )
    }
}

/// Layers whose K/V one block table per sequence addresses: alike in KV heads, head size and
/// window (`layer`: a group of sliding-window layers keeps only each sequence's last `window`
/// tokens), numbered `layers`, in blocks of `block_size` tokens; every page has one size in bytes
/// (a group with smaller blocks holds more layers in each), so one pool serves all groups. Read
/// from `Scheduler.kv_groups`.
#[pyclass(name = "GroupSpec", module = "pagedkv", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyGroupSpec {
    pub inner: GroupSpec,
}

#[pymethods]
impl PyGroupSpec {
    #[getter]
    fn layer(&self) -> PyLayerSpec {
        PyLayerSpec {
            inner: self.inner.layer,
        }
    }

    #[getter]
    fn layers(&self) -> Vec<usize> {
        self.inner.layers.clone()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }

    fn __repr__(&self) -> String {
        format!(
            "GroupSpec(layer={}, layers={:?}, block_size={})",
            self.layer().__repr__(),
            self.inner.layers,
            self.inner.block_size
        )
    }
}
