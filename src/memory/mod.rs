//! Memory for KV blocks: [`free_list::FreeList`] (lock-free ids, shared with a tier's I/O thread)
//! → [`block_pool::BlockPool`] (ref counts, block states, eviction by [`eviction`], the prefix map of
//! [`prefix_cache`]) → [`block_manager::BlockManager`] (block tables of [`block_table`], prefix
//! sharing, copy-on-write, the tier protocol's driver); [`events`] are what it tells a router.

pub mod block_manager;
pub mod block_pool;
pub mod block_table;
pub mod events;
pub mod eviction;
pub mod free_list;
pub mod prefix_cache;
