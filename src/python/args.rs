//! Argument conversion shared by the bindings: one converter per kind of argument (ints of each
//! core type, bools, floats, strings, int sequences, numpy arrays), so every binding refuses a
//! wrong value the same way. Every refusal is an `InvalidArgumentError` (or `ShapeError` for an
//! array's shape) naming the argument; never `TypeError`, `OverflowError` or a panic.
//!
//! Rules: an int argument takes a Python int or anything with `__index__` (numpy ints), never a
//! bool or a float; it must be an int64 and lie in its core type's range (sizes and ids
//! `0..2**63`, token ids `0..2**32`), so -1 and 2**63 are refused alike;
//! a float argument takes an int or a float, never a bool; a str argument must be valid Unicode
//! (no lone surrogates); a path is a str or an `os.PathLike`; raw bytes are a `bytes` object; an
//! int sequence is a list, tuple or other sequence of such ints, or a 1-D integer numpy array,
//! never a str, bytes or a bool array. Range checks beyond the type
//! (positive sizes, limits) belong to the core, which validates each argument once.
//! Bindings take each argument as `&Bound<PyAny>` and convert it with `arg`; one defaulting to
//! `None` as `Option<&Bound<PyAny>>` converted with `opt`; one with another default as a `Param`
//! (signature default `Param::Absent`, the real default in a `text_signature`) converted with
//! `Param::or`, so an explicit `None` is refused where `None` is not a value.

use numpy::{PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyFloat, PyInt, PySequence, PyString};

use super::errors::to_py;
use crate::error::Error;

pub fn invalid(message: String) -> PyErr {
    to_py(Error::InvalidArgument(message))
}

pub fn shape_error(message: String) -> PyErr {
    to_py(Error::Shape(message))
}

/// A Python value as the Rust type of an argument.
pub trait FromArg: Sized {
    fn from_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self>;
}

/// Converts argument `name`.
pub fn arg<T: FromArg>(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<T> {
    T::from_arg(obj, name)
}

/// Converts an argument whose default is `None` (`None` stays `None`).
pub fn opt<T: FromArg>(obj: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<T>> {
    obj.map(|obj| T::from_arg(obj, name)).transpose()
}

/// An argument with a default other than `None`: `Absent` when the caller left it out.
pub enum Param<'py> {
    Absent,
    Given(Bound<'py, PyAny>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Param<'py> {
    type Error = PyErr;

    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Param::Given(obj.to_owned()))
    }
}

impl Param<'_> {
    /// The argument converted, or `default` if it was left out.
    pub fn or<T: FromArg>(&self, name: &str, default: T) -> PyResult<T> {
        match self {
            Param::Absent => Ok(default),
            Param::Given(obj) => T::from_arg(obj, name),
        }
    }
}

/// `None` is `None`; anything else converts as `T`.
impl<T: FromArg> FromArg for Option<T> {
    fn from_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        if obj.is_none() {
            Ok(None)
        } else {
            T::from_arg(obj, name).map(Some)
        }
    }
}

/// A value for messages: `repr` (shortened) and type of a scalar, only the type of anything
/// else (whose repr may be large or run arbitrary code).
fn describe(obj: &Bound<'_, PyAny>) -> String {
    let type_name = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    let scalar = obj.is_none()
        || obj.is_instance_of::<PyBool>()
        || obj.is_instance_of::<PyInt>()
        || obj.is_instance_of::<PyFloat>()
        || obj.is_instance_of::<PyString>()
        || obj.is_instance_of::<PyBytes>();
    if !scalar {
        return format!("a {type_name}");
    }
    let repr = obj.repr().map(|r| r.to_string()).unwrap_or_default();
    match repr.char_indices().nth(60) {
        Some((cut, _)) => format!("{}... ({type_name})", &repr[..cut]),
        None => format!("{repr} ({type_name})"),
    }
}

/// An int type of the core. Every int crossing the binding is an int64 (numpy's default
/// integer, and the type of the output arrays), so sizes and ids take `0..2**63` whatever their
/// width in the core, and 2**63 is refused like -1.
pub trait Int: Copy + TryFrom<i64> {
    /// The accepted range, as named in messages.
    const RANGE: &'static str;
}

