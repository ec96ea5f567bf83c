//! `pagedkv.block_hashes`: the prefix-cache hash chain of a prompt, as Python ints, so a router
//! outside the engine hashes prompts with the very function the block manager uses
//! ([`crate::memory::prefix_cache::salted_block_hashes`]).

use pyo3::prelude::*;

use super::args::{arg, opt};
use super::sync::detached;
use crate::ids::TokenId;
use crate::memory::prefix_cache::{salted_block_hashes, BlockHash};

/// 128-bit chain hashes (as ints) of every full block of `token_ids`, salted by `cache_salt`
/// (requests with different salts never share a hash). Raises InvalidArgumentError for a bad
/// argument (`block_size` must be positive).
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, cache_salt=None))]
fn block_hashes(
    py: Python<'_>,
    token_ids: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
    cache_salt: Option<&Bound<'_, PyAny>>,
) -> PyResult<Vec<BlockHash>> {
    let tokens: Vec<TokenId> = arg(token_ids, "token_ids")?;
    let block_size: usize = arg(block_size, "block_size")?;
    let salt = opt::<String>(cache_salt, "cache_salt")?.map(String::into_bytes);
    detached(py, || {
        salted_block_hashes(&tokens, block_size, salt.as_deref())
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(block_hashes, m)?)
}
