//! pagedkv: a paged KV cache (PagedAttention) and continuous batching for LLM inference.
//!
//! The core has no Python in it. Folders by concept:
//! - [`ids`]: the vocabulary (block, token and sequence ids, [`CopyOp`], limits);
//! - [`memory`]: [`FreeList`] (lock-free ids) → [`BlockPool`] (ref counts, cached-block eviction,
//!   prefix map) → [`BlockManager`] (block tables, prefix sharing, copy-on-write), KV events;
//! - [`kv`]: a model's K/V per layer ([`KvSpec`]) and the groups of layers derived from it
//!   ([`KvCacheConfig`]);
//! - [`store`]: [`KvCache`], the K/V bytes of every layer;
//! - [`tier`]: the protocol of a lower KV tier and the disk tier that implements it;
//! - [`scheduler`]: continuous batching over the block manager;
//! - [`compute`]: [`compute::attention::paged_attention`], linear layers, sampling;
//! - [`route`]: the router's prefix index.
//!
//! The Python binding lives in `python/` behind the `python` feature.

mod alloc;
pub mod compute;
pub mod error;
pub mod grammar;
pub mod ids;
pub mod kv;
pub mod memory;
pub mod model;
pub mod route;
pub mod runtime;
pub mod scheduler;
pub mod store;
mod sync;
pub mod tier;

#[cfg(feature = "python")]
mod python;

pub use compute::attention::{paged_attention, AttentionBatch};
pub use error::{Error, Result};
pub use ids::{BlockId, CopyOp, SeqId, TokenId, MAX_NUM_BLOCKS};
pub use kv::spec::{AttentionKind, GroupKeeping, GroupSpec, KvCacheConfig, KvSpec, LayerSpec};
pub use memory::block_manager::{BlockManager, BlockStats, PrefixMatch};
pub use memory::block_pool::BlockPool;
pub use memory::block_table::{BlockTable, RELEASED};
pub use memory::free_list::FreeList;
pub use runtime::{KvRuntime, Step};
pub use scheduler::{Scheduler, SchedulerConfig};
pub use store::dtype::{KvDtype, KvElement};
pub use store::kv_cache::{KvBuffer, KvCache, KvShape, PagePart};
