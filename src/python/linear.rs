//! `pagedkv._core.Linear`: a packed or quantized weight and its product, a thin shell over
//! [`crate::compute::linear::Linear`]. A float weight is read without a copy when C- or
//! Fortran-contiguous (a `.T` of an `[out, in]` checkpoint matrix is the latter); a quantized one
//! is copied once from the file's bytes; inputs are read in C order; the GIL is released while
//! packing and computing.

use std::sync::Arc;

use numpy::ndarray::{Ix1, Ix2};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::args::{c_order, expect_shape, opt, typed_array, Param};
use super::errors::IntoPyResult;
use crate::compute::cpu::Isa;
use crate::compute::linear::quant::QuantFormat;
use crate::compute::linear::{self, Linear};
use crate::store::dtype::KvDtype;

/// A weight `W` (`[in_features, out_features]`) stored as float32, float16 or bfloat16, or kept
/// in GGUF's quantized formats (:meth:`Linear.quantized`), and `y = x @ W` for float32 `x`
/// `[M, in_features]`, summed in float32 on the attention threads.
#[pyclass(name = "Linear", module = "pagedkv", frozen)]
pub struct PyLinear {
    pub(crate) inner: Arc<Linear>,
}

#[pymethods]
impl PyLinear {
    #[new]
    #[pyo3(signature = (weight, dtype=Param::Absent), text_signature = "(weight, dtype='float32')")]
    fn new(py: Python<'_>, weight: &Bound<'_, PyAny>, dtype: Param<'_>) -> PyResult<Self> {
        let dtype: String = dtype.or("dtype", "float32".into())?;
        let dtype: KvDtype = dtype.parse().py_err()?;
        let array: PyReadonlyArray<'_, f32, Ix2> = typed_array(weight, "weight", "float32")?;
        let (k, n) = (array.shape()[0], array.shape()[1]);
        // A Fortran-ordered array's memory is its transpose in C order: read it with swapped strides.
        let fortran = !array.is_c_contiguous() && array.is_fortran_contiguous();
        let (data, strides) = match array.as_slice() {
            Ok(slice) if fortran => (std::borrow::Cow::Borrowed(slice), (1, k)),
            _ => (c_order(&array)?, (n, 1)),
        };
        let inner = py
            .detach(|| Linear::new(&data, k, n, strides, dtype))
            .py_err()?;
        Ok(PyLinear {
            inner: Arc::new(inner),
        })
    }

    /// A weight kept quantized as a GGUF file ships it: `parts` are `(format, rows)` segments of
    /// `W`'s transpose stacked in order, each `rows` a uint8 array `[n, row bytes]` of whole
    /// rows of `in_features` weights in `format` ("q8_0", "q4_0", "q4_1", "q5_0", "q4_k" or
    /// "q6_k"; any case). Several segments make one fused projection of mixed formats.
    #[staticmethod]
    fn quantized(
        py: Python<'_>,
        in_features: usize,
        parts: Vec<(String, Bound<'_, PyAny>)>,
    ) -> PyResult<Self> {
        let mut segments = Vec::with_capacity(parts.len());
        for (format, rows) in &parts {
            let format: QuantFormat = format.parse().py_err()?;
            let rows: PyReadonlyArray<'_, u8, Ix2> = typed_array(rows, "rows", "uint8")?;
            segments.push((format, c_order(&rows)?.into_owned()));
        }
        let inner = py
            .detach(|| Linear::quantized(in_features, segments))
            .py_err()?;
        Ok(PyLinear {
            inner: Arc::new(inner),
        })
    }

    /// Rows ``ids`` of a quantized weight's transpose (its output features) as float32
    /// ``[len(ids), in_features]``, bit-exact with ggml's dequantization: what a tied embedding
    /// gathers. A float weight raises ``InvalidArgumentError``.
    fn dequantize_rows<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let array: PyReadonlyArray<'_, i64, Ix1> = typed_array(ids, "ids", "int64")?;
        let ids = array
            .as_array()
            .iter()
            .map(|&id| usize::try_from(id))
            .collect::<Result<Vec<usize>, _>>()
            .map_err(|_| {
                crate::error::Error::InvalidArgument("row ids must not be negative".into())
            })
            .py_err()?;
        let k = self.inner.in_features();
        let mut out = vec![0.0f32; ids.len() * k];
        py.detach(|| self.inner.dequantize_rows(&ids, &mut out))
            .py_err()?;
        Ok(PyArray1::from_vec(py, out)
            .reshape([ids.len(), k])?
            .into_any())
    }

    /// `x @ W` as a new float32 array `[M, out_features]`; `x` is float32 `[M, in_features]` of
    /// any layout. `kernel` (one of :attr:`kernels`) forces a path, for tests.
    #[pyo3(signature = (x, kernel=None))]
    fn __call__<'py>(
        &self,
        py: Python<'py>,
        x: &Bound<'py, PyAny>,
        kernel: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kernel = match opt::<String>(kernel, "kernel")? {
            None => self.inner.default_isa(),
            Some(name) => name.parse().py_err()?,
        };
        let array: PyReadonlyArray<'_, f32, Ix2> = typed_array(x, "x", "float32")?;
        expect_shape(array.shape(), &[None, Some(self.inner.in_features())], "x")?;
        let m = array.shape()[0];
        let x = c_order(&array)?;
        let mut y = vec![0.0f32; m * self.inner.out_features()];
        py.detach(|| self.inner.forward_with(kernel, &x, m, &mut y))
            .py_err()?;
        Ok(PyArray1::from_vec(py, y)
            .reshape([m, self.inner.out_features()])?
            .into_any())
    }

    /// Rows of `W` (the length of an input row).
    #[getter]
    fn in_features(&self) -> usize {
        self.inner.in_features()
    }

    /// Columns of `W` (the length of an output row).
    #[getter]
    fn out_features(&self) -> usize {
        self.inner.out_features()
    }

    /// Storage type: "float32", "float16", "bfloat16", or a quantized weight's formats joined
    /// by "+" ("q4_1", "q5_0+q8_0").
    #[getter]
    fn dtype(&self) -> String {
        self.inner.storage()
    }

    /// The kernels this CPU runs for this weight, fastest first (e.g. `["avx2", "portable"]`).
    #[getter]
    fn kernels(&self) -> Vec<&'static str> {
        Isa::available_of(self.inner.isas())
            .into_iter()
            .map(Isa::name)
            .collect()
    }

    /// Bytes of the stored weight (a float weight's columns padded to a multiple of 16).
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }
}

/// Float-weight linear kernels this CPU can run, fastest first (e.g. `["avx2", "portable"]`;
/// a quantized weight's are its :attr:`Linear.kernels`).
#[pyfunction]
fn available_linear_kernels() -> Vec<&'static str> {
    Isa::available_of(&linear::ISAS)
        .into_iter()
        .map(Isa::name)
        .collect()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLinear>()?;
    m.add_function(wrap_pyfunction!(available_linear_kernels, m)?)?;
    Ok(())
}
