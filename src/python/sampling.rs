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
#[pyo3(signature = (logits, params, history_offsets, history_tokens, history_counts, bias_offsets, bias_tokens, bias_values, masks=None, mask_rows=None))]
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
    masks: Option<&Bound<'py, PyAny>>,
    mask_rows: Option<&Bound<'py, PyAny>>,
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
        .map(|(tokens, values)| Bias {
            tokens,
            values,
            allowed: None,
        })
        .collect();
    let masks = grammar_masks(masks, mask_rows, rows, vocab)?;
    let mut biases = biases;
    for (row, mask) in &masks.1 {
        biases[*row].allowed =
            Some(&masks.0[*mask * vocab.div_ceil(32)..(*mask + 1) * vocab.div_ceil(32)]);
    }
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

/// The masks' words (C order) and, per masked row, its row of them; `ShapeError` unless both or
/// neither are given, shaped alike, naming distinct rows of the batch.
#[allow(clippy::type_complexity)]
fn grammar_masks(
    masks: Option<&Bound<'_, PyAny>>,
    mask_rows: Option<&Bound<'_, PyAny>>,
    rows: usize,
    vocab: usize,
) -> PyResult<(Vec<u32>, Vec<(usize, usize)>)> {
    let (masks, mask_rows) = match (masks, mask_rows) {
        (None, None) => return Ok((Vec::new(), Vec::new())),
        (Some(m), Some(r)) => (m, r),
        _ => return Err(shape_error("masks and mask_rows come together".to_string())),
    };
    let masks: PyReadonlyArray<'_, u32, Ix2> = typed_array(masks, "masks", "uint32")?;
    let mask_rows: PyReadonlyArray<'_, i64, Ix1> = typed_array(mask_rows, "mask_rows", "int64")?;
    let count = mask_rows.shape()[0];
    expect_shape(
        masks.shape(),
        &[Some(count), Some(vocab.div_ceil(32))],
        "masks",
    )?;
    let mut seen = vec![false; rows];
    let mut pairs = Vec::with_capacity(count);
    for (i, &row) in c_order(&mask_rows)?.iter().enumerate() {
        let row = usize::try_from(row)
            .ok()
            .filter(|&r| r < rows && !seen[r])
            .ok_or_else(|| {
                shape_error(format!(
                    "mask_rows must be distinct rows below {rows}, got {row}"
                ))
            })?;
        seen[row] = true;
        pairs.push((row, i));
    }
    Ok((c_order(&masks)?.into_owned(), pairs))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("SAMPLING_COLUMNS", COLUMNS)?;
    m.add("NO_TOKEN", sampling::NO_TOKEN)?;
    m.add_function(wrap_pyfunction!(sample_rows, m)?)?;
    Ok(())
}
