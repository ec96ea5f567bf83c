//! What a model declares of its K/V, layer by layer ([`KvSpec`]), and the KV cache layout the
//! runtime derives from it ([`KvCacheConfig`]): the layers split into groups, one block table per
//! sequence and group (`crate::kv::coordinator`), every page one size in bytes.
//!
//! A page holds `block_size` tokens of `page_layers` layers. A group may carve each of its pages
//! into `parts` blocks of `block_size / parts` tokens, each part holding its own layers: `parts`
//! times the layers at `1 / parts` the tokens per block — its own page size in tokens, at the
//! same bytes. So groups size their blocks differently (the roadmap's dynamic page sizing) while
//! every page stays interchangeable: memory moves between groups by a page going back to the one
//! pool, with no split fixed at start-up and no slab or buddy bookkeeping. Sliding groups carve
//! (`sliding_block_size`): their tables waste up to a block at each end of the window, so smaller
//! blocks halve that waste, while a full group's one partial block per sequence is already
//! negligible (measured figures at [`default_sliding_block_size`]).
//!
//! Invariants of a derived [`KvCacheConfig`]:
//! - every layer of the spec is in exactly one group, each group's layers in increasing order,
//!   full-attention groups first, then in the order of their first layer (group 0, whose block
//!   hashes chain from the request's own root, is then a full group in blocks of the pages' size
//!   whenever the model has full attention: what a router hashing a prompt finds);
//! - a group's layers are alike in KV heads, head size and attention kind (`Full`, or `Sliding`
//!   with one window), which its `layer` states: a sliding group's tables release the blocks
//!   behind its window;
//! - every group holds `parts × page_layers` layers in blocks of `block_size / parts` tokens,
//!   but the last of a kind, which may hold fewer (its pages are padded): `page_layers` is the
//!   fewest layers of any kind, so each kind splits into whole groups (Gemma 3, blocks of 16 and
//!   sliding blocks of 8: 3 full layers make one group, its 15 sliding ones two groups of 6 layers
//!   in blocks of 8 and one of 3 in blocks of 16 — the last takes the fewest parts that hold its
//!   layers); `parts` divides `block_size`;
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
    /// Tokens per block of sliding-window groups (a divisor of the cache's block size; module
    /// doc); `None`: [`default_sliding_block_size`].
    pub sliding_block_size: Option<usize>,
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
            sliding_block_size: None,
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

/// What a KV cache group keeps of each sequence, and in blocks of how many tokens: all the
/// coordinator and the scheduler know of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupKeeping {
    pub attention: AttentionKind,
    pub block_size: usize,
}

impl GroupKeeping {
    /// A group of full attention in blocks of `block_size` tokens.
    pub fn full(block_size: usize) -> Self {
        GroupKeeping {
            attention: AttentionKind::Full,
            block_size,
        }
    }
}

/// Where a layer's K/V lies: its group, the store layer holding it (one of a page's
/// `page_layers`) and its part of each page there (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerPlace {
    pub group: usize,
    pub page_layer: usize,
    pub part: usize,
}

/// The KV cache layout of a model: its groups (module invariants).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheConfig {
    pub groups: Vec<GroupSpec>,
    pub dtype: KvDtype,
    /// Tokens a page holds of each of its layers.
    pub block_size: usize,
    /// Layers of a page (the store's layers).
    pub page_layers: usize,
}

