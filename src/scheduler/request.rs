//! Requests, their sampling limits, and the sequences that run them.
//!
//! A request owns `n` sequences once its prompt is prefilled (one before: the prompt is computed
//! once, then forked). Invariants of a sequence:
//! - `tokens` is the prompt followed by every token sampled for it; it only grows, so a preempted
//!   sequence keeps its tokens and recomputes them on resume;
//! - `num_computed <= tokens.len()`: the leading tokens that have a KV slot (cached, computed, or
//!   scheduled in the step not yet updated). Between `update` and the next `schedule` a running
//!   sequence has `num_computed < tokens.len()`;
//! - `prefix_hashes[g]` are the chained hashes of the leading full blocks of `tokens` in KV cache
//!   group `g` (`crate::kv::coordinator::group_root`), each a prefix of the full list (extended
//!   lazily, only when prefix caching is on);
//! - `pending_forks > 0` only before the prompt's prefill completes (only sequence 0 exists then).

use std::sync::Arc;

use crate::error::{ensure, Result};
use crate::ids::{SeqId, TokenId};
use crate::memory::prefix_cache::BlockHash;
use crate::scheduler::queue::QueueKey;
use crate::scheduler::slab::Handle;

/// When a request stops generating.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SamplingParams {
    /// Most tokens to generate per sequence (at least 1).
    pub max_tokens: usize,
    /// Tokens that finish a sequence when sampled (they are kept as its last output token).
    pub stop_token_ids: Vec<TokenId>,
    /// Keep generating past the scheduler's end-of-sequence token (stop_token_ids still stop).
    pub ignore_eos: bool,
    /// Parallel samples: sequences sharing the prompt's blocks (at least 1).
    pub n: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            n: 1,
        }
    }
}

impl SamplingParams {
    pub(crate) fn validate(&self) -> Result<()> {
        ensure(self.max_tokens >= 1, || {
            "max_tokens must be at least 1".into()
        })?;
        ensure(self.n >= 1, || "n must be at least 1".into())
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// Sampled a stop token (or the end-of-sequence token without `ignore_eos`).
    Stop,
    /// Generated `max_tokens` tokens.
    Length,
    /// Reached the model's maximum length.
    MaxModelLen,
}

impl FinishReason {
    /// The name used in Python outputs.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::MaxModelLen => "max_model_len",
        }
    }
}

/// Where a sequence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqStatus {
    Waiting,
    /// Holding blocks that a tier is loading; not scheduled until the loads end.
    Loading,
    Running,
}

/// A request as submitted, plus the bookkeeping of its live sequences.
pub(crate) struct Request {
    pub id: Arc<str>,
    pub params: SamplingParams,
    pub priority: i64,
    /// Root of the prefix-hash chain (from the cache salt).
    pub hash_root: BlockHash,
    /// Live sequences (finished ones are removed).
    pub seqs: Vec<Handle>,
}

/// One sequence of tokens with its own block table.
pub(crate) struct Sequence {
    pub request: Handle,
    /// Position among the request's `n` samples.
    pub index: u32,
    /// Id of its block table in the block manager (unique for the scheduler's lifetime).
    pub block_seq: SeqId,
    pub tokens: Vec<TokenId>,
    pub num_computed: usize,
    pub num_output: usize,
    pub prefix_hashes: Vec<Vec<BlockHash>>,
    pub status: SeqStatus,
    /// Position in the waiting queue whenever it waits (the request's key, this sample's index).
    pub queue_key: QueueKey,
    pub pending_forks: u32,
    /// Whether it was ever preempted (its next admission is a resumption).
    pub preempted: bool,
    /// Order key among running sequences: the back of the running list is the next victim.
    pub victim_rank: (i64, u64, u32),
}

impl Sequence {
    /// Tokens not yet computed (the rest of the prompt, or the last sampled token).
    pub fn num_uncomputed(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Sequences this one occupies in the running batch once its prompt is forked.
    pub fn seats(&self) -> usize {
        1 + self.pending_forks as usize
    }
}
