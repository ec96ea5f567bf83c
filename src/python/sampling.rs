//! `_core.sample_rows`: the sampling kernel (`crate::compute::sampling`) over numpy arrays, GIL released.
//! Each row's parameters come as one row of a float64 matrix whose columns [`COLUMNS`] names
//! (exported as `_core.SAMPLING_COLUMNS`, which `pagedkv.sampling` builds it by); the
//! values were validated by `SamplingParams`, this checks only what memory safety needs.

use std::borrow::Cow;
use std::ops::Range;

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

/// The `rows` ranges of CSR `offsets` into arrays of `len` elements, or a `ShapeError`.
fn csr_rows(offsets: &[i64], rows: usize, len: usize, what: &str) -> PyResult<Vec<Range<usize>>> {
    let valid = offsets[0] == 0
        && offsets[rows] as usize == len
        && offsets.windows(2).all(|w| w[0] <= w[1]);
    match valid {
        true => Ok(offsets
            .windows(2)
            .map(|w| w[0] as usize..w[1] as usize)
            .collect()),
        false => Err(shape_error(format!(
            "{what}_offsets must rise from 0 to the length of its {what} arrays"
        ))),
    }
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
    expect_shape(offsets.shape(), &[Some(rows + 1)], "history_offsets")?;
    let params: Cow<'_, [f64]> = c_order(&params)?;
    let row_params = params
        .chunks(COLUMNS.len())
        .map(row_params)
        .collect::<PyResult<Vec<_>>>()?;
    let offsets = c_order(&offsets)?;
    let (tokens, counts) = (c_order(&tokens)?, c_order(&counts)?);
    if tokens.len() != counts.len() {
        return Err(shape_error(
            "history_tokens and history_counts differ in length".into(),
        ));
    }
    let histories: Vec<History<'_>> = csr_rows(&offsets, rows, tokens.len(), "history")?
        .into_iter()
        .map(|r| History {
            tokens: &tokens[r.clone()],
            counts: &counts[r],
        })
        .collect();
    let bias_offsets: PyReadonlyArray<'py, i64, Ix1> =
        typed_array(bias_offsets, "bias_offsets", "int64")?;
    let bias_tokens: PyReadonlyArray<'py, i32, Ix1> =
        typed_array(bias_tokens, "bias_tokens", "int32")?;
    let bias_values: PyReadonlyArray<'py, f32, Ix1> =
        typed_array(bias_values, "bias_values", "float32")?;
    expect_shape(bias_offsets.shape(), &[Some(rows + 1)], "bias_offsets")?;
    let bias_offsets = c_order(&bias_offsets)?;
    let (bias_tokens, bias_values) = (c_order(&bias_tokens)?, c_order(&bias_values)?);
    if bias_tokens.len() != bias_values.len() {
        return Err(shape_error(
            "bias_tokens and bias_values differ in length".into(),
        ));
    }
    let biases: Vec<Bias<'_>> = csr_rows(&bias_offsets, rows, bias_tokens.len(), "bias")?
        .into_iter()
        .map(|r| Bias {
            tokens: &bias_tokens[r.clone()],
            values: &bias_values[r],
        })
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
