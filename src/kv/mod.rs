//! The KV cache layout of a model: what each layer keeps of K/V ([`spec::KvSpec`]) and the groups
//! of layers the runtime derives from it ([`spec::KvCacheConfig`]); the tables of each sequence in
//! every group over one pool ([`coordinator::KvCoordinator`]).

pub mod coordinator;
pub mod spec;
