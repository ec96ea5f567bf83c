//! What a model declares of its K/V, layer by layer ([`KvSpec`]), and the KV cache layout the
//! runtime derives from it ([`KvCacheConfig`]): the layers split into groups, one block table per
//! sequence and group (`crate::kv::coordinator`), every group's pages one size.
//!
//! Invariants of a derived [`KvCacheConfig`]:
//! - every layer of the spec is in exactly one group, each group's layers in increasing order,
//!   groups in the order of their first layer;
//! - a group's layers are alike in KV heads, head size and attention kind (`Full`, or `Sliding`
//!   with one window), which its `layer` states: a sliding group's tables release the blocks
//!   behind its window;
//! - every group holds `page_layers` layers but the last of a kind, which may hold fewer (its
//!   pages are padded): `page_layers` is the fewest layers of any kind, so each kind splits into
//!   whole groups of the same page size (Gemma 3: 3 full layers and 15 sliding ones make one full
//!   group and five sliding groups of 3 layers) — one page size, so a page serves any group;
//! - all layers have one K/V shape (pages of one size; several shapes are refused);
//! - every size is positive and a window holds at least one token.

use crate::error::{ensure, Result};
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
    /// Whether each attention kind gets KV cache groups of its own (the hybrid cache, the
    /// default); false keeps every layer's K/V whole in one group, sliding layers included (their
    /// attention still applies their window): a cache without hybrid groups, the baseline
    /// `bench kv-groups` measures against.
    pub hybrid: bool,
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
            hybrid: true,
        }
    }
}

