//! The one error type of the core. Every fallible public operation returns it, and every variant
//! maps to one Python exception class in `src/python/errors.rs`. An operation that returns an
//! error has changed no state.

use thiserror::Error;

/// Everything that can go wrong in a pagedkv call.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Error {
    /// The pool cannot supply the blocks an operation needs, even after evicting every cached block.
    #[error("out of KV blocks: need {needed}, only {available} can be freed up")]
    OutOfBlocks { needed: usize, available: usize },
    /// No sequence (or request) with this id exists.
    #[error("unknown sequence id {0}")]
    UnknownSequence(String),
    /// A sequence (or request) with this id already exists.
    #[error("sequence id {0} already exists")]
    DuplicateSequence(String),
    /// An array has the wrong shape or dtype.
    #[error("shape or dtype mismatch: {0}")]
    Shape(String),
    /// Any other bad argument: zero sizes, out-of-range ids, NaN, limits that cannot hold.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The allocator refused a buffer (the process is left as it was; Python's `MemoryError`).
    #[error("out of memory: cannot allocate {0}")]
    OutOfMemory(String),
    /// An earlier call panicked while holding this object's state, which it now refuses to use
    /// (Python's `pagedkv.errors.InternalError`).
    #[error("{0}")]
    Internal(String),
    /// The disk tier's files could not be opened, read or written (Python's `OSError`).
    #[error("disk tier I/O: {0}")]
    Io(String),
}

/// Short form used across the core.
pub type Result<T> = std::result::Result<T, Error>;

/// Returns `Error::InvalidArgument` with `message` unless `condition` holds.
pub(crate) fn ensure(condition: bool, message: impl FnOnce() -> String) -> Result<()> {
    if condition {
        Ok(())
    } else {
        Err(Error::InvalidArgument(message()))
    }
}
