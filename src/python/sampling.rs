//! `_core.sample_rows`: the sampling kernel (`crate::compute::sampling`) over numpy arrays, GIL released.
//! Each row's parameters come as one row of a float64 matrix whose columns [`COLUMNS`] names
//! (exported as `_core.SAMPLING_COLUMNS`, which `pagedkv.sampling` builds it by); the
//! values were validated by `SamplingParams`, this checks only what memory safety needs.

use std::borrow::Cow;

use numpy::ndarray::{Ix1, Ix2};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray, PyUntypedArrayMethods};
use pyo3::prelude::*;

use super::args::{c_order, expect_shape, invalid, shape_error, typed_array};
use super::sync::detached;
use crate::compute::sampling::{self, Bias, History, RowParams};

/// The columns of the parameter matrix, in order (`top_logprobs` -1: no logprobs).
const COLUMNS: [&str; 9] = [
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "uniform",
    "top_logprobs",
];

fn row_params(row: &[f64]) -> PyResult<RowParams> {
    let count = |x: f64, name: &str| -> PyResult<usize> {
        if x >= 0.0 && x.fract() == 0.0 && x < u32::MAX as f64 {
            Ok(x as usize)
        } else {
            Err(invalid(format!(
                "{name} must be a non-negative integer, got {x}"
            )))
        }
    };
    Ok(RowParams {
        temperature: row[0] as f32,
        top_k: count(row[1], "top_k")?,
        top_p: row[2] as f32,
        min_p: row[3] as f32,
        presence_penalty: row[4] as f32,
        frequency_penalty: row[5] as f32,
        repetition_penalty: row[6] as f32,
        uniform: row[7],
        top_logprobs: if row[8] < 0.0 {
            None
        } else {
            Some(count(row[8], "top_logprobs")?)
        },
    })
}

/// The `rows` row slices of two parallel arrays in CSR form (`offsets` `[rows + 1]`, rising from 0
/// to their common length), or a `ShapeError` naming the `what_*` arrays.
fn csr_pairs<'a, A, B>(
    offsets: &[i64],
    rows: usize,
    a: &'a [A],
    b: &'a [B],
    what: &str,
) -> PyResult<Vec<(&'a [A], &'a [B])>> {
    let valid = offsets.len() == rows + 1
        && a.len() == b.len()
        && offsets[0] == 0
        && offsets[rows] as usize == a.len()
        && offsets.windows(2).all(|w| w[0] <= w[1]);
    if !valid {
        return Err(shape_error(format!(
            "{what}_offsets must have rows + 1 entries rising from 0 to the common length of its two {what} arrays"
        )));
    }
    let range = |w: &[i64]| w[0] as usize..w[1] as usize;
    Ok(offsets
        .windows(2)
        .map(|w| (&a[range(w)], &b[range(w)]))
        .collect())
}

/// `(tokens int64[rows], logprobs float32[rows], top_ids int64[rows, n], top_logprobs
/// float32[rows, n])` for `logits` float32 `[rows, vocab]`, `params` float64
/// `[rows, len(SAMPLING_COLUMNS)]`, the rows' histories in CSR form (`history_offsets` int64
/// `[rows + 1]` into `history_tokens` and `history_counts`, int32) and their logit biases likewise
/// (`bias_offsets` into `bias_tokens` int32 and `bias_values` float32). `n` is the largest
/// `top_logprobs`; unused entries hold -1 and NaN.
#[pyfunction]
#[allow(clippy::type_complexity, clippy::too_many_arguments)]
fn sample_rows<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    params: &Bound<'py, PyAny>,
    history_offsets: &Bound<'py, PyAny>,
    history_tokens: &Bound<'py, PyAny>,
    history_counts: &Bound<'py, PyAny>,
    bias_offsets: &Bound<'py, PyAny>,
    bias_tokens: &Bound<'py, PyAny>,
    bias_values: &Bound<'py, PyAny>,
) -> PyResult<(
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<f32>>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
)> {
    let logits: PyReadonlyArray<'py, f32, Ix2> = typed_array(logits, "logits", "float32")?;
    let params: PyReadonlyArray<'py, f64, Ix2> = typed_array(params, "params", "float64")?;
    let offsets: PyReadonlyArray<'py, i64, Ix1> =
        typed_array(history_offsets, "history_offsets", "int64")?;
    let tokens: PyReadonlyArray<'py, i32, Ix1> =
        typed_array(history_tokens, "history_tokens", "int32")?;
    let counts: PyReadonlyArray<'py, i32, Ix1> =
        typed_array(history_counts, "history_counts", "int32")?;
    let (rows, vocab) = (logits.shape()[0], logits.shape()[1]);
    expect_shape(params.shape(), &[Some(rows), Some(COLUMNS.len())], "params")?;
    let params: Cow<'_, [f64]> = c_order(&params)?;
    let row_params = params
        .chunks(COLUMNS.len())
        .map(row_params)
        .collect::<PyResult<Vec<_>>>()?;
    let (offsets, tokens, counts) = (c_order(&offsets)?, c_order(&tokens)?, c_order(&counts)?);
    let histories: Vec<History<'_>> = csr_pairs(&offsets, rows, &tokens, &counts, "history")?
        .into_iter()
        .map(|(tokens, counts)| History { tokens, counts })
        .collect();
    let bias_offsets: PyReadonlyArray<'py, i64, Ix1> =
        typed_array(bias_offsets, "bias_offsets", "int64")?;
    let bias_tokens: PyReadonlyArray<'py, i32, Ix1> =
        typed_array(bias_tokens, "bias_tokens", "int32")?;
    let bias_values: PyReadonlyArray<'py, f32, Ix1> =
        typed_array(bias_values, "bias_values", "float32")?;
    let bias_offsets = c_order(&bias_offsets)?;
    let (bias_tokens, bias_values) = (c_order(&bias_tokens)?, c_order(&bias_values)?);
    let biases: Vec<Bias<'_>> = csr_pairs(&bias_offsets, rows, &bias_tokens, &bias_values, "bias")?
        .into_iter()
        .map(|(tokens, values)| Bias { tokens, values })
        .collect();
    let logits = c_order(&logits)?;
    let width = row_params
        .iter()
        .filter_map(|p| p.top_logprobs)
        .max()
        .unwrap_or(0)
        .min(vocab);
    let (tokens, logprobs, top_ids, top_logprobs) = detached(py, || {
        let out = sampling::sample(&logits, vocab, &row_params, &histories, &biases)?;
        let mut top_ids = vec![-1i64; rows * width];
        let mut top_logprobs = vec![f32::NAN; rows * width];
        for (r, s) in out.iter().enumerate() {
            for (j, &(id, lp)) in s.top.iter().enumerate() {
                top_ids[r * width + j] = id as i64;
                top_logprobs[r * width + j] = lp;
            }
        }
        Ok((
            out.iter().map(|s| s.token).collect::<Vec<_>>(),
            out.iter().map(|s| s.logprob).collect::<Vec<_>>(),
            top_ids,
            top_logprobs,
        ))
    })?;
    Ok((
        PyArray1::from_vec(py, tokens),
        PyArray1::from_vec(py, logprobs),
        PyArray1::from_vec(py, top_ids)
            .reshape([rows, width])?
            .into_any(),
        PyArray1::from_vec(py, top_logprobs)
            .reshape([rows, width])?
            .into_any(),
    ))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("SAMPLING_COLUMNS", COLUMNS)?;
    m.add("NO_TOKEN", sampling::NO_TOKEN)?;
    m.add_function(wrap_pyfunction!(sample_rows, m)?)?;
    Ok(())
}
