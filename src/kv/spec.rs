//! What a model declares of its K/V, layer by layer ([`KvSpec`]), and the KV cache layout the
//! runtime derives from it ([`KvCacheConfig`]): the layers split into groups, each group's layers
//! alike in KV heads and head size, so one block table per sequence serves a whole group.
//!
//! Invariants of a derived [`KvCacheConfig`]:
//! - every layer of the spec is in exactly one group, each group's layers in increasing order,
//!   groups in the order of their first layer;
//! - two layers share a group exactly when their KV heads and head size are equal, whatever
//!   their attention kind;
//! - a group's `layer.attention` says what it keeps of each sequence: `Sliding { window }` when
//!   every layer of the group is sliding (`window` the widest: the scheduler releases the blocks
//!   wholly before it), else `Full`, every token. Each layer's own window is applied by attention,
//!   which reads it from the layer's [`LayerSpec`] in the [`KvSpec`] (one fact, one place). A
//!   model mixing full and sliding layers of one shape (Gemma 3) is one `Full` group today:
//!   splitting it in two, so its sliding layers keep only their window, is the next step;
//! - every size is positive and a window holds at least one token.
//!
//! The runtime keeps one group today (`KvCacheConfig::single_group`): a model whose layers all
//! have one K/V shape, full-attention and sliding-window layers alike (Gemma 3's).

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

impl AttentionKind {
    /// The tokens a query attends over, its own included; None for full attention.
    pub fn window(self) -> Option<usize> {
        match self {
            AttentionKind::Full => None,
            AttentionKind::Sliding { window } => Some(window),
        }
    }
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

/// Layers whose K/V one block table per sequence addresses: alike in KV heads and head size, in
/// blocks of `block_size` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    /// The layers' KV heads and head size, and in `attention` what the group keeps of each
    /// sequence (module invariants; each layer's own kind is in the spec).
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

/// What a group keeps once a layer of kind `layer` joins a group keeping `group`: the last `w`
/// tokens while every layer is sliding (`w` the widest window), else every token.
fn kept(group: AttentionKind, layer: AttentionKind) -> AttentionKind {
    match (group, layer) {
        (AttentionKind::Sliding { window: a }, AttentionKind::Sliding { window: b }) => {
            AttentionKind::Sliding { window: a.max(b) }
        }
        _ => AttentionKind::Full,
    }
}

impl KvCacheConfig {
    /// The groups of `spec` in blocks of `block_size` tokens: one per K/V shape, keeping what its
    /// layers need (module invariants). `InvalidArgument` for a spec without layers, a zero size
    /// or window.
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
            let shape = |l: &LayerSpec| (l.num_kv_heads, l.head_dim);
            match groups.iter_mut().find(|g| shape(&g.layer) == shape(layer)) {
                Some(group) => {
                    group.layers.push(index);
                    group.layer.attention = kept(group.layer.attention, layer.attention);
                }
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

    /// The one group of a layout whose layers all have one K/V shape: what the runtime serves
    /// today. `InvalidArgument`, naming the shapes, for a layout of several groups.
    pub fn single_group(&self) -> Result<&GroupSpec> {
        match self.groups.as_slice() {
            [group] => Ok(group),
            groups => Err(Error::InvalidArgument(format!(
                "layers of {} different shapes (KV heads, head size: {}) need {} KV cache \
                 groups; the runtime keeps one group, of layers alike in KV heads and head size",
                groups.len(),
                groups
                    .iter()
                    .map(|g| format!("{}×{}", g.layer.num_kv_heads, g.layer.head_dim))
                    .collect::<Vec<_>>()
                    .join(", "),
                groups.len()
            ))),
        }
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
    fn layers_of_one_shape_share_a_group_in_the_order_of_their_first_layer() {
        let (full, local) = (AttentionKind::Full, AttentionKind::Sliding { window: 512 });
        let spec = KvSpec {
            layers: vec![
                layer(local, 2),
                layer(local, 2),
                layer(full, 4),
                layer(full, 2),
                layer(local, 4),
                layer(local, 2),
            ],
            dtype: KvDtype::F16,
        };
        let config = KvCacheConfig::derive(&spec, 16).unwrap();
        let groups: Vec<_> = config
            .groups
            .iter()
            .map(|g| (g.layer, g.layers.clone()))
            .collect();
        // Sliding and full layers of a shape share its group, which keeps every token.
        assert_eq!(
            groups,
            [
                (layer(full, 2), vec![0, 1, 3, 5]),
                (layer(full, 4), vec![2, 4])
            ]
        );
        assert!(config.groups.iter().all(|g| g.block_size == 16));
        assert_eq!(config.dtype, KvDtype::F16);
        assert!(config
            .single_group()
            .unwrap_err()
            .to_string()
            .contains("2 KV cache groups"));
    }

    #[test]
    fn a_model_of_one_shape_is_one_group_whatever_its_windows() {
        let spec = KvSpec::uniform(3, 2, 8, KvDtype::F32);
        let config = KvCacheConfig::derive(&spec, 4).unwrap();
        let group = config.single_group().unwrap();
        assert_eq!(
            (group.layers.clone(), group.layer),
            (vec![0, 1, 2], spec.layers[0])
        );
        // Gemma 3's pattern: sliding layers around a full one, one shape.
        let mut gemma = spec.clone();
        gemma.layers[0].attention = AttentionKind::Sliding { window: 4 };
        gemma.layers[2].attention = AttentionKind::Sliding { window: 4 };
        assert_eq!(
            KvCacheConfig::derive(&gemma, 4).unwrap(),
            config,
            "the group keeps every token; the windows stay in the spec"
        );
        let windows: Vec<_> = gemma.layers.iter().map(|l| l.attention.window()).collect();
        assert_eq!(windows, [Some(4), None, Some(4)]);
        let mut mixed = spec.clone();
        mixed.layers[1].num_kv_heads = 4;
        let config = KvCacheConfig::derive(&mixed, 4).unwrap();
        assert_eq!(config.groups.len(), 2);
        assert!(config
            .single_group()
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
