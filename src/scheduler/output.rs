//! What a step hands to the model runner, what `update` hands back, and the scheduler's figures.
//!
//! Layout of a step with `S` scheduled sequences (rows), `T` scheduled tokens and `K` samples:
//! - `input_ids`, `positions`, `slot_mapping`: `[T]`, row i's tokens at
//!   `query_start_loc[i]..query_start_loc[i + 1]`;
//! - `query_start_loc`: `[S + 1]`, starting at 0, ending at `T`;
//! - `context_lens`: `[S]`, tokens in the cache for row i including this step's, so query j of
//!   row i sits at position `context_lens[i] - nq_i + j` and attends causally up to it;
//! - `block_tables`: `[S, block_table_width]` row-major, padded with -1; row i holds exactly
//!   `ceil(context_lens[i] / block_size)` blocks;
//! - `copy_ops`: `[C, 2]` row-major `(src, dst)` block copies to apply before attention;
//! - `logits_indices`: `[K]`, the token row (into `T`) whose logits sample each of the `K`
//!   samples; a row appears several times when a prompt forks into `n` samples.
//!
//! - `events`: what happened to requests in this step besides running (admitted, preempted,
//!   resumed), in the order it happened; the admissions (first or resumed) number
//!   `stats.num_admitted` and the preemptions `stats.num_preempted`.
//!
//! The buffers are reused from step to step: nothing here grows with history.

use std::sync::Arc;

use crate::scheduler::request::FinishReason;
use crate::tier::TierCounters;

/// Which step of which scheduler a `StepOutput` is: `update` takes it and refuses any other
/// than the step it awaits, so another scheduler's output (whose step number may match) is refused.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StepId {
    /// Process-unique number of the scheduler that built the step.
    pub(crate) scheduler: u64,
    pub(crate) step: u64,
}

impl StepId {
    /// The step number (from 0) within its scheduler.
    pub fn number(self) -> u64 {
        self.step
    }
}

/// The batch of one step.
#[derive(Debug, Default, Clone)]
pub struct StepOutput {
    /// The step this is, to pass to `update`.
    pub id: StepId,
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    /// Each KV cache group's slot of each token, group-major: `[num_kv_groups, num_tokens]`.
    pub slot_mapping: Vec<i64>,
    pub query_start_loc: Vec<i32>,
    pub context_lens: Vec<i32>,
    /// Each group's block table of each row, group-major: `[num_kv_groups, num_seqs,
    /// block_table_width]`, padded (and a window's released blocks shown) with -1.
    pub block_tables: Vec<i32>,
    pub block_table_width: usize,
    /// KV cache groups the slot mapping and block tables cover (`crate::kv::coordinator`).
    pub num_kv_groups: usize,
    /// Flattened `(src, dst)` pairs.
    pub copy_ops: Vec<i64>,
    pub logits_indices: Vec<i64>,
    /// Request of each row.
    pub request_ids: Vec<Arc<str>>,
    /// Sample index (0..n) of each row's sequence.
    pub seq_indices: Vec<u32>,
    /// Request of each sample.
    pub sample_request_ids: Vec<Arc<str>>,
    /// Sample index of each sample's sequence.
    pub sample_seq_indices: Vec<u32>,
    /// Admissions and preemptions of this step, in order.
    pub events: Vec<RequestEvent>,
    pub stats: StepStats,
}

/// What happened to a sequence at a step, besides running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestEventKind {
    /// Admitted from the waiting queue for the first time.
    Admitted,
    /// Admitted again after a preemption (its tokens recomputed, mostly from the prefix cache).
    Resumed,
    /// Returned to the waiting queue, its blocks freed.
    Preempted,
}

impl RequestEventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RequestEventKind::Admitted => "admitted",
            RequestEventKind::Resumed => "resumed",
            RequestEventKind::Preempted => "preempted",
        }
    }
}

/// One admission or preemption of one sequence (sample `seq_index` of `request_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestEvent {
    pub request_id: Arc<str>,
    pub seq_index: u32,
    pub kind: RequestEventKind,
    /// Tokens found in the prefix cache at this admission (0 for a preemption).
    pub prefix_hit_tokens: usize,
}

