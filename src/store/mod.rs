//! Storage of K/V bytes: [`kv_cache::KvCache`] (every layer's blocks, shared with a tier's I/O
//! thread block by block) in a [`dtype::KvDtype`], over the large fallible buffers of `buffer`.

pub(crate) mod buffer;
pub mod dtype;
pub mod kv_cache;
