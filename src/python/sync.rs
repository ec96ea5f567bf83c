//! How a binding runs core code, so that no panic ever crosses into Python and no half-changed
//! state is ever used again.
//!
//! - `locked` releases the GIL, then locks the object's mutex, then runs the operation: the GIL
//!   is never held while waiting for the lock (a thread holding the lock may need the GIL), and
//!   the lock is never held across Python code.
//! - `detached` releases the GIL and runs code that needs no lock (constructors).
//! - `locked_with_gil` keeps the GIL and locks: for calls of a few µs, cheaper than releasing
//!   and retaking the GIL. It cannot deadlock as long as no operation run under that mutex ever
//!   needs the GIL, which holds for every core operation.
//!
//! A panic becomes `pagedkv.errors.InternalError`, and the mutex it unwound through refuses every
//! later `locked` call on that object with `InternalError` too rather than hand out the state the
//! panic left half-changed (`crate::sync::run_locked`).

use std::sync::Mutex;

use pyo3::prelude::*;

use super::errors::{to_py, InternalError};
use crate::sync::{run_guarded, run_locked, Failure};

fn internal(failure: Failure) -> PyErr {
    InternalError::new_err(match failure {
        Failure::Panicked(message) => {
            format!("pagedkv bug: a call panicked ({message}); please report it")
        }
        Failure::Poisoned => "an earlier call on this object panicked midway; its state may be \
                              inconsistent, so it refuses every call (make a new one)"
            .to_string(),
    })
}

/// Runs `operation` on the state behind `mutex` with the GIL released (see the module doc).
pub fn locked<S, T>(
    py: Python<'_>,
    mutex: &Mutex<S>,
    operation: impl FnOnce(&mut S) -> crate::error::Result<T> + Send,
) -> PyResult<T>
where
    S: Send,
    T: Send,
{
    py.detach(|| {
        run_locked(mutex, operation)
            .map_err(internal)?
            .map_err(to_py)
    })
}

/// Runs `operation` on the state behind `mutex`, keeping the GIL (see the module doc).
pub fn locked_with_gil<S, T>(
    mutex: &Mutex<S>,
    operation: impl FnOnce(&mut S) -> crate::error::Result<T>,
) -> PyResult<T> {
    run_locked(mutex, operation)
        .map_err(internal)?
        .map_err(to_py)
}

/// Runs `f` with the GIL released (see the module doc).
pub fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> crate::error::Result<T> + Send,
) -> PyResult<T> {
    py.detach(|| run_guarded(f).map_err(internal)?.map_err(to_py))
}
