//! Continuous batching: which tokens of which requests run at each step, over a [`BlockManager`]
//! through a [`KvCoordinator`]: each sequence holds a block table per KV cache group (one for most
//! models; a hybrid model's sliding groups release the blocks behind their window before each
//! step's appends), and every capacity check counts all groups.
//!
//! A step (`schedule`) first keeps the running sequences going, in running order (one decode
//! token, or the next prompt chunk capped by `long_prefill_token_threshold`), then admits waiting
//! sequences from the head of the queue while the token budget, the sequence cap and free blocks
//! allow. A running sequence that cannot get a slot preempts the sequence at the back of the
//! running list (lowest priority, then most recently admitted), possibly itself: its blocks are
//! freed (full ones stay cached, so the recompute is mostly prefix hits) and it waits again under
//! its original key with its tokens kept. No admission happens in a step that preempted.
//! `update` then appends one sampled token per sample, finishes sequences and frees their blocks.
//! `finish_sample` ends one sample of a request early (a stop string its caller matched), freeing
//! its blocks, while the request's other samples run on; `abort` ends a whole request.
//!
//! With a tier attached ([`Scheduler::attach_tier`]), an admission whose prefix continues in the
//! tier admits only the hit blocks and the sequence is *loading*: it holds its blocks and a seat
//! (it counts against `max_num_seqs` and memory, not the token budget), is never scheduled nor
//! chosen as a preemption victim (its loads end in bounded time, and preempting it would waste
//! them), and joins the running list when `schedule`, which first drains the finished loads, finds
//! all its loads ended, its `num_computed` then the prefix up to the first dropped load. Aborting
//! it frees its table at once; the block manager releases blocks still being loaded when their
//! loads end.
//!
//! Invariants (checked by `check_invariants`):
//! - every live sequence is either waiting (queued, no block table), loading (in `loading`, with
//!   a block table holding `num_computed` tokens) or running (in `running`, with a block table
//!   holding `num_computed` tokens);
//! - `running` is sorted by `victim_rank`, so its back is always the next victim, and a victim is
//!   never a sequence already scheduled in the current step (those are in front of the cursor);
//! - running and loading sequences plus the forks their prompts still owe never exceed
//!   `max_num_seqs`;
//! - `schedule` and `update` alternate, `update` naming by its `StepId` the step it answers (a
//!   step of another scheduler or an old one is refused); an error from either, or from
//!   `add_request` / `abort` / `finish_sample`, leaves every structure as it was.
//! - the limits fit the step's arrays: `max_model_len` and `max_num_batched_tokens` an i32,
//!   `max_num_seqs` a u32 (checked by `SchedulerConfig::validate`).
//!
//! Progress: `max_model_len` tokens fit the cache, admission never skips the queue head, and every
//! load ends, so every request either finishes or was rejected by `add_request`.
//!
//! Cost per step is O(scheduled sequences + their block-table rows) plus O(log waiting) per
//! admission; a prompt's block hashes are computed once however often its admission is retried.

mod output;
mod queue;
mod request;
mod slab;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tier_tests;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use output::{
    Figure, Produced, RequestEvent, RequestEventKind, SchedulerStats, StepId, StepOutput,
    StepStats, UpdateOutput,
};
pub use queue::{Policy, DEFAULT_AGING_STEPS};
pub use request::{FinishReason, SamplingParams};

use crate::error::{ensure, Error, Result};
use crate::ids::{SeqId, TokenId};
use crate::kv::coordinator::{capacity_tokens, group_blocks, KvCoordinator};
use crate::kv::spec::{AttentionKind, GroupKeeping};
use crate::memory::block_manager::{
    BlockManager, PrefixMatch, TierPolicy, DEFAULT_MIN_LOAD_BLOCKS,
};
use crate::memory::block_table::BlockTable;
use crate::memory::events::{KvEvent, Medium};
use crate::memory::eviction::EvictionPolicy;
use crate::memory::prefix_cache::{root_hash, BlockHash};
use crate::tier::{KvTier, TierLink};
use queue::{QueueKey, WaitingQueue};
use request::{Request, SeqStatus, Sequence};
use slab::{Handle, Slab};

/// Default admission headroom (`SchedulerConfig::admission_lookahead_tokens`): room for every
/// running sequence to finish its prompt and grow 32 more tokens. Measured on the Azure conversation
/// trace under overload (docs/serving): 0 tokens (prompts only) still preempts 298 times, 16
/// tokens 26, 32 tokens 4, 64 tokens none; throughput is flat from 16 to 64 and falls beyond.
pub const DEFAULT_ADMISSION_LOOKAHEAD_TOKENS: usize = 32;

/// Tokens per step by default (`SchedulerConfig::max_num_batched_tokens`): a step's prefill chunk
/// is computed before any running sequence gets its next token, and on a CPU a 2048-token chunk
/// of SmolLM2-135M already takes about two seconds (`bench model`: ~1000 prompt tokens/s on 2
/// cores), so a larger default would stall every stream that long.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 2048;

/// Sequences running at once by default (`SchedulerConfig::max_num_seqs`): decode throughput on
/// a CPU still grows at 32 sequences (`bench model`) and 64 leave room above it; each running
/// sequence holds its KV blocks, which the admission lookahead keeps from thrashing.
pub const DEFAULT_MAX_NUM_SEQS: usize = 64;

/// The eviction policy by default (`SchedulerConfig::eviction_policy`): segmented LRU. Replaying
/// 1000 requests of the Azure traces with 8 shared system prompts on the simulated model, it hit
/// more of the prefix cache than LRU in every case measured (conv 0.244 vs 0.230 and code 0.106
/// vs 0.087 at 1024 blocks; equal within 0.4 points at 4096).
pub const DEFAULT_EVICTION_POLICY: EvictionPolicy = EvictionPolicy::Slru;

/// Longest `max_model_len` and `max_num_batched_tokens`: a step's `context_lens` and
/// `query_start_loc` are int32 arrays.
pub const MAX_TOKENS_PER_ARRAY: usize = i32::MAX as usize;

/// Most sequences in the batch: sample indices and owed forks are u32.
pub const MAX_NUM_SEQS: usize = u32::MAX as usize;