/// Tokens per block of sliding-window groups when a spec does not say, for pages of
/// `block_size` tokens: half of them when that divides evenly, else `block_size`.
///
/// Measured on Gemma 3 270M's layout, pages of 16 (AMD EPYC Zen 3, 2 cores):
/// - slots held but not read in the sliding groups (`python -m lab bench kv-groups`, the
///   conversation trace's lengths x 4): 2.9% with blocks of 16, 1.85% with 8 (the last group's 3
///   layers keep 16), 1.7% with 4; the full group's 0.25% unchanged;
/// - groups 6 → 4 (→ 3 with 4), scheduler time per step on that trace 46.9 → 48.0 µs (+2%,
///   median of 3, same 1,691 steps: `Scheduler` alone), tables twice as wide (the step's width is
///   the smallest block's);
/// - the attention kernel on tiles of 8 vs 16 tokens (`bench attention --quick --dtypes
///   float16`, 2 runs): within the runs' noise (batch 16 at 2k: 25.6 vs 25.2–26.8 GB/s).
///
/// Halving is the gain with no measured cost; quartering adds little (1.85 → 1.7%) for tables
/// twice as wide again.
pub fn default_sliding_block_size(block_size: usize) -> usize {
    match block_size % 2 {
        0 => block_size / 2,
        _ => block_size,
    }
}

impl KvCacheConfig {
    /// The groups of `spec` in pages of `block_size` tokens (module invariants).
    /// `InvalidArgument` for a spec without layers, a zero size or window, layers of several
    /// K/V shapes, or a sliding block size that does not divide `block_size`.
    pub fn derive(spec: &KvSpec, block_size: usize) -> Result<Self> {
        ensure(!spec.layers.is_empty(), || {
            "a KV spec needs at least one layer".into()
        })?;
        ensure(block_size > 0, || "block_size must be positive".into())?;
        let sliding_block_size = spec
            .sliding_block_size
            .unwrap_or_else(|| default_sliding_block_size(block_size));
        ensure(
            sliding_block_size > 0 && block_size.is_multiple_of(sliding_block_size),
            || {
                format!(
                    "sliding_block_size {sliding_block_size} must divide block_size {block_size} \
                     (a page is carved into equal blocks)"
                )
            },
        )?;
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
        let mut groups: Vec<GroupSpec> = Vec::new();
        for (layer, layers) in &kinds {
            let parts = match layer.attention {
                AttentionKind::Full => 1,
                AttentionKind::Sliding { .. } => block_size / sliding_block_size,
            };
            for chunk in layers.chunks(page_layers * parts) {
                // The last group of a kind takes the fewest parts that hold its layers.
                let parts = (chunk.len().div_ceil(page_layers)..=parts)
                    .find(|&p| block_size.is_multiple_of(p))
                    .expect("`parts` itself divides block_size");
                groups.push(GroupSpec {
                    layer: *layer,
                    layers: chunk.to_vec(),
                    block_size: block_size / parts,
                });
            }
        }
        // Full attention first: group 0's hashes chain from the request's root in blocks of the
        // pages' size, as a router hashes a prompt (`crate::memory::events`).
        groups.sort_by_key(|g| (g.layer.attention != AttentionKind::Full, g.layers[0]));
        Ok(KvCacheConfig {
            groups,
            dtype: spec.dtype,
            block_size,
            page_layers,
        })
    }

    /// The layout in words, for a disk tier's identity: each group's attention, block size and
    /// layers (`|groups full/16/[5, 11, 17] sliding512/8/[0, 1, 2, 3, 4, 6] ...`).
    pub fn fingerprint(&self) -> String {
        let groups: Vec<String> = (self.groups.iter())
            .map(|g| {
                let kind = match g.layer.attention {
                    AttentionKind::Full => "full".to_string(),
                    AttentionKind::Sliding { window } => format!("sliding{window}"),
                };
                format!("{kind}/{}/{:?}", g.block_size, g.layers)
            })
            .collect();
        format!("|groups {}", groups.join(" "))
    }

    /// Blocks each page of `group` is carved into.
    pub fn parts(&self, group: usize) -> usize {
        self.block_size / self.groups[group].block_size
    }

    /// What each group keeps of a sequence, in group order.
    pub fn kept(&self) -> Vec<GroupKeeping> {
        self.groups
            .iter()
            .map(|g| GroupKeeping {
                attention: g.layer.attention,
                block_size: g.block_size,
            })
            .collect()
    }

