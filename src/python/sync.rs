//! How a binding runs core code, so that no panic ever crosses into Python and no half-changed
//! state is ever used again.
//!
//! - `locked` releases the GIL, then locks the object's mutex, then runs the operation: the GIL
//!   is never held while waiting for the lock (a thread holding the lock may need the GIL), and
//!   the lock is never held across Python code.
//! - `detached` releases the GIL and runs code that needs no lock (constructors).
//! - `guarded` runs code with the GIL held and no lock (code that builds Python objects).
//!
//! A panic becomes `pagedkv.errors.InternalError`. It unwinds through the lock guard, which
//! poisons the mutex, and every later `locked` call on that object raises `InternalError` too
//! rather than use the state the panic left half-changed (hence `AssertUnwindSafe`: the only
//! state a panic can leave broken is behind a mutex that it poisons).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use pyo3::prelude::*;

use super::errors::{to_py, InternalError};

/// Runs `operation` on the state behind `mutex` with the GIL released (see the module doc).
pub fn locked<S, T>(
    py: Python<'_>,
    mutex: &Mutex<S>,
    operation: impl FnOnce(&mut S) -> crate::Result<T> + Send,
) -> PyResult<T>
where
    S: Send,
    T: Send,
{
    py.detach(|| {
        guarded(|| {
            let mut state = mutex.lock().map_err(|_| {
                InternalError::new_err(
                    "an earlier call on this object panicked midway; its state may be \
                     inconsistent, so it refuses every call (make a new one)",
                )
            })?;
            operation(&mut state).map_err(to_py)
        })
    })
}

/// Runs `f` with the GIL released (see the module doc).
pub fn detached<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> crate::Result<T> + Send,
) -> PyResult<T> {
    py.detach(|| guarded(|| f().map_err(to_py)))
}

/// Runs `f`, turning a panic into `InternalError` carrying the panic message.
pub fn guarded<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(InternalError::new_err(format!(
            "pagedkv bug: a call panicked ({message}); please report it"
        )))
    })
}