impl StepOutput {
    /// Rows (sequences) in the batch.
    pub fn num_seqs(&self) -> usize {
        self.context_lens.len()
    }

    /// Tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    /// Tokens `update` expects, one per sample.
    pub fn num_samples(&self) -> usize {
        self.logits_indices.len()
    }

    /// Makes room for `rows` rows and `tokens` tokens at once: after the buffers were moved out
    /// (to Python), they start empty, and growing them by doubling would cost several copies.
    pub(crate) fn reserve(&mut self, rows: usize, tokens: usize) {
        self.input_ids.reserve(tokens);
        self.positions.reserve(tokens);
        self.slot_mapping.reserve(tokens);
        self.query_start_loc.reserve(rows + 1);
        self.context_lens.reserve(rows);
        self.request_ids.reserve(rows);
        self.seq_indices.reserve(rows);
        self.logits_indices.reserve(rows);
        self.sample_request_ids.reserve(rows);
        self.sample_seq_indices.reserve(rows);
    }

    pub(crate) fn clear(&mut self) {
        self.input_ids.clear();
        self.positions.clear();
        self.slot_mapping.clear();
        self.query_start_loc.clear();
        self.context_lens.clear();
        self.block_tables.clear();
        self.block_table_width = 0;
        self.num_kv_groups = 0;
        self.copy_ops.clear();
        self.logits_indices.clear();
        self.request_ids.clear();
        self.seq_indices.clear();
        self.sample_request_ids.clear();
        self.sample_seq_indices.clear();
        self.events.clear();
        self.stats = StepStats::default();
    }
}

/// Figures of one step, taken when `schedule` returns.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Running sequences (scheduled or not this step).
    pub num_running: usize,
    /// Waiting sequences.
    pub num_waiting: usize,
    /// Sequences preempted in this step.
    pub num_preempted: usize,
    /// Tokens scheduled (prefill + decode).
    pub num_scheduled_tokens: usize,
    /// Of those, prompt (or recompute) tokens.
    pub num_prefill_tokens: usize,
    /// Sequences admitted from the waiting queue.
    pub num_admitted: usize,
    /// Prompt tokens looked up in the prefix cache at this step's admissions, and hits.
    pub prefix_queried_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Fraction of KV blocks in use.
    pub kv_usage: f64,
}

/// One token produced by `update`.
#[derive(Debug, Clone, PartialEq)]
pub struct Produced {
    pub request_id: Arc<str>,
    pub seq_index: u32,
    pub token: u32,
    /// Set when this token ended its sequence.
    pub finish: Option<FinishReason>,
}

/// What one `update` produced.
#[derive(Debug, Default, Clone)]
pub struct UpdateOutput {
    /// One entry per sample of the step, in sample order, except samples of aborted requests.
    pub produced: Vec<Produced>,
    /// Requests whose every sequence finished in this update.
    pub finished_requests: Vec<Arc<str>>,
}

/// Totals since the scheduler was made, plus current occupancy.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct SchedulerStats {
    pub steps: u64,
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_unfinished_requests: usize,
    pub scheduled_tokens: u64,
    pub prefill_tokens: u64,
    pub generated_tokens: u64,
    pub preemptions: u64,
    pub finished_requests: u64,
    pub aborted_requests: u64,
    pub peak_running: usize,
    pub prefix_queried_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// `prefix_hit_tokens / prefix_queried_tokens` (0 before any lookup).
    pub prefix_hit_rate: f64,
    pub kv_usage: f64,
    pub cow_copies: u64,
    /// Blocks sliding windows released from running sequences (`Scheduler::keeping`).
    pub window_released_blocks: u64,
    /// Sequences waiting for their loads from the tier (now).
    pub num_loading: usize,
    /// Blocks (and their tokens) that admissions found in the tier, past the RAM hits.
    pub tier_hit_blocks: u64,
    pub tier_hit_tokens: u64,
    /// Loads issued (one per tier-hit block) and, of those, dropped (missing or failing
    /// verification: recomputed).
    pub loads_issued: u64,
    pub loads_dropped: u64,
    /// Cached blocks handed to the tier on eviction.
    pub offloads_issued: u64,
    /// Cached blocks dropped instead, because an allocation found no clean block.
    pub evictions_without_offload: u64,
    /// The tier's own counters (zero without a tier).
    pub tier: TierCounters,
}

