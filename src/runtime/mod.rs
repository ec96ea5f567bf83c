//! `KvRuntime`: the one owner of a paged runtime — the scheduler (and through it the block
//! manager and pool), the K/V bytes, the optional disk tier, its KV events and figures.
//!
//! The serving loop is `add_request` / `abort` / `finish_sample` from any thread, and, from one,
//! `begin_step` → the model through the [`Step`] (`write`, `copy_blocks`, `attention`) →
//! `finish_step`. Every part stays public on its own (`Scheduler`, `KvCache`, `BlockManager`) to
//! drive by hand; a disk tier attaches only here.
//!
//! Invariants:
//! - The K/V bytes (`store`) are touched only through a step awaiting `finish_step`, at the slots
//!   and through the tables the scheduler gave it (`gate`, `step`). The block manager never hands
//!   the disk tier's I/O thread a block a step's tables hold, so the tier's protocol (no engine
//!   access to a block under a copy: `crate::tier`) holds by construction, not by a promise of
//!   the caller's: that is the safety argument of `open_disk_tier`.
//! - Two locks, so a step's model work (attention over the store) never holds up a request added
//!   or aborted meanwhile: `serving` (the scheduler) and `store`. Lock order: `serving` → the
//!   gate (`begin_step`, `finish_step`), or the gate → `store` (a step's K/V call); no cycle.
//! - A panic inside a call poisons the lock it held; every later call needing that lock is
//!   `Error::Internal` rather than an operation on state the panic may have left half-changed.
//! - The figures of a detached disk tier stay readable (`tier_counters`) after it is closed.
//! - A step's attention over a layer applies the sliding window the K/V spec gives that layer
//!   (`KvRuntime::attention`); the caller has no say, so the spec is the one place it is stated.
//! - The store's pages hold a block of each layer of one KV cache group (`KvCacheConfig`), or of
//!   each part a group carves them into: a layer's K/V is written and read at its place in its
//!   group's pages (store layer and part), through its group's slots and tables, so one pool of
//!   pages serves every group.

mod gate;
mod step;

use std::path::Path;
use std::sync::{Mutex, MutexGuard};

pub use step::Step;

use crate::compute::attention::{self, AttentionBatch};
use crate::compute::cpu::Isa;
use crate::error::{ensure, Error, Result};
use crate::ids::TokenId;
use crate::kv::spec::{GroupKeeping, KvCacheConfig, KvSpec, LayerPlace};
use crate::memory::events::{KvEvent, Medium};
use crate::memory::prefix_cache::BlockHash;
use crate::scheduler::{
    RequestOptions, SamplingParams, Scheduler, SchedulerConfig, StepOutput, UpdateOutput,
};
use crate::store::dtype::KvDtype;
use crate::store::kv_cache::{KvCache, KvShape, LayerPart, PagePart};
use crate::tier::disk::{DiskTier, DiskTierConfig, Opened};
use crate::tier::TierCounters;
use gate::StepGate;

struct Serving {
    scheduler: Scheduler,
    /// The disk tier's counters when it was closed (its figures stay in the stats).
    closed_tier: Option<TierCounters>,
}

/// The paged runtime: see the module doc. Thread-safe.
pub struct KvRuntime {
    serving: Mutex<Serving>,
    /// The model's K/V spec and the layout derived from it (None: no K/V).
    kv: Option<(KvSpec, KvCacheConfig)>,
    store: Option<Mutex<KvCache>>,
    /// Where each model layer's K/V lies: its group, store layer and part of a page.
    places: Vec<LayerPlace>,
    gate: StepGate,
}

/// Locks `mutex`, refusing the state a panic left half-changed (module invariants).
fn lock<T>(mutex: &Mutex<T>) -> Result<MutexGuard<'_, T>> {
    mutex.lock().map_err(|_| {
        Error::Internal(
            "an earlier call on this object panicked midway; its state may be inconsistent, so \
             it refuses every call (make a new one)"
                .into(),
        )
    })
}

