//! The disk tier of the KV cache: a data file of fixed-size block slots ([`store`]) and a crash-safe
//! index of what each slot holds ([`index`], redb), both private to the user and never reached
//! through a link ([`files`]).
//!
//! Invariant: a block is served only if its index entry exists and its bytes, read back, match the
//! entry's checksum, tokens and group; anything else is dropped, counted and reported as a miss.

pub mod files;
pub mod index;
pub mod store;
pub mod tier;

pub use index::BlockRecord;
pub use store::{DiskCounters, DiskStore, Fetch, NewBlock, Opened};
pub use tier::{DiskTier, DiskTierConfig};

/// What can go wrong in the disk store ([`crate::error::Error`] at the tier's boundary).
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("disk tier I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("disk tier index: {0}")]
    Index(#[from] redb::Error),
    #[error("disk tier: {0}")]
    InvalidArgument(String),
    /// The allocator refused the tier's slot table.
    #[error("disk tier: {0}")]
    OutOfMemory(String),
}

/// Short form of the tier's results.
pub type DiskResult<T> = std::result::Result<T, DiskError>;

impl From<DiskError> for crate::error::Error {
    fn from(error: DiskError) -> Self {
        match error {
            DiskError::InvalidArgument(message) => crate::error::Error::InvalidArgument(message),
            DiskError::OutOfMemory(message) => crate::error::Error::OutOfMemory(message),
            other => crate::error::Error::Io(other.to_string()),
        }
    }
}