/// Numbers each scheduler, so a step id names the scheduler that built it.
static NEXT_SCHEDULER: AtomicU64 = AtomicU64::new(0);

/// Limits and policy of a scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Most sequences in the running batch.
    pub max_num_seqs: usize,
    /// Most tokens (prefill + decode) in one step.
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output); must fit in the cache.
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    /// Which cached block goes when memory is needed (see `crate::memory::eviction::Evictable`).
    pub eviction_policy: EvictionPolicy,
    pub policy: Policy,
    /// Most prompt tokens one sequence computes in a step (0: only the budget limits it).
    pub long_prefill_token_threshold: usize,
    /// End-of-sequence tokens: any of them finishes a sequence unless its request sets
    /// `ignore_eos` (checkpoints may name several, e.g. Llama 3's `<|end_of_text|>` and
    /// `<|eot_id|>`). A handful at most, so a linear scan beats hashing.
    pub eos_token_ids: Vec<TokenId>,
    /// Admission headroom, in tokens of growth per running sequence (`None`: none, admit whenever
    /// the first chunk fits now). A waiting sequence is admitted only if, once its first chunk
    /// is allocated, the available blocks still cover every running sequence (itself included)
    /// computing the rest of its prompt and then this many more tokens, plus, per fork a prompt
    /// still owes, a copy-on-write block and as many tokens. Without it, admission fills memory
    /// that running sequences need a step later, and the victim of that shortage is the sequence
    /// just admitted (its prefill wasted). An empty batch admits the head whenever its first chunk
    /// fits, so admission never deadlocks.
    pub admission_lookahead_tokens: Option<usize>,
    /// Record KV events (`Scheduler::take_kv_events`); off, they cost nothing.
    pub emit_kv_events: bool,
    /// Fewest consecutive tier-hit blocks worth loading; a shorter run is recomputed (at least 1).
    /// Default `DEFAULT_MIN_LOAD_BLOCKS` (1, load any hit: the measured crossover is below one
    /// block, see there).
    pub min_load_blocks: usize,
    /// With a tier: clean blocks kept ahead of need by offloading cached ones (see
    /// `TierPolicy::offload_watermark`; at most `num_blocks`). Default
    /// `default_offload_watermark`.
    pub offload_watermark_blocks: usize,
}

/// The default offload watermark: the blocks one full step can allocate (its token budget in
/// blocks, one per sequence more at most for the decode tails), capped at a sixteenth of the pool.
/// A step allocating no more than this finds every block clean, so it never drops a cached block
/// for want of the tier's copy-out (which runs during the step); the cap bounds what leaves the RAM
/// prefix cache early (to the tier, where it is still a hit) on small pools.
pub fn default_offload_watermark(
    num_blocks: usize,
    block_size: usize,
    max_num_batched_tokens: usize,
) -> usize {
    max_num_batched_tokens
        .div_ceil(block_size.max(1))
        .min(num_blocks / 16)
        .max(1)
        .min(num_blocks)
}

impl SchedulerConfig {
    /// Defaults for a cache of `num_blocks` blocks of `block_size` tokens: the one place every
    /// default of a scheduler (and so of an engine, its Python face and its command line, which
    /// read them from here through `_core.SCHEDULER_DEFAULTS`) is set: [`DEFAULT_MAX_NUM_SEQS`]
    /// sequences, [`DEFAULT_MAX_NUM_BATCHED_TOKENS`] tokens per step, `max_model_len` the whole
    /// cache (at most `MAX_TOKENS_PER_ARRAY`), prefix caching on with
    /// [`DEFAULT_EVICTION_POLICY`], FCFS.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        SchedulerConfig {
            num_blocks,
            block_size,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            max_num_batched_tokens: DEFAULT_MAX_NUM_BATCHED_TOKENS,
            max_model_len: num_blocks
                .saturating_mul(block_size)
                .min(MAX_TOKENS_PER_ARRAY),
            enable_prefix_caching: true,
            eviction_policy: DEFAULT_EVICTION_POLICY,
            policy: Policy::Fcfs,
            long_prefill_token_threshold: 0,
            eos_token_ids: Vec::new(),
            admission_lookahead_tokens: Some(DEFAULT_ADMISSION_LOOKAHEAD_TOKENS),
            emit_kv_events: false,
            min_load_blocks: DEFAULT_MIN_LOAD_BLOCKS,
            offload_watermark_blocks: default_offload_watermark(
                num_blocks,
                block_size,
                DEFAULT_MAX_NUM_BATCHED_TOKENS,
            ),
        }
    }

    fn validate(&self) -> Result<()> {
        ensure((1..=MAX_NUM_SEQS).contains(&self.max_num_seqs), || {
            format!(
                "max_num_seqs must be in 1..={MAX_NUM_SEQS}, got {}",
                self.max_num_seqs
            )
        })?;
        ensure(
            (1..=MAX_TOKENS_PER_ARRAY).contains(&self.max_num_batched_tokens),
            || {
                format!(
                    "max_num_batched_tokens must be in 1..={MAX_TOKENS_PER_ARRAY}, got {}",
                    self.max_num_batched_tokens
                )
            },
        )?;
        ensure(
            (2..=MAX_TOKENS_PER_ARRAY).contains(&self.max_model_len),
            || {
                format!(
                "max_model_len must be in 2..={MAX_TOKENS_PER_ARRAY} (a prompt token and an output), got {}",
                self.max_model_len
            )
            },
        )?;
        let capacity = self.num_blocks.saturating_mul(self.block_size);
        ensure(self.max_model_len <= capacity, || {
            format!(
                "max_model_len {} exceeds the cache ({} blocks x {} tokens = {capacity}): such a sequence could never finish",
                self.max_model_len, self.num_blocks, self.block_size
            )
        })?;
        if let Policy::Priority { aging_steps } = self.policy {
            ensure(aging_steps > 0, || "aging_steps must be positive".into())?;
        }
        Ok(())
    }
}

