//! pagedkv: a paged KV cache (PagedAttention) and continuous batching for LLM inference.
//!
//! The core has no Python in it. Memory: [`FreeList`] (lock-free ids) → [`BlockPool`] (ref counts,
//! cached-block LRU, prefix map) → [`BlockManager`] (block tables, prefix sharing, copy-on-write).
//! Storage: [`KvCache`]. Compute: [`attention::paged_attention`]. The Python binding lives in `python/` behind the `python` feature.

mod alloc;
pub mod attention;
pub mod block_manager;
pub mod block_pool;
pub mod block_table;
pub mod disk;
pub mod dtype;
pub mod error;
pub mod free_list;
pub mod kv_cache;
pub mod kv_events;
pub mod linear;
pub mod lru;
mod memory;
pub mod prefix_cache;
pub mod prefix_index;
pub mod sampling;
pub mod scheduler;
mod sync;
pub mod tier;

#[cfg(feature = "python")]
mod python;

/// Index of a physical KV block.
pub type BlockId = u32;
/// A token id.
pub type TokenId = u32;
/// A sequence id in the block manager.
pub type SeqId = u64;

pub use attention::{paged_attention, AttentionBatch};
pub use block_manager::{BlockManager, BlockStats, CopyOp, PrefixMatch, MAX_NUM_BLOCKS};
pub use block_pool::BlockPool;
pub use block_table::BlockTable;
pub use dtype::{KvDtype, KvElement};
pub use error::{Error, Result};
pub use free_list::FreeList;
pub use kv_cache::{KvBuffer, KvCache, KvShape};
pub use scheduler::{Scheduler, SchedulerConfig};
