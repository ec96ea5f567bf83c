//! What a forward pass touches of the K/V: [`StepKv`], a step's three calls (copy-on-write
//! copies, writes at its slots, attention through its tables), over a runtime's step
//! ([`RuntimeStepKv`]) or a cache of one's own addressed by a step's arrays ([`CacheStepKv`]).
//!
//! Invariants: the step's addressing is the implementation's, never the model's: the model passes
//! a layer and its rows, nothing else. A layer's sliding window comes from where the layout is
//! stated (the runtime's spec, the windows a cache step was made with).

use crate::compute::attention::{self, AttentionBatch};
use crate::compute::cpu::Isa;
use crate::error::{Error, Result};
use crate::ids::CopyOp;
use crate::runtime::{KvRuntime, Step};
use crate::store::kv_cache::KvCache;

/// The K/V calls of one step, in the order a forward pass makes them.
pub trait StepKv {
    /// Applies the step's copy-on-write block copies (before any attention reads the K/V).
    fn copy_blocks(&mut self) -> Result<()>;
    /// Stores each token's `keys` and `values` (`[num_tokens, num_kv_heads, head_dim]`) of `layer`.
    fn write(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<()>;
    /// Attention of `query` (`[num_tokens, num_heads, head_dim]`) over `layer` into `out`.
    fn attention(
        &mut self,
        layer: usize,
        query: &[f32],
        num_heads: usize,
        scale: f32,
        out: &mut [f32],
    ) -> Result<()>;
}

/// A runtime's step (`KvRuntime::write`, `copy_blocks`, `attention`), on attention path `isa`.
pub struct RuntimeStepKv<'a> {
    pub runtime: &'a KvRuntime,
    pub step: &'a Step,
    pub isa: Isa,
}

impl StepKv for RuntimeStepKv<'_> {
    fn copy_blocks(&mut self) -> Result<()> {
        self.runtime.copy_blocks(self.step)
    }

    fn write(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        self.runtime.write(self.step, layer, keys, values)
    }

    fn attention(
        &mut self,
        layer: usize,
        query: &[f32],
        num_heads: usize,
        scale: f32,
        out: &mut [f32],
    ) -> Result<()> {
        let (runtime, step) = (self.runtime, self.step);
        runtime.attention(step, self.isa, layer, query, num_heads, scale, out)
    }
}

/// A cache of one's own addressed by one group's step arrays, each layer over its `windows`
/// entry (None: full attention), on attention path `isa`.
pub struct CacheStepKv<'a> {
    pub cache: &'a mut KvCache,
    pub slot_mapping: &'a [i64],
    pub batch: AttentionBatch<'a>,
    pub copy_ops: &'a [CopyOp],
    pub windows: &'a [Option<usize>],
    pub isa: Isa,
}

impl StepKv for CacheStepKv<'_> {
    fn copy_blocks(&mut self) -> Result<()> {
        self.cache.copy_blocks(self.copy_ops)
    }

    fn write(&mut self, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        self.cache.write(layer, keys, values, self.slot_mapping)
    }

    fn attention(
        &mut self,
        layer: usize,
        query: &[f32],
        num_heads: usize,
        scale: f32,
        out: &mut [f32],
    ) -> Result<()> {
        let window = *self.windows.get(layer).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "layer {layer} has no window entry ({} given)",
                self.windows.len()
            ))
        })?;
        attention::paged_attention_with(
            self.isa,
            self.cache,
            layer,
            query,
            num_heads,
            &self.batch,
            scale,
            window,
            out,
        )
    }
}