/// Layers whose K/V one block table per sequence addresses: alike in KV heads, head size and
/// attention kind, in blocks of `block_size` tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSpec {
    /// What every layer of the group keeps (so what the group keeps of each sequence).
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
    /// The groups of `spec` in blocks of `block_size` tokens (module invariants).
    /// `InvalidArgument` for a spec without layers, a zero size or window, or layers of several
    /// K/V shapes.
    pub fn derive(spec: &KvSpec, block_size: usize) -> Result<Self> {
        ensure(!spec.layers.is_empty(), || {
            "a KV spec needs at least one layer".into()
        })?;
        ensure(block_size > 0, || "block_size must be positive".into())?;
        let shape = |l: &LayerSpec| (l.num_kv_heads, l.head_dim);
        for (index, layer) in spec.layers.iter().enumerate() {
            ensure(layer.num_kv_heads > 0 && layer.head_dim > 0, || {
                format!("layer {index}: num_kv_heads and head_dim must be positive")
            })?;
            ensure(
                layer.attention != AttentionKind::Sliding { window: 0 },
                || format!("layer {index}: a sliding window must hold at least one token"),
            )?;
            ensure(shape(layer) == shape(&spec.layers[0]), || {
                format!(
                    "layer {index} keeps {}×{} K/V (KV heads × head size), layer 0 {}×{}: the \
                     KV cache keeps pages of one size, for layers of one shape",
                    layer.num_kv_heads,
                    layer.head_dim,
                    spec.layers[0].num_kv_heads,
                    spec.layers[0].head_dim
                )
            })?;
        }
        // The layers of each attention kind, in order of their first layer (one kind, keeping
        // every token, without hybrid groups).
        let mut kinds: Vec<(LayerSpec, Vec<usize>)> = Vec::new();
        for (index, layer) in spec.layers.iter().enumerate() {
            let layer = match spec.hybrid {
                true => layer,
                false => &LayerSpec {
                    attention: AttentionKind::Full,
                    ..*layer
                },
            };
            match kinds.iter_mut().find(|(kind, _)| kind == layer) {
                Some((_, layers)) => layers.push(index),
                None => kinds.push((*layer, vec![index])),
            }
        }
        let page_layers = kinds.iter().map(|(_, l)| l.len()).min().expect("a layer");
        let mut groups: Vec<GroupSpec> = kinds
            .iter()
            .flat_map(|(layer, layers)| {
                layers.chunks(page_layers).map(|chunk| GroupSpec {
                    layer: *layer,
                    layers: chunk.to_vec(),
                    block_size,
                })
            })
            .collect();
        groups.sort_by_key(|g| g.layers[0]);
        Ok(KvCacheConfig {
            groups,
            dtype: spec.dtype,
        })
    }

    /// Layers a page holds: the most of any group (module invariants).
    pub fn page_layers(&self) -> usize {
        self.groups
            .iter()
            .map(|g| g.layers.len())
            .max()
            .unwrap_or(0)
    }

    /// What each group keeps of a sequence, in group order.
    pub fn kept(&self) -> Vec<AttentionKind> {
        self.groups.iter().map(|g| g.layer.attention).collect()
    }

    /// The group of each layer and its place among the group's layers (its layer in a page).
    pub fn layer_places(&self) -> Vec<(usize, usize)> {
        let num_layers = self.groups.iter().map(|g| g.layers.len()).sum();
        let mut places = vec![(0, 0); num_layers];
        for (g, group) in self.groups.iter().enumerate() {
            for (slot, &layer) in group.layers.iter().enumerate() {
                places[layer] = (g, slot);
            }
        }
        places
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn layer(attention: AttentionKind) -> LayerSpec {
        LayerSpec {
            attention,
            num_kv_heads: 2,
            head_dim: 8,
        }
    }

    fn groups(config: &KvCacheConfig) -> Vec<(AttentionKind, Vec<usize>)> {
        config
            .groups
            .iter()
            .map(|g| (g.layer.attention, g.layers.clone()))
            .collect()
    }

    #[test]
    fn gemma3s_pattern_makes_one_full_group_and_five_sliding_groups_of_three_layers() {
        let (full, local) = (AttentionKind::Full, AttentionKind::Sliding { window: 512 });
        let spec = KvSpec {
            layers: (0..18)
                .map(|i| layer(if i % 6 == 5 { full } else { local }))
                .collect(),
            dtype: KvDtype::F16,
            hybrid: true,
        };
        let config = KvCacheConfig::derive(&spec, 16).unwrap();
        assert_eq!(
            groups(&config),
            [
                (local, vec![0, 1, 2]),
                (local, vec![3, 4, 6]),
                (full, vec![5, 11, 17]),
                (local, vec![7, 8, 9]),
                (local, vec![10, 12, 13]),
                (local, vec![14, 15, 16]),
            ]
        );
        assert_eq!(config.page_layers(), 3);
        assert!(config.groups.iter().all(|g| g.block_size == 16));
        let places = config.layer_places();
        assert_eq!((places[5], places[6], places[17]), ((2, 0), (1, 2), (2, 2)));
        assert_eq!(config.kept().iter().filter(|&&k| k == full).count(), 1);
        // Without hybrid groups: one group of every layer, keeping every token.
        let whole = KvSpec {
            hybrid: false,
            ..spec
        };
        let config = KvCacheConfig::derive(&whole, 16).unwrap();
        assert_eq!(groups(&config), [(full, (0..18).collect::<Vec<_>>())]);
    }

    #[test]
    fn counts_that_do_not_divide_leave_a_padded_last_group_and_one_kind_is_one_group() {
        let (full, local) = (AttentionKind::Full, AttentionKind::Sliding { window: 4 });
        let spec = KvSpec {
            layers: vec![
                layer(local),
                layer(full),
                layer(local),
                layer(full),
                layer(local),
            ],
            dtype: KvDtype::F32,
            hybrid: true,
        };
        let config = KvCacheConfig::derive(&spec, 4).unwrap();
        assert_eq!(
            groups(&config),
            [(local, vec![0, 2]), (full, vec![1, 3]), (local, vec![4])]
        );
        assert_eq!(config.page_layers(), 2);
        let uniform = KvSpec::uniform(3, 2, 8, KvDtype::F32);
        let config = KvCacheConfig::derive(&uniform, 4).unwrap();
        assert_eq!(groups(&config), [(full, vec![0, 1, 2])]);
        // Two windows are two kinds.
        let mut windows = uniform.clone();
        windows.layers[1].attention = AttentionKind::Sliding { window: 8 };
        windows.layers[2].attention = AttentionKind::Sliding { window: 4 };
        let config = KvCacheConfig::derive(&windows, 4).unwrap();
        assert_eq!(config.groups.len(), 3);
    }

    #[test]
    fn empty_specs_zero_sizes_windows_and_mixed_shapes_are_refused() {
        let mut mixed = KvSpec::uniform(2, 2, 8, KvDtype::F32);
        mixed.layers[1].num_kv_heads = 4;
        let bad = [
            KvSpec::uniform(0, 2, 8, KvDtype::F32),
            KvSpec::uniform(2, 0, 8, KvDtype::F32),
            KvSpec::uniform(2, 2, 0, KvDtype::F32),
            KvSpec {
                layers: vec![layer(AttentionKind::Sliding { window: 0 })],
                dtype: KvDtype::F32,
                hybrid: true,
            },
            mixed,
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