/// One figure of the stats, by the one name it has everywhere (the Python dicts, the metrics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Figure {
    Count(u64),
    Fraction(f64),
}

impl From<u64> for Figure {
    fn from(n: u64) -> Figure {
        Figure::Count(n)
    }
}

impl From<usize> for Figure {
    fn from(n: usize) -> Figure {
        Figure::Count(n as u64)
    }
}

impl From<f64> for Figure {
    fn from(x: f64) -> Figure {
        Figure::Fraction(x)
    }
}

macro_rules! figures {
    ($($name:literal => $value:expr),* $(,)?) => {
        vec![$(($name, Figure::from($value))),*]
    };
}

impl SchedulerStats {
    /// Every figure by name; with `tier` (the attached tier's counters, or those it had when
    /// detached), the disk tier's too (`disk_*`: the block manager's counts and the tier's own).
    pub fn figures(&self, tier: Option<&TierCounters>) -> Vec<(&'static str, Figure)> {
        let mut out = figures![
            "steps" => self.steps,
            "num_running" => self.num_running,
            "num_waiting" => self.num_waiting,
            "num_unfinished_requests" => self.num_unfinished_requests,
            "scheduled_tokens" => self.scheduled_tokens,
            "prefill_tokens" => self.prefill_tokens,
            "generated_tokens" => self.generated_tokens,
            "preemptions" => self.preemptions,
            "finished_requests" => self.finished_requests,
            "aborted_requests" => self.aborted_requests,
            "peak_running" => self.peak_running,
            "prefix_queried_tokens" => self.prefix_queried_tokens,
            "prefix_hit_tokens" => self.prefix_hit_tokens,
            "prefix_hit_rate" => self.prefix_hit_rate,
            "kv_usage" => self.kv_usage,
            "cow_copies" => self.cow_copies,
            "window_released_blocks" => self.window_released_blocks,
            "num_loading" => self.num_loading,
        ];
        if let Some(tier) = tier {
            out.extend(figures![
                "disk_hits" => self.tier_hit_blocks,
                "disk_hit_tokens" => self.tier_hit_tokens,
                "disk_loads" => tier.loads,
                "disk_loads_dropped" => self.loads_dropped,
                "disk_dropped_corrupt" => tier.dropped_corrupt,
                "disk_load_misses" => tier.load_misses,
                "disk_offloads_issued" => self.offloads_issued,
                "disk_offloads" => tier.offloads,
                "disk_offloads_lost" => tier.offloads_lost,
                "disk_evictions_without_offload" => self.evictions_without_offload,
                "disk_evictions" => tier.evictions,
                "disk_bytes_written" => tier.bytes_written,
                "disk_bytes_read" => tier.bytes_read,
                "disk_blocks" => tier.blocks,
                "disk_jobs_in_flight" => tier.jobs_in_flight,
            ]);
        }
        out
    }
}

impl StepStats {
    /// Every figure of the step by name.
    pub fn figures(&self) -> Vec<(&'static str, Figure)> {
        figures![
            "num_running" => self.num_running,
            "num_waiting" => self.num_waiting,
            "num_preempted" => self.num_preempted,
            "num_admitted" => self.num_admitted,
            "num_scheduled_tokens" => self.num_scheduled_tokens,
            "num_prefill_tokens" => self.num_prefill_tokens,
            "prefix_queried_tokens" => self.prefix_queried_tokens,
            "prefix_hit_tokens" => self.prefix_hit_tokens,
            "kv_usage" => self.kv_usage,
        ]
    }
}
