//! What a model declares of its K/V, layer by layer ([`KvSpec`]), and the KV cache layout the
//! runtime derives from it ([`KvCacheConfig`]): the layers split into groups, each group's layers
//! alike in attention kind, KV heads and head size, so one block table per sequence serves a
//! whole group.
//!
//! Invariants of a derived [`KvCacheConfig`]:
//! - every layer of the spec is in exactly one group, each group's layers in increasing order,
//!   groups in the order of their first layer;
//! - two layers share a group exactly when their [`LayerSpec`]s are equal;
//! - every size is positive and a window holds at least one token.
//!
//! A group of `Sliding` layers needs only the last `window` tokens' blocks of a sequence; the
//! runtime keeps one `Full` group today (`KvCacheConfig::single_full_group`), which every model
//! it serves has.

use crate::error::{ensure, Error, Result};
use crate::store::dtype::KvDtype;

/// How a layer attends over the cached tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every earlier token of the sequence.
    Full,
    /// The last `window` tokens (the query's own included).
    Sliding { window: usize },
}

/// What one layer keeps of K/V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayerSpec {
    pub attention: AttentionKind,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// What a model keeps of K/V: one [`LayerSpec`] per layer, and the dtype to store K/V in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSpec {
    pub layers: Vec<LayerSpec>,
    pub dtype: KvDtype,
}

impl KvSpec {
    /// `num_layers` alike layers of full attention (every model the runtime serves today).
    pub fn uniform(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> Self {
        let layer = LayerSpec {
            attention: AttentionKind::Full,
            num_kv_heads,
            head_dim,
        };
        KvSpec {
            layers: vec![layer; num_layers],
            dtype,
        }
    }
}

/// Layers whose K/V one block table per sequence addresses: alike in attention kind, KV heads and
/// head size, in blocks of `block_size` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    pub layer: LayerSpec,
    /// The model's layer numbers, increasing.
    pub layers: Vec<usize>,
    pub block_size: usize,
}

/// The KV cache layout of a model: its groups (module invariants).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheConfig {
    pub groups: Vec<GroupSpec>,
    pub dtype: KvDtype,
}

impl KvCacheConfig {
    /// The groups of `spec` in blocks of `block_size` tokens. `InvalidArgument` for a spec
    /// without layers, a zero size or window.
    pub fn derive(spec: &KvSpec, block_size: usize) -> Result<Self> {
        ensure(!spec.layers.is_empty(), || {
            "a KV spec needs at least one layer".into()
        })?;
        ensure(block_size > 0, || "block_size must be positive".into())?;
        let mut groups: Vec<GroupSpec> = Vec::new();
        for (index, layer) in spec.layers.iter().enumerate() {
            ensure(layer.num_kv_heads > 0 && layer.head_dim > 0, || {
                format!("layer {index}: num_kv_heads and head_dim must be positive")
            })?;
            ensure(
                layer.attention != AttentionKind::Sliding { window: 0 },
                || format!("layer {index}: a sliding window must hold at least one token"),
            )?;
            match groups.iter_mut().find(|g| g.layer == *layer) {
                Some(group) => group.layers.push(index),
                None => groups.push(GroupSpec {
                    layer: *layer,
                    layers: vec![index],
                    block_size,
                }),
            }
        }
        Ok(KvCacheConfig {
            groups,
            dtype: spec.dtype,
        })
    }

    /// The one group of a layout with a single `Full` group: what the runtime serves today.
    /// `InvalidArgument`, naming what is missing, for any other layout.
    pub fn single_full_group(&self) -> Result<&GroupSpec> {
        if let [group] = self.groups.as_slice() {
            if group.layer.attention == AttentionKind::Full {
                return Ok(group);
            }
        }
        if self
            .groups
            .iter()
            .any(|g| g.layer.attention != AttentionKind::Full)
        {
            return Err(Error::InvalidArgument(
                "sliding-window layers are not supported yet: the runtime keeps one group of \
                 full-attention layers"
                    .into(),
            ));
        }
        Err(Error::InvalidArgument(format!(
            "layers of {} different shapes (KV heads, head size) need {} KV cache groups; the \
             runtime keeps one group of alike full-attention layers",
            self.groups.len(),
            self.groups.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(attention: AttentionKind, num_kv_heads: usize) -> LayerSpec {
        LayerSpec {
            attention,
            num_kv_heads,
            head_dim: 8,
        }
    }

    #[test]
    fn alike_layers_share_a_group_in_the_order_of_their_first_layer() {
        let full = layer(AttentionKind::Full, 2);
        let local = layer(AttentionKind::Sliding { window: 512 }, 2);
        let spec = KvSpec {
            layers: vec![local, local, full, local, full, local],
            dtype: KvDtype::F16,
        };
        let config = KvCacheConfig::derive(&spec, 16).unwrap();
        let groups: Vec<_> = config
            .groups
            .iter()
            .map(|g| (g.layer, g.layers.clone()))
            .collect();
        assert_eq!(groups, [(local, vec![0, 1, 3, 5]), (full, vec![2, 4])]);
        assert!(config.groups.iter().all(|g| g.block_size == 16));
        assert_eq!(config.dtype, KvDtype::F16);
        assert!(config
            .single_full_group()
            .unwrap_err()
            .to_string()
            .contains("sliding"));
    }

    #[test]
    fn a_uniform_model_is_one_full_group_and_other_shapes_are_more_groups() {
        let spec = KvSpec::uniform(3, 2, 8, KvDtype::F32);
        let config = KvCacheConfig::derive(&spec, 4).unwrap();
        let group = config.single_full_group().unwrap();
        assert_eq!(
            (group.layers.clone(), group.layer),
            (vec![0, 1, 2], spec.layers[0])
        );
        let mut mixed = spec.clone();
        mixed.layers[1].num_kv_heads = 4;
        let config = KvCacheConfig::derive(&mixed, 4).unwrap();
        assert_eq!(config.groups.len(), 2);
        assert!(config
            .single_full_group()
            .unwrap_err()
            .to_string()
            .contains("2 KV cache groups"));
    }

    #[test]
    fn empty_specs_zero_sizes_and_windows_are_refused() {
        let bad = [
            KvSpec::uniform(0, 2, 8, KvDtype::F32),
            KvSpec::uniform(2, 0, 8, KvDtype::F32),
            KvSpec::uniform(2, 2, 0, KvDtype::F32),
            KvSpec {
                layers: vec![layer(AttentionKind::Sliding { window: 0 }, 1)],
                dtype: KvDtype::F32,
            },
        ];
        for spec in &bad {
            assert!(matches!(
                KvCacheConfig::derive(spec, 4),
                Err(Error::InvalidArgument(_))
            ));
        }
        let good = KvSpec::uniform(1, 1, 1, KvDtype::F32);
        assert!(KvCacheConfig::derive(&good, 0).is_err());
    }
}
