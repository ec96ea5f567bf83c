//! Argument conversion shared by the bindings: token lists, sizes, ids, numpy arrays. Every
//! failure is an `InvalidArgumentError` or `ShapeError` naming the argument.

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use super::errors::to_py;
use crate::Error;

pub fn invalid(message: String) -> PyErr {
    to_py(Error::InvalidArgument(message))
}

pub fn shape_error(message: String) -> PyErr {
    to_py(Error::Shape(message))
}

/// Token ids from a list/tuple of ints or a 1-D integer numpy array.
pub fn token_ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u32>> {
    let values: Vec<i64> = if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        obj.extract::<Vec<i64>>()
            .map_err(|_| invalid(format!("{name} must hold only int token ids")))?
    } else if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        array
            .as_slice()
            .map(<[i64]>::to_vec)
            .unwrap_or_else(|_| array.as_array().to_vec())
    } else if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        array.as_array().iter().map(|&t| i64::from(t)).collect()
    } else if obj.is_instance_of::<pyo3::types::PyString>()
        || obj.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(invalid(format!(
            "{name} must be a sequence of int token ids, not a string"
        )));
    } else {
        obj.extract::<Vec<i64>>().map_err(|_| {
            invalid(format!(
                "{name} must be a sequence of int token ids or a 1-D integer array"
            ))
        })?
    };
    values
        .into_iter()
        .map(|t| {
            u32::try_from(t).map_err(|_| invalid(format!("{name}: token id {t} outside 0..2^32")))
        })
        .collect()
}

/// A strictly positive size.
pub fn positive(value: i64, name: &str) -> PyResult<usize> {
    if value > 0 {
        Ok(value as usize)
    } else {
        Err(invalid(format!("{name} must be positive, got {value}")))
    }
}

/// A non-negative id or index.
pub fn non_negative(value: i64, name: &str) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| invalid(format!("{name} must be non-negative, got {value}")))
}

/// Checks a numpy array's shape against `expected` (`None` = any extent).
pub fn expect_shape(shape: &[usize], expected: &[Option<usize>], name: &str) -> PyResult<()> {
    let fits = shape.len() == expected.len()
        && shape
            .iter()
            .zip(expected)
            .all(|(&s, e)| e.is_none_or(|e| e == s));
    if fits {
        Ok(())
    } else {
        let want: Vec<String> = expected
            .iter()
            .map(|e| e.map_or("*".into(), |e| e.to_string()))
            .collect();
        Err(shape_error(format!(
            "{name} has shape {shape:?}, expected [{}]",
            want.join(", ")
        )))
    }
}

/// The elements of a numpy array in C order, borrowed when it is C-contiguous, copied otherwise
/// (`as_slice` alone also borrows a Fortran-ordered array, in its memory order).
pub fn c_order<'a, T: numpy::Element + Clone, D: numpy::ndarray::Dimension>(
    array: &'a numpy::PyReadonlyArray<'_, T, D>,
) -> std::borrow::Cow<'a, [T]> {
    match array.as_slice() {
        Ok(slice) if array.is_c_contiguous() => std::borrow::Cow::Borrowed(slice),
        _ => std::borrow::Cow::Owned(array.as_array().iter().cloned().collect()),
    }
}

/// Extracts a numpy array of element type `T`, or a `ShapeError` naming the dtype expected.
pub fn typed_array<'py, T: numpy::Element, D: numpy::ndarray::Dimension>(
    obj: &Bound<'py, PyAny>,
    name: &str,
    dtype: &str,
) -> PyResult<numpy::PyReadonlyArray<'py, T, D>> {
    obj.extract().map_err(|_| {
        let got = obj
            .getattr("dtype")
            .and_then(|d| d.str())
            .map(|d| {
                format!(
                    "{} array of ndim {}",
                    d,
                    obj.getattr("ndim")
                        .map(|n| n.to_string())
                        .unwrap_or_default()
                )
            })
            .unwrap_or_else(|_| {
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            });
        shape_error(format!(
            "{name} must be a {dtype} numpy array of ndim {}, got {got}",
            D::NDIM.unwrap_or(0)
        ))
    })
}