    /// Where each layer's K/V lies: a group's `i`-th layer is in store layer `i / parts`, part
    /// `i % parts` of each page.
    pub fn layer_places(&self) -> Vec<LayerPlace> {
        let num_layers = self.groups.iter().map(|g| g.layers.len()).sum();
        let origin = LayerPlace {
            group: 0,
            page_layer: 0,
            part: 0,
        };
        let mut places = vec![origin; num_layers];
        for (g, group) in self.groups.iter().enumerate() {
            let parts = self.parts(g);
            for (index, &layer) in group.layers.iter().enumerate() {
                places[layer] = LayerPlace {
                    group: g,
                    page_layer: index / parts,
                    part: index % parts,
                };
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
            sliding_block_size: Some(16),
        };
        let config = KvCacheConfig::derive(&spec, 16).unwrap();
        assert_eq!(
            groups(&config),
            [
                (full, vec![5, 11, 17]),
                (local, vec![0, 1, 2]),
                (local, vec![3, 4, 6]),
                (local, vec![7, 8, 9]),
                (local, vec![10, 12, 13]),
                (local, vec![14, 15, 16]),
            ]
        );
        assert_eq!(config.page_layers, 3);
        assert!(config.groups.iter().all(|g| g.block_size == 16));
        let place = |group, page_layer, part| LayerPlace {
            group,
            page_layer,
            part,
        };
        let places = config.layer_places();
        let picked = (places[5], places[6], places[17]);
        assert_eq!(picked, (place(0, 0, 0), place(2, 2, 0), place(0, 2, 0)));
        let full_groups = config.kept().iter().filter(|k| k.attention == full).count();
        assert_eq!(full_groups, 1);
        // Sliding blocks of 8 (the default for 16): each sliding page holds 6 layers in two
        // parts, but the last sliding group's 3 layers fill a page of 16 tokens whole.
        let carved = KvSpec {
            sliding_block_size: None,
            ..spec.clone()
        };
        let config = KvCacheConfig::derive(&carved, 16).unwrap();
        assert_eq!(
            groups(&config),
            [
                (full, vec![5, 11, 17]),
                (local, vec![0, 1, 2, 3, 4, 6]),
                (local, vec![7, 8, 9, 10, 12, 13]),
                (local, vec![14, 15, 16]),
            ]
        );
        let sizes: Vec<usize> = config.groups.iter().map(|g| g.block_size).collect();
        assert_eq!((sizes, config.page_layers), (vec![16, 8, 8, 16], 3));
        assert_eq!((config.parts(1), config.parts(3)), (2, 1));
        let places = config.layer_places();
        let picked = (places[4], places[6], places[13], places[16]);
        let expected = (
            place(1, 2, 0),
            place(1, 2, 1),
            place(2, 2, 1),
            place(3, 2, 0),
        );
        assert_eq!(picked, expected);
        // A size that does not divide the page is refused.
        for bad in [Some(0), Some(5), Some(32)] {
            let spec = KvSpec {
                sliding_block_size: bad,
                ..spec.clone()
            };
            assert!(matches!(
                KvCacheConfig::derive(&spec, 16),
                Err(Error::InvalidArgument(m)) if m.contains("must divide")
            ));
        }
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
            sliding_block_size: Some(4),
        };
        let config = KvCacheConfig::derive(&spec, 4).unwrap();
        assert_eq!(
            groups(&config),
            [(full, vec![1, 3]), (local, vec![0, 2]), (local, vec![4])]
        );
        assert_eq!(config.page_layers, 2);
        // Blocks of 1 for the sliding layers: 3 of them in 2 parts of a page (a third is
        // padding), where 4 parts would hold 8.
        let carved = KvSpec {
            sliding_block_size: Some(1),
            ..spec.clone()
        };
        let config = KvCacheConfig::derive(&carved, 4).unwrap();
        assert_eq!(
            groups(&config),
            [(full, vec![1, 3]), (local, vec![0, 2, 4])]
        );
        assert_eq!(config.groups[1].block_size, 2);
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
                sliding_block_size: None,
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
