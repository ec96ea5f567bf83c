//! The mapping from the core's `Error` to the Python exception classes of `pagedkv.errors` (defined
//! in Python so they can also subclass `KeyError` / `ValueError` / `RuntimeError`). A panic in the
//! core surfaces as `pyo3.PanicException`, never as an abort.

use pyo3::prelude::*;

use crate::Error;

/// Converts a core error into its Python exception.
pub fn to_py(error: Error) -> PyErr {
    let class = match error {
        Error::OutOfBlocks { .. } => "OutOfBlocksError",
        Error::UnknownSequence(_) => "UnknownSequenceError",
        Error::DuplicateSequence(_) => "DuplicateSequenceError",
        Error::Shape(_) => "ShapeError",
        Error::InvalidArgument(_) => "InvalidArgumentError",
    };
    let message = error.to_string();
    Python::attach(|py| {
        match py
            .import("pagedkv.errors")
            .and_then(|module| module.getattr(class))
        {
            Ok(class) => PyErr::from_type(
                class.cast_into().expect("pagedkv.errors holds classes"),
                message,
            ),
            Err(import_error) => import_error,
        }
    })
}

/// `Result<T, Error>` → `PyResult<T>`.
pub trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for crate::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