impl KvRuntime {
    /// A runtime scheduling by `config`, with K/V storage for `kv` (none: a runtime for a model
    /// that keeps no K/V of its own, e.g. a simulated one; its steps then refuse K/V calls).
    /// The layout derived from the spec gives each sequence a block table per KV cache group
    /// (a sliding group releasing the blocks behind its window: `Scheduler::keeping`); each
    /// layer's window is applied by [`KvRuntime::attention`]. Fails as `KvCacheConfig::derive`,
    /// `Scheduler::keeping` and `KvCache::new` do.
    pub fn new(config: SchedulerConfig, kv: Option<KvSpec>) -> Result<Self> {
        let kv = kv
            .map(|spec| KvCacheConfig::derive(&spec, config.block_size).map(|c| (spec, c)))
            .transpose()?;
        let (kept, store, places) = match &kv {
            None => (
                vec![GroupKeeping::full(config.block_size)],
                None,
                Vec::new(),
            ),
            Some((spec, layout)) => {
                // One page holds a block of every layer of a group (`KvCacheConfig`), so the store
                // has `page_layers` layers, each model layer at its place in its group's pages.
                let shape = KvShape {
                    num_layers: layout.page_layers,
                    num_blocks: config.num_blocks,
                    block_size: config.block_size,
                    num_kv_heads: spec.layers[0].num_kv_heads,
                    head_dim: spec.layers[0].head_dim,
                };
                let store = KvCache::new(shape, layout.dtype)?;
                (
                    layout.kept(),
                    Some(Mutex::new(store)),
                    layout.layer_places(),
                )
            }
        };
        Ok(KvRuntime {
            kv,
            serving: Mutex::new(Serving {
                scheduler: Scheduler::keeping(config, kept)?,
                closed_tier: None,
            }),
            store,
            places,
            gate: StepGate::default(),
        })
    }

