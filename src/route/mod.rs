//! Routing requests between replicas: [`prefix_index::PrefixIndex`], which replicas hold which
//! blocks (from their KV events), for the longest cached prefix per replica.

pub mod prefix_index;