/// Blocks a sequence holding blocks for `num_computed` of its `num_tokens` tokens may still need
/// under an admission headroom of `lookahead` tokens (see `SchedulerConfig`): the rest of its
/// tokens, then `lookahead` more but no more than it can still grow (`max_growth`), and per owed
/// fork a copy of the shared partial block plus as much growth.
fn headroom_blocks(
    block_size: usize,
    num_tokens: usize,
    num_computed: usize,
    pending_forks: u32,
    lookahead: usize,
    max_growth: usize,
) -> usize {
    let growth = lookahead.min(max_growth);
    (num_tokens + growth).div_ceil(block_size) - num_computed.div_ceil(block_size)
        + pending_forks as usize * (1 + growth.div_ceil(block_size))
}

/// Appends `row`'s slots in `table` to the step's slot mapping and writes `table` into its block
/// tables at `at`.
fn fill_row(out: &mut StepOutput, table: &BlockTable, row: &Row, at: usize) {
    table.extend_slots(row.start, row.start + row.len, &mut out.slot_mapping);
    let cells = &mut out.block_tables[at..][..table.blocks().len()];
    for (cell, entry) in cells.iter_mut().zip(table.entries()) {
        *cell = entry;
    }
}

/// Prompt tokens one sequence may compute in a step with `budget` tokens left.
fn chunk_limit(config: &SchedulerConfig, budget: usize) -> usize {
    match config.long_prefill_token_threshold {
        0 => budget,
        cap => cap.min(budget),
    }
}

/// Per-request options besides the prompt and the sampling limits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestOptions {
    /// Lower is served first under the priority policy (ignored by FCFS).
    pub priority: i64,
    /// Breaks ties between equal effective priorities (earlier first).
    pub arrival_time: f64,
    /// Requests with different salts never share cached blocks.
    pub cache_salt: Option<Vec<u8>>,
}

/// One scheduled sequence of the step being built.
#[derive(Debug, Clone, Copy)]
struct Row {
    seq: Handle,
    start: usize,
    len: usize,
}

/// Running totals.
#[derive(Debug, Default, Clone, Copy)]
struct Totals {
    scheduled_tokens: u64,
    prefill_tokens: u64,
    generated_tokens: u64,
    preemptions: u64,
    finished_requests: u64,
    aborted_requests: u64,
    peak_running: usize,
    /// Prompt tokens admitted to be loaded from the tier (in some group) rather than served
    /// from RAM in all of them.
    tier_hit_tokens: u64,
}

/// The continuous-batching scheduler.
pub struct Scheduler {
    /// Process-unique, from `NEXT_SCHEDULER` (see `StepId`).
    id: u64,
    config: SchedulerConfig,
    /// Each sequence's block tables, one per KV cache group (`Scheduler::keeping`).
    blocks: KvCoordinator,
    requests: Slab<Request>,
    request_ids: HashMap<Arc<str>, Handle>,
    seqs: Slab<Sequence>,
    waiting: WaitingQueue,
    /// Running sequences sorted by `victim_rank` (back = next victim).
    running: Vec<Handle>,
    /// Sequences waiting for their loads from the tier (holding blocks, not scheduled).
    loading: Vec<Handle>,
    /// Forks still owed by running or loading sequences whose prompt is not fully computed.
    owed_forks: usize,
    next_block_seq: SeqId,
    next_request_order: u64,
    next_admission: u64,
    /// Steps scheduled so far.
    step: u64,
    awaiting_update: bool,
    rows: Vec<Row>,
    /// The sequence of each sample of the step awaiting `update`.
    samples: Vec<Handle>,
    output: StepOutput,
    update_output: UpdateOutput,
    totals: Totals,
}

