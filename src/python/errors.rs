//! The mapping from the core's `Error` to the Python exception classes of `pagedkv.errors`
//! (defined in Python so they can also subclass `KeyError` / `ValueError` / `RuntimeError`).
//!
//! Each class is declared once here with `import_exception!` and its type object cached on first
//! use, so raising looks nothing up by name. `check_classes` runs at `_core` import and fails it
//! (an `ImportError`-like error, not a panic) if `pagedkv.errors` lacks a class; after it, the
//! cached lookups cannot fail.

use pyo3::exceptions::PyMemoryError;
use pyo3::import_exception;
use pyo3::prelude::*;

use crate::error::Error;

import_exception!(pagedkv.errors, OutOfBlocksError);
import_exception!(pagedkv.errors, UnknownSequenceError);
import_exception!(pagedkv.errors, DuplicateSequenceError);
import_exception!(pagedkv.errors, ShapeError);
import_exception!(pagedkv.errors, InvalidArgumentError);
import_exception!(pagedkv.errors, InternalError);
import_exception!(pagedkv.errors, KvTierError);

/// Every class declared above, by name.
const CLASSES: [&str; 7] = [
    "OutOfBlocksError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "ShapeError",
    "InvalidArgumentError",
    "InternalError",
    "KvTierError",
];

/// Fails unless `pagedkv.errors` defines every class declared here.
pub fn check_classes(py: Python<'_>) -> PyResult<()> {
    let module = py.import("pagedkv.errors")?;
    for name in CLASSES {
        module.getattr(name)?;
    }
    Ok(())
}

/// Converts a core error into its Python exception (built lazily: no GIL needed here).
pub fn to_py(error: Error) -> PyErr {
    let message = error.to_string();
    match error {
        Error::OutOfBlocks { .. } => OutOfBlocksError::new_err(message),
        Error::UnknownSequence(_) => UnknownSequenceError::new_err(message),
        Error::DuplicateSequence(_) => DuplicateSequenceError::new_err(message),
        Error::Shape(_) => ShapeError::new_err(message),
        Error::InvalidArgument(_) => InvalidArgumentError::new_err(message),
        Error::OutOfMemory(_) => PyMemoryError::new_err(message),
        Error::Io(_) => KvTierError::new_err(message),
        Error::Internal(_) => InternalError::new_err(message),
    }
}

/// `Result<T, Error>` → `PyResult<T>`.
pub trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for crate::error::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}