impl Int for u32 {
    const RANGE: &'static str = "0..2**32";
}
impl Int for u64 {
    const RANGE: &'static str = "0..2**63";
}
impl Int for usize {
    const RANGE: &'static str = "0..2**63";
}
impl Int for i32 {
    const RANGE: &'static str = "-2**31..2**31";
}
impl Int for i64 {
    const RANGE: &'static str = "-2**63..2**63";
}

/// `obj` as a `T`, or `None` if it is not an int in `T`'s range.
fn int_value<T: Int>(obj: &Bound<'_, PyAny>) -> Option<T> {
    if obj.is_instance_of::<PyBool>() {
        return None;
    }
    T::try_from(obj.extract::<i64>().ok()?).ok()
}

fn refused_int<T: Int>(obj: &Bound<'_, PyAny>, name: impl std::fmt::Display) -> PyErr {
    invalid(format!(
        "{name} must be an int in {}, got {}",
        T::RANGE,
        describe(obj)
    ))
}

fn int<T: Int>(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<T> {
    int_value(obj).ok_or_else(|| refused_int::<T>(obj, name))
}

macro_rules! int_args {
    ($($t:ty),*) => {$(
        impl FromArg for $t {
            fn from_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
                int(obj, name)
            }
        }
    )*};
}
int_args!(u32, u64, usize, i32, i64);

/// A 128-bit block hash (what `block_hashes` returns): an int in `0..2**128`, never a bool.
impl FromArg for u128 {
    fn from_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        let value = (!obj.is_instance_of::<PyBool>())
            .then(|| obj.extract::<u128>().ok())
            .flatten();
        value.ok_or_else(|| {
            invalid(format!(
                "{name} must be an int in 0..2**128, got {}",
                describe(obj)
            ))
        })
    }
}

impl FromArg for bool {
    fn from_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        obj.extract::<bool>()
            .map_err(|_| invalid(format!("{name} must be a bool, got {}", describe(obj))))
    }
}

impl FromArg for f64 {
    fn from_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        let refuse = || invalid(format!("{name} must be a float, got {}", describe(obj)));
        if obj.is_instance_of::<PyBool>() {
            return Err(refuse());
        }
        obj.extract::<f64>().map_err(|_| refuse())
    }
}

impl FromArg for String {
    fn from_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        let text = obj
            .cast::<PyString>()
            .map_err(|_| invalid(format!("{name} must be a str, got {}", describe(obj))))?;
        text.to_str().map(str::to_owned).map_err(|_| {
            invalid(format!(
                "{name} must be valid Unicode (no lone surrogates), got {}",
                describe(obj)
            ))
        })
    }
}

/// A filesystem path: a str or an `os.PathLike` (`pathlib.Path`), as `os.fspath` gives it.
impl FromArg for std::path::PathBuf {
    fn from_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        if obj.is_instance_of::<PyBytes>() {
            return Err(invalid(format!(
                "{name} must be a str or os.PathLike, got {}",
                describe(obj)
            )));
        }
        obj.extract::<std::path::PathBuf>().map_err(|_| {
            invalid(format!(
                "{name} must be a str or os.PathLike, got {}",
                describe(obj)
            ))
        })
    }
}

/// Raw bytes: a `bytes` object only (a str would need an encoding, a sequence of ints is no
/// byte string).
pub struct Bytes(pub Vec<u8>);

impl FromArg for Bytes {
    fn from_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        obj.cast::<PyBytes>()
            .map(|b| Bytes(b.as_bytes().to_vec()))
            .map_err(|_| invalid(format!("{name} must be bytes, got {}", describe(obj))))
    }
}