impl Scheduler {
    /// A scheduler keeping every token's K/V in one group (`keeping(config, vec![full])`).
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        let full = GroupKeeping::full(config.block_size);
        Self::keeping(config, vec![full])
    }

    /// A scheduler giving each sequence a block table in each KV cache group `kept[g]`, over one
    /// pool (`KvCoordinator`): a `Full` group keeps every token, a `Sliding` one the last
    /// `window` tokens (before a running sequence computes its next tokens, its blocks wholly
    /// before its first new token's window go back to the pool, to the prefix cache when hashed),
    /// each in blocks of its own size (dividing `config.block_size`, the pages').
    /// What a layout derived from the model's spec keeps (`KvCacheConfig`). Fails with
    /// `InvalidArgument` for no group, a zero window, a block size not dividing the pages', or a
    /// `max_model_len` whose blocks in all groups exceed the pool (`capacity_tokens`), and as
    /// `SchedulerConfig` is checked.
    pub fn keeping(config: SchedulerConfig, kept: Vec<GroupKeeping>) -> Result<Self> {
        config.validate()?;
        let chunk = chunk_limit(&config, config.max_num_batched_tokens);
        let capacity = capacity_tokens(&kept, config.num_blocks, chunk);
        ensure(config.max_model_len <= capacity, || {
            format!(
                "max_model_len {} exceeds what {} blocks of {} tokens hold in the {} KV cache \
                 groups ({capacity} tokens): such a sequence could never finish",
                config.max_model_len,
                config.num_blocks,
                config.block_size,
                kept.len()
            )
        })?;
        let mut blocks = BlockManager::with_eviction_policy(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.eviction_policy,
        )?;
        blocks.set_tier_policy(TierPolicy {
            min_load_blocks: config.min_load_blocks,
            offload_watermark: config.offload_watermark_blocks,
        })?;
        if config.emit_kv_events {
            blocks.record_kv_events()?;
        }
        let blocks = KvCoordinator::new(blocks, kept)?;
        Ok(Scheduler {
            id: NEXT_SCHEDULER.fetch_add(1, Ordering::Relaxed),
            config,
            blocks,
            requests: Slab::default(),
            request_ids: HashMap::new(),
            seqs: Slab::default(),
            waiting: WaitingQueue::default(),
            running: Vec::new(),
            loading: Vec::new(),
            owed_forks: 0,
            next_block_seq: 0,
            next_request_order: 0,
            next_admission: 0,
            step: 0,
            awaiting_update: false,
            rows: Vec::new(),
            samples: Vec::new(),
            output: StepOutput::default(),
            update_output: UpdateOutput::default(),
            totals: Totals::default(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The block manager scheduled over (read-only).
    pub fn block_manager(&self) -> &BlockManager {
        self.blocks.manager()
    }

    /// Each sequence's block tables, one per KV cache group (read-only).
    pub fn kv_coordinator(&self) -> &KvCoordinator {
        &self.blocks
    }

    /// What a tier needs of the block pool: build the tier from it, then `attach_tier`.
    pub fn tier_link(&self) -> TierLink {
        self.blocks.manager().tier_link()
    }

    /// Offloads evicted blocks to `tier` and loads prefix hits from it from now on. Fails,
    /// changing nothing, with `InvalidArgument` if a tier is attached already or a sequence or
    /// cached block exists (attach before the first step).
    pub fn attach_tier(&mut self, tier: Box<dyn KvTier>) -> Result<()> {
        self.blocks.attach_tier(tier)
    }

    /// Blocks until the tier has finished every queued job; the next `schedule` sees its loads.
    pub fn flush_tier(&mut self) {
        self.blocks.manager_mut().flush_tier();
    }

    /// Stops using the tier and returns it (drop it to close its files): finishes its queued
    /// jobs, moves the sequences whose loads ended to the running list, then detaches it. None
    /// without a tier. Cached RAM blocks stay; evictions drop them from now on.
    pub fn detach_tier(&mut self) -> Option<Box<dyn KvTier>> {
        self.blocks.manager_mut().flush_tier();
        self.complete_loads();
        self.blocks.manager_mut().detach_tier()
    }

    /// The KV events since the last call (RAM ones, then the tier's), empty unless
    /// `SchedulerConfig::emit_kv_events`.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.blocks.manager_mut().take_kv_events()
    }

    /// The blocks findable now, by medium and KV cache group: replaying every event from the
    /// start gives this set.
    pub fn kv_blocks(&self) -> Vec<(BlockHash, Medium, u32)> {
        self.blocks.manager().kv_blocks()
    }

    /// Queues a request. Rejects (changing nothing) a duplicate id, an empty prompt, a prompt
    /// leaving no room to generate within `max_model_len`, and invalid limits.
    pub fn add_request(
        &mut self,
        request_id: &str,
        prompt: Vec<TokenId>,
        params: SamplingParams,
        options: RequestOptions,
    ) -> Result<()> {
        if self.request_ids.contains_key(request_id) {
            return Err(Error::DuplicateSequence(format!("request {request_id:?}")));
        }
        ensure(!prompt.is_empty(), || {
            format!("request {request_id:?}: empty prompt")
        })?;
        params.validate()?;
        ensure(params.n <= self.config.max_num_seqs, || {
            format!(
                "n = {} exceeds max_num_seqs = {}",
                params.n, self.config.max_num_seqs
            )
        })?;
        ensure(prompt.len() < self.config.max_model_len, || {
            format!(
                "request {request_id:?}: prompt of {} tokens leaves no room to generate within max_model_len = {}",
                prompt.len(),
                self.config.max_model_len
            )
        })?;
        ensure(!options.arrival_time.is_nan(), || {
            "arrival_time is NaN".into()
        })?;

        let id: Arc<str> = Arc::from(request_id);
        let queue_key = QueueKey::new(
            self.config.policy,
            options.priority,
            options.arrival_time,
            self.step,
            self.next_request_order,
        );
        self.next_request_order += 1;
        let request = self.requests.insert(Request {
            id: id.clone(),
            priority: options.priority,
            hash_root: root_hash(options.cache_salt.as_deref()),
            seqs: Vec::with_capacity(params.n),
            params,
        });
        let pending_forks = (self.requests[request].params.n - 1) as u32;
        let block_seq = self.take_block_seq();
        let seq = self.seqs.insert(Sequence {
            request,
            index: 0,
            block_seq,
            tokens: prompt,
            num_computed: 0,
            num_output: 0,
            prefix_hashes: Vec::new(),
            status: SeqStatus::Waiting,
            queue_key,
            pending_forks,
            preempted: false,
            victim_rank: (0, 0, 0),
        });
        self.requests[request].seqs.push(seq);
        self.waiting.push(queue_key, seq);
        self.request_ids.insert(id, request);
        Ok(())
    }

    /// Drops a request in any state, returning every block it holds. Samples of it in the step
    /// awaiting `update` are ignored by that `update`.
    pub fn abort(&mut self, request_id: &str) -> Result<()> {
        let request = self
            .request_ids
            .remove(request_id)
            .ok_or_else(|| Error::UnknownSequence(format!("request {request_id:?}")))?;
        let request = self
            .requests
            .remove(request)
            .expect("id map points at live requests");
        for handle in request.seqs {
            self.drop_sequence(handle);
        }
        self.totals.aborted_requests += 1;
        Ok(())
    }

    /// Ends sample `seq_index` of a live request before its siblings (the engine met its stop
    /// string), freeing its blocks; a step awaiting update skips it, and the request goes on with
    /// the others. Fails, changing nothing: `UnknownSequence` for no such live sample,
    /// `InvalidArgument` for the request's only live sample (abort the request instead).
    pub fn finish_sample(&mut self, request_id: &str, seq_index: u32) -> Result<()> {
        let (request, at) = self.find_sample(request_id, seq_index)?;
        let seqs = &mut self.requests[request].seqs;
        ensure(seqs.len() > 1, || {
            format!("sample {seq_index} is the last of request {request_id:?}: abort it instead")
        })?;
        let handle = seqs.remove(at);
        self.drop_sequence(handle);
        Ok(())
    }

    /// Removes a waiting or running sequence (not from its request's list), returning its blocks.
    fn drop_sequence(&mut self, handle: Handle) {
        let seq = self
            .seqs
            .remove(handle)
            .expect("requests list live sequences");
        match seq.status {
            SeqStatus::Waiting => {
                let queued = self.waiting.remove(seq.queue_key, handle);
                debug_assert!(queued);
            }
            SeqStatus::Running | SeqStatus::Loading => {
                self.blocks
                    .free(seq.block_seq)
                    .expect("running and loading sequences have tables");
                let list = if seq.status == SeqStatus::Running {
                    &mut self.running
                } else {
                    &mut self.loading
                };
                let at = list
                    .iter()
                    .position(|&h| h == handle)
                    .expect("sequence listed");
                list.remove(at);
                self.owed_forks -= seq.pending_forks as usize;
            }
        }
    }

    /// Builds the next step. Fails if the previous step has not been passed to `update`.
    pub fn schedule(&mut self) -> Result<&StepOutput> {
        ensure(!self.awaiting_update, || {
            format!(
                "step {} awaits update() before the next schedule()",
                self.step - 1
            )
        })?;
        self.output.clear();
        self.rows.clear();
        self.samples.clear();
        self.complete_loads();
        let mut budget = self.config.max_num_batched_tokens;
        let preempted = self.schedule_running(&mut budget);
        if preempted == 0 {
            self.admit_waiting(&mut budget);
        }
        self.fill_output();

        let stats = &mut self.output.stats;
        stats.num_preempted = preempted;
        stats.num_scheduled_tokens = self.output.input_ids.len();
        stats.num_running = self.running.len();
        stats.num_waiting = self.waiting.len();
        stats.kv_usage = self.blocks.manager().stats().usage;
        self.totals.preemptions += preempted as u64;
        self.totals.scheduled_tokens += stats.num_scheduled_tokens as u64;
        self.totals.prefill_tokens += stats.num_prefill_tokens as u64;
        self.totals.peak_running = self.totals.peak_running.max(self.running.len());
        self.output.id = StepId {
            scheduler: self.id,
            step: self.step,
        };
        self.step += 1;
        self.awaiting_update = true;
        Ok(&self.output)
    }

    /// Appends `sampled[k]` to the sequence of sample k of step `step` (`logits_indices[k]`),
    /// finishing sequences on a stop token, `max_tokens` or `max_model_len` and freeing their
    /// blocks. Fails, changing nothing, unless `step` is the step awaiting update (of this
    /// scheduler) and exactly one token per sample is given.
    pub fn update(&mut self, step: StepId, sampled: &[TokenId]) -> Result<&UpdateOutput> {
        let pending = self.pending_step();
        if pending != Some(step) {
            let number = step.step;
            return Err(Error::InvalidArgument(match pending {
                _ if step.scheduler != self.id => {
                    format!("the output of step {number} comes from another scheduler")
                }
                None => format!("update() of step {number} without a step awaiting it"),
                Some(p) => format!(
                    "the output of step {number} is not the step awaiting update ({})",
                    p.step
                ),
            }));
        }
        if sampled.len() != self.samples.len() {
            return Err(Error::Shape(format!(
                "step {} has {} samples, got {} sampled tokens",
                self.step - 1,
                self.samples.len(),
                sampled.len()
            )));
        }
        self.awaiting_update = false;
        self.update_output.produced.clear();
        self.update_output.finished_requests.clear();
        let mut any_finished = false;
        for (k, &token) in sampled.iter().enumerate() {
            let handle = self.samples[k];
            let Some(seq) = self.seqs.get_mut(handle) else {
                continue; // aborted since the step was scheduled
            };
            let request = &self.requests[seq.request];
            seq.tokens.push(token);
            seq.num_output += 1;
            let params = &request.params;
            let finish = if params.stop_token_ids.contains(&token)
                || (!params.ignore_eos && self.config.eos_token_ids.contains(&token))
            {
                Some(FinishReason::Stop)
            } else if seq.num_output >= params.max_tokens {
                Some(FinishReason::Length)
            } else if seq.tokens.len() >= self.config.max_model_len {
                Some(FinishReason::MaxModelLen)
            } else {
                None
            };
            self.update_output.produced.push(Produced {
                request_id: request.id.clone(),
                seq_index: seq.index,
                token,
                finish,
            });
            if finish.is_some() {
                any_finished = true;
                self.finish_sequence(handle);
            }
        }
        self.totals.generated_tokens += self.update_output.produced.len() as u64;
        if any_finished {
            let seqs = &self.seqs;
            self.running.retain(|&h| seqs.get(h).is_some());
        }
        Ok(&self.update_output)
    }

    /// The step awaiting `update`, if any.
    pub fn pending_step(&self) -> Option<StepId> {
        self.awaiting_update.then(|| StepId {
            scheduler: self.id,
            step: self.step - 1,
        })
    }

    /// Moves the last step's arrays out (for a caller that keeps them past the next step); the
    /// next step then allocates fresh buffers.
    pub fn take_step_output(&mut self) -> StepOutput {
        std::mem::take(&mut self.output)
    }

    /// Moves the last update's outputs out, like `take_step_output`.
    pub fn take_update_output(&mut self) -> UpdateOutput {
        std::mem::take(&mut self.update_output)
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Running sequences.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences waiting for their loads from the tier.
    pub fn num_loading(&self) -> usize {
        self.loading.len()
    }

    /// Waiting sequences (new or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Requests not finished nor aborted.
    pub fn num_unfinished_requests(&self) -> usize {
        self.requests.len()
    }

    /// Whether `request_id` is waiting or running.
    pub fn contains(&self, request_id: &str) -> bool {
        self.request_ids.contains_key(request_id)
    }

    /// Tokens of sample `seq_index` of a live request: its prompt followed by its output so far.
    pub fn sequence_tokens(&self, request_id: &str, seq_index: u32) -> Result<&[TokenId]> {
        let (request, at) = self.find_sample(request_id, seq_index)?;
        Ok(&self.seqs[self.requests[request].seqs[at]].tokens)
    }

    /// The request holding live sample `seq_index` of `request_id`, and where in its `seqs`.
    fn find_sample(&self, request_id: &str, seq_index: u32) -> Result<(Handle, usize)> {
        let unknown =
            || Error::UnknownSequence(format!("request {request_id:?} sample {seq_index}"));
        let request = *self.request_ids.get(request_id).ok_or_else(unknown)?;
        let at = self.requests[request]
            .seqs
            .iter()
            .position(|&h| self.seqs[h].index == seq_index)
            .ok_or_else(unknown)?;
        Ok((request, at))
    }

    /// Totals and current occupancy.
    pub fn stats(&self) -> SchedulerStats {
        let blocks = self.blocks.manager().stats();
        let t = &self.totals;
        SchedulerStats {
            steps: self.step,
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_unfinished_requests: self.requests.len(),
            scheduled_tokens: t.scheduled_tokens,
            prefill_tokens: t.prefill_tokens,
            generated_tokens: t.generated_tokens,
            preemptions: t.preemptions,
            finished_requests: t.finished_requests,
            aborted_requests: t.aborted_requests,
            peak_running: t.peak_running,
            prefix_queried_tokens: blocks.prefix_queried_tokens,
            prefix_hit_tokens: blocks.prefix_hit_tokens,
            prefix_hit_rate: if blocks.prefix_queried_tokens == 0 {
                0.0
            } else {
                blocks.prefix_hit_tokens as f64 / blocks.prefix_queried_tokens as f64
            },
            kv_usage: blocks.usage,
            cow_copies: blocks.cow_copies,
            window_released_blocks: blocks.window_released_blocks,
            num_loading: self.loading.len(),
            tier_hit_blocks: blocks.loads_issued,
            tier_hit_tokens: t.tier_hit_tokens,
            loads_issued: blocks.loads_issued,
            loads_dropped: blocks.loads_dropped,
            offloads_issued: blocks.offloads_issued,
            evictions_without_offload: blocks.evictions_without_offload,
            tier: self.blocks.manager().tier_counters(),
        }
    }

    /// Verifies the invariants of the module doc and of the block manager.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.blocks.check_invariants()?;
        if self.blocks.num_sequences() != self.running.len() + self.loading.len() {
            return Err(format!(
                "{} block tables for {} running and {} loading sequences",
                self.blocks.num_sequences(),
                self.running.len(),
                self.loading.len()
            ));
        }
        if self.waiting.len() + self.running.len() + self.loading.len() != self.seqs.len() {
            return Err("a live sequence is neither waiting, loading nor running".into());
        }
        if !self
            .running
            .windows(2)
            .all(|w| self.seqs[w[0]].victim_rank < self.seqs[w[1]].victim_rank)
        {
            return Err("running list out of victim order".into());
        }
        let mut owed = 0;
        for &handle in &self.running {
            let seq = self
                .seqs
                .get(handle)
                .ok_or("stale handle in the running list")?;
            if seq.status != SeqStatus::Running
                || self.blocks.table(seq.block_seq, 0).map(|t| t.num_tokens())
                    != Ok(seq.num_computed)
            {
                return Err(format!(
                    "running sequence {} has a table that does not match it",
                    seq.block_seq
                ));
            }
            owed += seq.pending_forks as usize;
        }
        for &handle in &self.loading {
            let seq = self
                .seqs
                .get(handle)
                .ok_or("stale handle in the loading list")?;
            // Its admitted tokens, in the groups still loading (a group whose loads ended with
            // a drop holds fewer until all end: `KvCoordinator::poll_tier`).
            let held = (0..self.blocks.num_groups())
                .map(|g| self.blocks.table(seq.block_seq, g).map(|t| t.num_tokens()))
                .collect::<Result<Vec<_>>>()
                .map(|held| held.into_iter().max());
            if seq.status != SeqStatus::Loading
                || !self.blocks.is_loading(seq.block_seq)
                || held != Ok(Some(seq.num_computed))
            {
                return Err(format!(
                    "loading sequence {} has a table or loads that do not match it",
                    seq.block_seq
                ));
            }
            owed += seq.pending_forks as usize;
        }
        for handle in self.waiting.iter() {
            let seq = self
                .seqs
                .get(handle)
                .ok_or("stale handle in the waiting queue")?;
            if seq.status != SeqStatus::Waiting
                || seq.num_computed != 0
                || self.blocks.contains(seq.block_seq)
            {
                return Err(format!("waiting sequence {} holds blocks", seq.block_seq));
            }
        }
        let seated = self.running.len() + self.loading.len();
        if owed != self.owed_forks || seated + owed > self.config.max_num_seqs {
            return Err(format!(
                "{seated} running or loading + {owed} owed forks (counter {}) vs cap",
                self.owed_forks
            ));
        }
        for (handle, request) in self.requests.iter() {
            if self.request_ids.get(&request.id) != Some(&handle)
                || request.seqs.iter().any(|&s| self.seqs.get(s).is_none())
            {
                return Err(format!("request {:?} is inconsistent", request.id));
            }
        }
        Ok(())
    }

    fn take_block_seq(&mut self) -> SeqId {
        self.next_block_seq += 1;
        self.next_block_seq
    }

    /// Prompt tokens one sequence may compute in this step.
    fn chunk_cap(&self, budget: usize) -> usize {
        chunk_limit(&self.config, budget)
    }

    /// Blocks `seq`'s tables may still need in all groups under an admission headroom of
    /// `lookahead` tokens, its tables holding `num_computed` tokens (`headroom_blocks` per group;
    /// a sliding group never needs more than its peak, `group_blocks`).
    fn headroom(&self, seq: &Sequence, num_computed: usize, lookahead: usize) -> usize {
        let max_growth = self.max_growth(seq);
        let full = |bs| {
            headroom_blocks(
                bs,
                seq.tokens.len(),
                num_computed,
                seq.pending_forks,
                lookahead,
                max_growth,
            )
        };
        let groups = self.blocks.groups();
        if let [only] = groups {
            if only.attention == AttentionKind::Full {
                // Every model but a hybrid one: once per running sequence and step.
                return full(only.block_size);
            }
        }
        let chunk = self.chunk_cap(self.config.max_num_batched_tokens);
        let end = seq.tokens.len() + lookahead.min(max_growth);
        groups
            .iter()
            .map(|&kept| match kept.attention {
                AttentionKind::Full => full(kept.block_size),
                AttentionKind::Sliding { .. } => full(kept.block_size)
                    .min(group_blocks(kept, end, chunk) * (1 + seq.pending_forks as usize)),
            })
            .sum()
    }

    /// Gives every running sequence, in order, its next tokens while the budget lasts, preempting
    /// from the back of the list when blocks run out. Returns the number preempted.
    fn schedule_running(&mut self, budget: &mut usize) -> usize {
        let mut preempted = 0;
        let mut cursor = 0;
        while cursor < self.running.len() && *budget > 0 {
            let handle = self.running[cursor];
            let start = self.seqs[handle].num_computed;
            // The previous step has run (`update` came first): no query reads these again.
            self.blocks
                .release_behind(self.seqs[handle].block_seq, start)
                .expect("a running sequence has tables and is not loading");
            let len = self.seqs[handle]
                .num_uncomputed()
                .min(self.chunk_cap(*budget));
            let mut copies = Vec::new(); // allocates only for a copy-on-write
            let scheduled = loop {
                let seq = &self.seqs[handle];
                match self.blocks.append(
                    seq.block_seq,
                    &seq.tokens[start..start + len],
                    &mut copies,
                ) {
                    Ok(()) => break true,
                    Err(Error::OutOfBlocks { .. }) => {
                        let victim = self.running.pop().expect("the cursor is in the list");
                        self.preempt(victim);
                        preempted += 1;
                        if victim == handle {
                            break false;
                        }
                    }
                    Err(other) => unreachable!("append to a running sequence: {other}"),
                }
            };
            if !scheduled {
                break;
            }
            for op in copies {
                self.output
                    .copy_ops
                    .extend([i64::from(op.src), i64::from(op.dst)]);
            }
            let seq = &mut self.seqs[handle];
            seq.num_computed += len;
            if len > 1 || seq.num_output == 0 {
                self.output.stats.num_prefill_tokens += len;
            }
            *budget -= len;
            self.rows.push(Row {
                seq: handle,
                start,
                len,
            });
            cursor += 1;
        }
        preempted
    }

    /// Moves the loading sequences whose loads all ended to the running list.
    fn complete_loads(&mut self) {
        for ended in self.blocks.poll_tier() {
            let seqs = &self.seqs;
            let at = self
                .loading
                .iter()
                .position(|&h| seqs[h].block_seq == ended.seq)
                .expect("poll_tier reports live loading sequences");
            let handle = self.loading.swap_remove(at);
            let seq = &mut self.seqs[handle];
            seq.num_computed = ended.num_tokens;
            seq.status = SeqStatus::Running;
            self.insert_running(handle);
        }
    }

    /// Returns a running sequence to the waiting queue, freeing its blocks (full ones stay cached).
    fn preempt(&mut self, handle: Handle) {
        let seq = &mut self.seqs[handle];
        self.blocks
            .free(seq.block_seq)
            .expect("running sequences have tables");
        seq.num_computed = 0;
        seq.status = SeqStatus::Waiting;
        seq.preempted = true;
        self.owed_forks -= seq.pending_forks as usize;
        self.waiting.push(seq.queue_key, handle);
        self.output.events.push(RequestEvent {
            request_id: self.requests[seq.request].id.clone(),
            seq_index: seq.index,
            kind: RequestEventKind::Preempted,
            prefix_hit_tokens: 0,
        });
    }

    /// Tokens a sequence may still append: up to `max_model_len` and its `max_tokens`.
    fn max_growth(&self, seq: &Sequence) -> usize {
        let max_tokens = self.requests[seq.request].params.max_tokens;
        (self.config.max_model_len.saturating_sub(seq.tokens.len()))
            .min(max_tokens.saturating_sub(seq.num_output))
    }

    /// Admits waiting sequences from the head while budget, seats and blocks allow.
    fn admit_waiting(&mut self, budget: &mut usize) {
        let lookahead = self.config.admission_lookahead_tokens;
        // Blocks the running sequences may still need (admission keeps them available).
        let mut reserved = 0;
        if let (Some(lookahead), true) = (lookahead, self.waiting.len() > 0) {
            for &h in self.running.iter().chain(&self.loading) {
                let seq = &self.seqs[h];
                reserved += self.headroom(seq, seq.num_computed, lookahead);
            }
        }
        while *budget > 0 {
            let Some(handle) = self.waiting.head() else {
                break;
            };
            let cap = self.chunk_cap(*budget);
            let seq = &mut self.seqs[handle];
            let seated = self.running.len() + self.loading.len() + self.owed_forks;
            if seated + seq.seats() > self.config.max_num_seqs {
                break;
            }
            let request = &self.requests[seq.request];
            let num_tokens = seq.tokens.len();
            if self.config.enable_prefix_caching {
                let cacheable = &seq.tokens[..num_tokens - 1];
                (self.blocks).extend_hashes(request.hash_root, &mut seq.prefix_hashes, cacheable);
            }
            let found =
                (self.blocks).match_prefix(request.hash_root, &seq.prefix_hashes, num_tokens);
            // Tokens every group serves from RAM.
            let cached = found.iter().map(PrefixMatch::num_cached_tokens).min();
            let cached = cached.expect("a group");
            // With tier hits (in any group), only the hit tokens are admitted (their blocks loaded);
            // the sequence computes nothing this step.
            let loads: usize = found.iter().map(|f| f.tier_hashes.len()).sum();
            let len = if loads > 0 {
                0
            } else {
                (num_tokens - cached).min(cap)
            };
            let admitted = found[0].num_hit_tokens() + len;
            let needed = self.blocks.blocks_to_admit(&found, admitted);
            let own_headroom = lookahead.map_or(0, |lookahead| {
                self.headroom(&self.seqs[handle], admitted, lookahead)
            });
            // An empty batch admits the head whenever its first chunk fits.
            let headroom = if self.running.is_empty() && self.loading.is_empty() {
                0
            } else {
                reserved + own_headroom
            };
            if needed + headroom > self.blocks.manager().num_available_blocks() {
                break;
            }
            let seq = &mut self.seqs[handle];
            let request = &self.requests[seq.request];
            self.blocks
                .admit(seq.block_seq, &seq.tokens[..admitted], found)
                .expect("capacity checked");
            if loads == 0 {
                // A sliding group's hits before the first new token's window go straight back.
                self.blocks
                    .release_behind(seq.block_seq, cached)
                    .expect("admitted just now, not loading");
            }
            let stats = &mut self.output.stats;
            stats.num_admitted += 1;
            stats.prefix_queried_tokens += num_tokens as u64;
            stats.prefix_hit_tokens += cached as u64;
            self.totals.tier_hit_tokens += (admitted - len - cached) as u64;
            stats.num_prefill_tokens += len;
            self.output.events.push(RequestEvent {
                request_id: request.id.clone(),
                seq_index: seq.index,
                kind: if seq.preempted {
                    RequestEventKind::Resumed
                } else {
                    RequestEventKind::Admitted
                },
                prefix_hit_tokens: cached,
            });
            seq.num_computed = admitted;
            let victim_class = match self.config.policy {
                Policy::Fcfs => 0,
                Policy::Priority { .. } => request.priority,
            };
            seq.victim_rank = (victim_class, self.next_admission, seq.index);
            self.next_admission += 1;
            self.owed_forks += seq.pending_forks as usize;
            self.waiting.pop_head();
            reserved += own_headroom;
            if loads > 0 {
                seq.status = SeqStatus::Loading;
                self.loading.push(handle);
                continue;
            }
            seq.status = SeqStatus::Running;
            self.insert_running(handle);
            *budget -= len;
            self.rows.push(Row {
                seq: handle,
                start: cached,
                len,
            });
        }
    }

    fn insert_running(&mut self, handle: Handle) {
        let rank = self.seqs[handle].victim_rank;
        let seqs = &self.seqs;
        let at = self
            .running
            .partition_point(|&h| seqs[h].victim_rank < rank);
        self.running.insert(at, handle);
    }

    /// Writes the rows into the output arrays, forking prompts that completed this step.
    fn fill_output(&mut self) {
        // The widest table: the smallest blocks.
        let block_size = (self.blocks.groups().iter())
            .map(|g| g.block_size)
            .min()
            .expect("a group");
        let width = self
            .rows
            .iter()
            .map(|r| (r.start + r.len).div_ceil(block_size))
            .max()
            .unwrap_or(0);
        let num_tokens: usize = self.rows.iter().map(|r| r.len).sum();
        let num_groups = self.blocks.num_groups();
        let out = &mut self.output;
        out.reserve(self.rows.len(), num_tokens * num_groups);
        out.block_table_width = width;
        out.num_kv_groups = num_groups;
        out.block_tables
            .resize(num_groups * self.rows.len() * width, -1);
        out.query_start_loc.push(0);
        for (i, row) in self.rows.iter().enumerate() {
            let seq = &self.seqs[row.seq];
            let request = &self.requests[seq.request];
            let end = row.start + row.len;
            let first_token = out.input_ids.len();
            out.input_ids
                .extend(seq.tokens[row.start..end].iter().map(|&t| i64::from(t)));
            out.positions.extend(row.start as i64..end as i64);
            out.query_start_loc.push(out.input_ids.len() as i32);
            out.context_lens.push(end as i32);
            out.request_ids.push(request.id.clone());
            out.seq_indices.push(seq.index);
            if end == seq.tokens.len() {
                let logits_index = (first_token + row.len - 1) as i64;
                out.logits_indices.push(logits_index);
                out.sample_request_ids.push(request.id.clone());
                out.sample_seq_indices.push(seq.index);
                self.samples.push(row.seq);
            }
            // Group 0's slots and table in this pass (the only group of most models).
            let table =
                (self.blocks.table(seq.block_seq, 0)).expect("scheduled sequences have tables");
            fill_row(out, table, row, i * width);
        }
        // The other groups' after it, group-major (`StepOutput`).
        for group in 1..num_groups {
            for (i, row) in self.rows.iter().enumerate() {
                let table = (self.blocks.table(self.seqs[row.seq].block_seq, group))
                    .expect("scheduled sequences have tables");
                fill_row(out, table, row, (group * self.rows.len() + i) * width);
            }
        }
        // Forks last: they change the running list and the slab, which the loop above reads.
        for k in 0..self.samples.len() {
            let parent = self.samples[k];
            if self.seqs[parent].pending_forks > 0 {
                let logits_index = self.output.logits_indices[k];
                self.fork_prompt(parent, logits_index);
            }
        }
    }

    /// Forks a sequence whose prompt was just computed into its request's remaining samples,
    /// each sampling from the same logits row as the parent.
    fn fork_prompt(&mut self, parent: Handle, logits_index: i64) {
        let forks = std::mem::take(&mut self.seqs[parent].pending_forks);
        self.owed_forks -= forks as usize;
        for index in 1..=forks {
            let block_seq = self.take_block_seq();
            let p = &self.seqs[parent];
            self.blocks
                .fork(p.block_seq, block_seq)
                .expect("fresh id of a running parent");
            let child = Sequence {
                request: p.request,
                index,
                block_seq,
                tokens: p.tokens.clone(),
                num_computed: p.num_computed,
                num_output: 0,
                prefix_hashes: p.prefix_hashes.clone(),
                status: SeqStatus::Running,
                queue_key: p.queue_key.for_sequence(index),
                pending_forks: 0,
                preempted: false,
                victim_rank: (p.victim_rank.0, p.victim_rank.1, index),
            };
            let request_id = self.requests[p.request].id.clone();
            let request = p.request;
            let child = self.seqs.insert(child);
            self.requests[request].seqs.push(child);
            self.insert_running(child);
            self.output.logits_indices.push(logits_index);
            self.output.sample_request_ids.push(request_id);
            self.output.sample_seq_indices.push(index);
            self.samples.push(child);
        }
    }

    /// Frees a sequence that produced its last token, and its request if it was the last one.
    fn finish_sequence(&mut self, handle: Handle) {
        let seq = self.seqs.remove(handle).expect("live sequence");
        self.blocks
            .free(seq.block_seq)
            .expect("running sequences have tables");
        let request = &mut self.requests[seq.request];
        request.seqs.retain(|&h| h != handle);
        if request.seqs.is_empty() {
            let request = self.requests.remove(seq.request).expect("live request");
            self.request_ids.remove(&request.id);
            self.update_output.finished_requests.push(request.id);
            self.totals.finished_requests += 1;
        }
    }
}
