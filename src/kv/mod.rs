//! The KV cache layout of a model: what each layer keeps of K/V ([`spec::KvSpec`]) and the groups
//! of layers the runtime derives from it ([`spec::KvCacheConfig`]).

pub mod spec;