impl<T: Int> FromArg for Vec<T> {
    fn from_arg(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Self> {
        if obj.is_instance_of::<PyString>()
            || obj.is_instance_of::<PyBytes>()
            || obj.is_instance_of::<PyByteArray>()
        {
            return Err(invalid(format!(
                "{name} must be a sequence of ints, not {}",
                describe(obj)
            )));
        }
        if let Ok(array) = obj.cast::<PyUntypedArray>() {
            return int_array(array, name);
        }
        let items = obj.cast::<PySequence>().map_err(|_| {
            invalid(format!(
                "{name} must be a sequence of ints or a 1-D integer array, got {}",
                describe(obj)
            ))
        })?;
        let mut out = Vec::with_capacity(items.len().unwrap_or(0));
        for (i, item) in items.try_iter()?.enumerate() {
            let item = item?;
            out.push(
                int_value(&item).ok_or_else(|| refused_int::<T>(&item, format!("{name}[{i}]")))?,
            );
        }
        Ok(out)
    }
}

/// The elements of a 1-D numpy array of any integer dtype, each in `T`'s range.
fn int_array<T: Int>(array: &Bound<'_, PyUntypedArray>, name: &str) -> PyResult<Vec<T>> {
    let dtype = array.dtype();
    if array.ndim() != 1 || !matches!(dtype.kind(), b'i' | b'u') {
        return Err(invalid(format!(
            "{name} must be a 1-D integer array, got a {}-D {} array",
            array.ndim(),
            dtype
        )));
    }
    fn convert<T: Int, V: Copy + std::fmt::Display>(
        values: impl Iterator<Item = V>,
        name: &str,
        to: impl Fn(V) -> Option<T>,
    ) -> PyResult<Vec<T>> {
        values
            .enumerate()
            .map(|(i, v)| {
                to(v).ok_or_else(|| {
                    invalid(format!(
                        "{name}[{i}] must be an int in {}, got {v}",
                        T::RANGE
                    ))
                })
            })
            .collect()
    }
    if let Ok(values) = array.extract::<PyReadonlyArray1<'_, i64>>() {
        // A contiguous int64 array (the common prompt): a plain loop over the slice, the error
        // message only on a failure. The element iterator cost ~7 ns an element (20 µs for a
        // 3,180-token prompt); this is a fraction of that.
        if let Ok(slice) = values.as_slice() {
            if let Some(out) = slice.iter().map(|&v| T::try_from(v).ok()).collect() {
                return Ok(out);
            }
        }
        return convert(values.as_array().iter().copied(), name, |v| {
            T::try_from(v).ok()
        });
    }
    // Other widths: one widening copy (uint64 kept unsigned so large values are not wrapped).
    let wide = if dtype.kind() == b'u' {
        "uint64"
    } else {
        "int64"
    };
    let widened = array.call_method1("astype", (wide,))?;
    if let Ok(values) = widened.extract::<PyReadonlyArray1<'_, u64>>() {
        convert(values.as_array().iter().copied(), name, |v| {
            i64::try_from(v).ok().and_then(|v| T::try_from(v).ok())
        })
    } else {
        let values = widened.extract::<PyReadonlyArray1<'_, i64>>()?;
        convert(values.as_array().iter().copied(), name, |v| {
            T::try_from(v).ok()
        })
    }
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

/// The elements of a numpy array in C (index) order: borrowed when its memory is C-contiguous
/// and aligned, else copied from the C-ordered, aligned array `numpy.require` makes of it
/// (Fortran order, strided or reversed views, unaligned buffers). `as_slice` alone is no test: it also borrows a
/// Fortran-contiguous array, whose memory order is not its index order.
pub fn c_order<'a, T: numpy::Element + Clone, D: numpy::ndarray::Dimension>(
    array: &'a numpy::PyReadonlyArray<'_, T, D>,
) -> PyResult<std::borrow::Cow<'a, [T]>> {
    use numpy::PyUntypedArrayMethods;
    if array.is_c_contiguous() && array.is_aligned() {
        if let Ok(slice) = array.as_slice() {
            return Ok(std::borrow::Cow::Borrowed(slice));
        }
    }
    let copy: numpy::PyReadonlyArray<'_, T, D> = array
        .py()
        .import("numpy")?
        .call_method1(
            "require",
            (array.as_any(), None::<()>, ["C_CONTIGUOUS", "ALIGNED"]),
        )?
        .extract()?;
    let elements = copy.as_slice().map_err(|e| shape_error(e.to_string()))?;
    Ok(std::borrow::Cow::Owned(elements.to_vec()))
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