    fn serving(&self) -> Result<MutexGuard<'_, Serving>> {
        lock(&self.serving)
    }

    /// Runs `query` on the scheduler, read-only.
    pub fn read<T>(&self, query: impl FnOnce(&Scheduler) -> T) -> Result<T> {
        Ok(query(&self.serving()?.scheduler))
    }

    /// The model's K/V spec and the KV cache layout derived from it, if the runtime keeps K/V.
    pub fn kv_spec(&self) -> Option<(&KvSpec, &KvCacheConfig)> {
        self.kv.as_ref().map(|(spec, config)| (spec, config))
    }

    /// The shape and dtype of the K/V store, if the runtime has one.
    pub fn kv_layout(&self) -> Result<Option<(KvShape, KvDtype)>> {
        self.store
            .as_ref()
            .map(|store| lock(store).map(|c| (c.shape(), c.dtype())))
            .transpose()
    }

    /// Queues a request (see `Scheduler::add_request`).
    pub fn add_request(
        &self,
        request_id: &str,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        options: RequestOptions,
    ) -> Result<()> {
        (self.serving()?.scheduler).add_request(request_id, prompt, params, options)
    }

    /// Drops a request in any state, freeing its blocks (see `Scheduler::abort`).
    pub fn abort(&self, request_id: &str) -> Result<()> {
        self.serving()?.scheduler.abort(request_id)
    }

    /// Ends one sample of a live request before its siblings (see `Scheduler::finish_sample`).
    pub fn finish_sample(&self, request_id: &str, seq_index: u32) -> Result<()> {
        self.serving()?
            .scheduler
            .finish_sample(request_id, seq_index)
    }

    /// Builds the next step: its arrays for the model, and the [`Step`] that is its only way
    /// into the K/V bytes until `finish_step`. The previous step must have been finished.
    pub fn begin_step(&self) -> Result<(StepOutput, Step)> {
        let mut serving = self.serving()?;
        serving.scheduler.schedule()?;
        let output = serving.scheduler.take_step_output();
        // Only a step that can reach K/V needs its own copy of the addressing arrays.
        let step = match self.store {
            Some(_) => Step::of(&output),
            None => Step::without_kv(&output),
        };
        self.gate.open(step.id);
        Ok((output, step))
    }

    /// Appends `sampled[k]` (one per sample) and finishes sequences (see `Scheduler::update`);
    /// closes the step's way into the K/V bytes, waiting for any call through it in progress.
    pub fn finish_step(&self, step: &Step, sampled: &[TokenId]) -> Result<UpdateOutput> {
        let mut serving = self.serving()?;
        let scheduler = &mut serving.scheduler;
        self.gate
            .close_after(|| scheduler.update(step.id, sampled).map(|_| ()))?;
        Ok(scheduler.take_update_output())
    }

    /// Runs `f` on the store for `step`, the step awaiting `finish_step` (module invariants).
    fn through<T>(&self, step: &Step, f: impl FnOnce(&mut KvCache) -> Result<T>) -> Result<T> {
        let store = self.store.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "this runtime keeps no K/V (it was made without a KV spec)".into(),
            )
        })?;
        let _open = self.gate.enter(step.id)?;
        f(&mut *lock(store)?)
    }

    /// Stores rows `keys[i]`, `values[i]` (each `[num_kv_heads, head_dim]`, f32) of `layer` at the
    /// step's slots in the layer's group (see `KvCache::write`).
    pub fn write(&self, step: &Step, layer: usize, keys: &[f32], values: &[f32]) -> Result<()> {
        self.through(step, |c| {
            let (place, part) = self.place(layer)?;
            let slots = step.group_slots(place.group);
            let layer = LayerPart {
                layer: place.page_layer,
                part,
            };
            c.write(layer, keys, values, slots)
        })
    }

    /// Applies the step's copy-on-write block copies (before its attention reads the store).
    pub fn copy_blocks(&self, step: &Step) -> Result<()> {
        self.through(step, |c| c.copy_blocks(&step.copy_ops))
    }

    /// Attention of `query` (`[num_tokens, num_heads, head_dim]`) over `layer` through the
    /// step's tables of the layer's group, on kernel `path`, into `out` (see
    /// `attention::paged_attention_with`), over the layer's sliding window if its spec has one:
    /// the caller never passes it, so the step and the spec cannot disagree.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        step: &Step,
        path: Isa,
        layer: usize,
        query: &[f32],
        num_heads: usize,
        scale: f32,
        out: &mut [f32],
    ) -> Result<()> {
        self.through(step, |c| {
            let (place, part) = self.place(layer)?;
            let window = self
                .kv
                .as_ref()
                .and_then(|(spec, _)| spec.layers[layer].attention.window());
            let batch = AttentionBatch {
                block_tables: step.group_tables(place.group),
                max_blocks_per_seq: step.block_table_width,
                context_lens: &step.context_lens,
                query_start_loc: &step.query_start_loc,
            };
            let layer = LayerPart {
                layer: place.page_layer,
                part,
            };
            attention::paged_attention_with(
                path, c, layer, query, num_heads, &batch, scale, window, out,
            )
        })
    }

    /// Where `layer`'s K/V lies, and its part of a page. `InvalidArgument`, as the store's, for
    /// a layer the spec does not have.
    fn place(&self, layer: usize) -> Result<(LayerPlace, PagePart)> {
        let place = self.places.get(layer).copied().ok_or_else(|| {
            Error::InvalidArgument(format!("layer {layer} outside 0..{}", self.places.len()))
        })?;
        let (_, layout) = self.kv.as_ref().expect("places come from a layout");
        let part = PagePart {
            index: place.part,
            of: layout.parts(place.group),
        };
        Ok((place, part))
    }

    /// Opens (or creates) the disk tier in `dir` for the runtime's K/V, at most `capacity_bytes`
    /// of K/V data, recording `identity` (a tier recorded under another is cleared), and attaches
    /// it: evicted cached blocks are offloaded to it, prefix hits on it loaded back. Fails,
    /// attaching nothing, with `InvalidArgument` for a runtime without K/V, a tier attached
    /// already, or one that has served a request, and as `DiskTier::open` does.
    pub fn open_disk_tier(
        &self,
        dir: &Path,
        capacity_bytes: u64,
        identity: Vec<u8>,
    ) -> Result<Opened> {
        let store = self.store.as_ref().ok_or_else(|| {
            Error::InvalidArgument("a disk tier needs a runtime that keeps K/V (a KV spec)".into())
        })?;
        let io = lock(store)?.block_io();
        let mut serving = self.serving()?;
        let scheduler = &mut serving.scheduler;
        ensure(!scheduler.block_manager().has_tier(), || {
            "a disk tier is attached already".into()
        })?;
        // A page's bytes mean what the layout says (which layer, which part): a tier recorded
        // under another layout is another identity.
        let mut identity = identity;
        if let Some((_, layout)) = &self.kv {
            identity.extend_from_slice(layout.fingerprint().as_bytes());
        }
        let config = DiskTierConfig {
            identity,
            capacity_bytes,
            policy: scheduler.config().eviction_policy,
        };
        // SAFETY: the scheduler's block manager drives the tier by the protocol of `crate::tier`,
        // and the runtime keeps the engine to it: it owns the store, and touches it only through
        // the step awaiting `finish_step`, at that step's slots and tables (module invariants),
        // which never hold a block being offloaded or loaded.
        let (tier, opened) = unsafe { DiskTier::open(dir, config, io, scheduler.tier_link())? };
        scheduler.attach_tier(Box::new(tier))?;
        serving.closed_tier = None;
        Ok(opened)
    }

    /// Finishes the disk tier's queued writes and loads, then closes it (its files released, so
    /// another runtime may open the directory); cached RAM blocks stay. Returns the tier's last KV
    /// events (with `emit_kv_events`: those not yet taken, then all disk blocks cleared), to
    /// publish after `take_kv_events`. Without a tier, nothing.
    pub fn close_disk_tier(&self) -> Result<Vec<KvEvent>> {
        let mut serving = self.serving()?;
        let mut last = Vec::new();
        let Some(mut tier) = serving.scheduler.detach_tier() else {
            return Ok(last);
        };
        if serving.scheduler.config().emit_kv_events {
            tier.drain_events(&mut last);
            last.push(KvEvent::AllBlocksCleared {
                medium: Medium::Disk,
            });
        }
        serving.closed_tier = Some(tier.counters());
        drop(tier); // joins its I/O thread and closes its files
        Ok(last)
    }

    /// Blocks until the disk tier has finished every queued write and load (the next step sees
    /// the loads). Without a tier, nothing.
    pub fn flush_disk_tier(&self) -> Result<()> {
        self.serving()?.scheduler.flush_tier();
        Ok(())
    }

    /// The disk tier's counters: the attached tier's now, else those it had when closed; None
    /// if no tier was ever attached.
    pub fn tier_counters(&self) -> Result<Option<TierCounters>> {
        let serving = self.serving()?;
        let blocks = serving.scheduler.block_manager();
        Ok(match blocks.has_tier() {
            true => Some(blocks.tier_counters()),
            false => serving.closed_tier,
        })
    }

    /// The KV events since the last call, in order (empty unless `emit_kv_events`).
    pub fn take_kv_events(&self) -> Result<Vec<KvEvent>> {
        Ok(self.serving()?.scheduler.take_kv_events())
    }

    /// The blocks findable now by prefix lookup, by medium.
    pub fn kv_blocks(&self) -> Result<Vec<(BlockHash, Medium, u32)>> {
        self.read(Scheduler::kv_blocks)
    }
}

#[cfg(test)]
mod tests;
