//! Paged attention: decode, prefill and chunked prefill read K/V straight through block tables.
//!
//! Semantics: sequence `i` has `nq = query_start_loc[i + 1] - query_start_loc[i]` query tokens;
//! its query `j` sits at position `p = context_len - nq + j` and attends to keys `0..=p`, or,
//! with a sliding window of `w` tokens, to the keys `k` with `p - w < k <= p` (its last `w`
//! positions, its own included: transformers' `q_idx - kv_idx < sliding_window`). The K/V of the
//! step's new tokens are already in the cache. Output row (token, head) is
//! `softmax(scale · q K^T) V` over those keys, accumulated in f32 whatever the K/V dtype.
//! `window: None` is full attention.
//!
//! Invariants:
//! - Every argument is validated before anything is computed; an error leaves `out` untouched.
//! - Only the part of a block table a sequence's queries attend to is read and validated: from
//!   the block holding the earliest window start of its queries (block 0 without a window) to
//!   block `ceil(context_len / block_size)`. Padding, and entries of blocks wholly before every
//!   window (which may be released, or hold -1), are never dereferenced.
//! - Work runs over (sequence, KV heads, query tile, key partition) items (see [`plan`]); each K/V
//!   tile is read once per KV-head group, all query heads of the group scored together; no item
//!   covers a block wholly before its tile's windows.
//! - Results do not depend on the thread count beyond f32 rounding of the partition merge.

mod compute;
mod layout;
mod plan;
mod simd;

use rayon::prelude::*;

use crate::compute::cpu::{num_threads, pool, Isa};

use crate::error::{Error, Result};
use crate::store::dtype::{KvDtype, KvElement};
use crate::store::kv_cache::{KvBuffer, KvCache, KvShape, LayerPart};
use compute::{merge_group, partial_slot_len, run_item, SharedOut};
use layout::{Contiguous, KvLayout, Paged};
use plan::Plan;
use simd::{Kernels, Portable};

/// The instruction sets attention has kernels for.
pub const ISAS: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Portable];

/// The per-batch tables an attention call reads, as the block manager and scheduler hand them out.
#[derive(Debug, Clone, Copy)]
pub struct AttentionBatch<'a> {
    /// `[num_seqs, max_blocks_per_seq]` row-major physical block ids; padding (-1) is never read.
    pub block_tables: &'a [i32],
    pub max_blocks_per_seq: usize,
    /// Per sequence: tokens in the cache including this step's new tokens.
    pub context_lens: &'a [i32],
    /// `[num_seqs + 1]` cumulative query-token offsets into `q`, starting at 0.
    pub query_start_loc: &'a [i32],
}

/// The instruction set calls take by default: the best of [`ISAS`] under `cpu::ceiling`.
pub fn default_isa() -> Isa {
    Isa::default_of(&ISAS)
}

/// Attention of `q` (`[num_tokens, num_heads, head_dim]` f32) over layer `layer` of `cache`
/// through `batch`'s block tables, into `out` (same shape): over each query's last `window`
/// positions for a sliding-window layer, over every earlier one for `None`. See the module doc
/// for semantics.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    cache: &KvCache,
    layer: usize,
    q: &[f32],
    num_heads: usize,
    batch: &AttentionBatch<'_>,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) -> Result<()> {
    paged_attention_with(
        default_isa(),
        cache,
        layer,
        q,
        num_heads,
        batch,
        scale,
        window,
        out,
    )
}

/// [`paged_attention`] on a chosen instruction set (tests compare every one with the portable
/// one), over a store layer or one part of each of its blocks (a KV cache group carving its
/// pages, `crate::kv::spec`; the tables then count blocks of that part's tokens). The same loop
/// either way: a tile is a part's block, read as contiguously as a whole block.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_with(
    path: Isa,
    cache: &KvCache,
    layer: impl Into<LayerPart>,
    q: &[f32],
    num_heads: usize,
    batch: &AttentionBatch<'_>,
    scale: f32,
    window: Option<usize>,
    out: &mut [f32],
) -> Result<()> {
    let LayerPart { layer, part } = layer.into();
    let shape = cache.shape().carved(part)?;
    let address = cache.shape().part(part);
    let (keys, values) = cache.layer(layer)?;
    let problem = Problem::validate(
        q,
        num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        batch.context_lens,
        batch.query_start_loc,
        scale,
        window,
        out,
    )?;
    validate_tables(&problem, batch, &shape)?;
    check_path(path)?;
    macro_rules! run_on {
        ($keys:expr, $values:expr) => {{
            let layout = Paged {
                keys: $keys,
                values: $values,
                block_tables: batch.block_tables,
                max_blocks_per_seq: batch.max_blocks_per_seq,
                address,
            };
            execute(path, &problem, &layout, out)
        }};
    }
    match (keys, values) {
        (KvBuffer::F32(k), KvBuffer::F32(v)) => run_on!(k, v),
        (KvBuffer::F16(k), KvBuffer::F16(v)) => run_on!(k, v),
        (KvBuffer::Bf16(k), KvBuffer::Bf16(v)) => run_on!(k, v),
        _ => unreachable!("a KvCache stores K and V in one dtype"),
    }
}

/// K/V of a batch laid out contiguously, `[num_seqs, num_kv_heads, max_context, head_dim]` each:
/// the unpaged baseline the benchmark compares paging with. It runs the very same loop as
/// [`paged_attention`], cutting each sequence into tiles of `block_size` rows.
pub struct ContiguousKv {
    keys: KvBuffer,
    values: KvBuffer,
    num_seqs: usize,
    num_kv_heads: usize,
    max_context: usize,
    head_dim: usize,
}

impl ContiguousKv {
    /// K and V filled with pseudo-random values in [-1, 1) from `seed` (every page touched, so
    /// reads come from memory, not from the shared zero page).
    pub fn random(
        dtype: KvDtype,
        num_seqs: usize,
        num_kv_heads: usize,
        max_context: usize,
        head_dim: usize,
        seed: u64,
    ) -> Result<Self> {
        let dims = [num_seqs, num_kv_heads, max_context, head_dim];
        if dims.contains(&0) {
            return Err(Error::InvalidArgument(format!(
                "contiguous K/V dimensions must be positive: {dims:?}"
            )));
        }
        let len = dims.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
        let len = len.ok_or_else(|| {
            Error::InvalidArgument(format!("contiguous K/V of {dims:?} overflows"))
        })?;
        Ok(ContiguousKv {
            keys: KvBuffer::random(dtype, len, seed, "contiguous K")?,
            values: KvBuffer::random(dtype, len, seed ^ 0x9e37_79b9_7f4a_7c15, "contiguous V")?,
            num_seqs,
            num_kv_heads,
            max_context,
            head_dim,
        })
    }

    /// Storage dtype.
    pub fn dtype(&self) -> KvDtype {
        self.keys.dtype()
    }

    /// Attention of `q` over these K/V, tiles of `block_size` rows; sequence `i` uses its first
    /// `context_lens[i]` rows (a window skips the tiles wholly before it, as the paged loop
    /// does). Same semantics and errors as [`paged_attention`].
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        path: Isa,
        q: &[f32],
        num_heads: usize,
        context_lens: &[i32],
        query_start_loc: &[i32],
        block_size: usize,
        scale: f32,
        window: Option<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        let problem = Problem::validate(
            q,
            num_heads,
            self.num_kv_heads,
            self.head_dim,
            context_lens,
            query_start_loc,
            scale,
            window,
            out,
        )?;
        if problem.num_seqs() != self.num_seqs {
            return Err(Error::Shape(format!(
                "{} context lengths for {} sequences",
                problem.num_seqs(),
                self.num_seqs
            )));
        }
        if block_size == 0 {
            return Err(Error::InvalidArgument("block_size must be positive".into()));
        }
        // No tile is longer than a sequence, and the loop sizes its buffers by the block size: a
        // larger one would only ask for scratch memory no tile uses.
        let block_size = block_size.min(self.max_context);
        if let Some(seq) =
            (0..problem.num_seqs()).find(|&s| problem.context_len(s) > self.max_context)
        {
            return Err(Error::InvalidArgument(format!(
                "context length {} of sequence {seq} exceeds {}",
                problem.context_len(seq),
                self.max_context
            )));
        }
        check_path(path)?;
        macro_rules! run_on {
            ($keys:expr, $values:expr) => {{
                let layout = Contiguous {
                    keys: $keys,
                    values: $values,
                    num_kv_heads: self.num_kv_heads,
                    max_context: self.max_context,
                    block_size,
                    head_dim: self.head_dim,
                };
                execute(path, &problem, &layout, out)
            }};
        }
        match (&self.keys, &self.values) {
            (KvBuffer::F32(k), KvBuffer::F32(v)) => run_on!(k, v),
            (KvBuffer::F16(k), KvBuffer::F16(v)) => run_on!(k, v),
            (KvBuffer::Bf16(k), KvBuffer::Bf16(v)) => run_on!(k, v),
            _ => unreachable!("K and V share one dtype"),
        }
    }
}

/// The validated query side of a call.
pub(crate) struct Problem<'a> {
    pub q: &'a [f32],
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub context_lens: &'a [i32],
    pub query_start_loc: &'a [i32],
    pub scale: f32,
    /// Positions a query attends to, its own included (None: every earlier one).
    pub window: Option<usize>,
}

impl<'a> Problem<'a> {
    #[allow(clippy::too_many_arguments)]
    fn validate(
        q: &'a [f32],
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
        context_lens: &'a [i32],
        query_start_loc: &'a [i32],
        scale: f32,
        window: Option<usize>,
        out: &[f32],
    ) -> Result<Self> {
        let invalid = |message: String| Err(Error::InvalidArgument(message));
        if !head_dim.is_multiple_of(8) {
            return invalid(format!(
                "attention needs head_dim a multiple of 8, the cache has {head_dim}"
            ));
        }
        if num_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            return invalid(format!(
                "num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}"
            ));
        }
        if !scale.is_finite() {
            return invalid(format!("scale must be finite, got {scale}"));
        }
        if window == Some(0) {
            return invalid("a sliding window must hold at least one token, got 0".into());
        }
        let num_seqs = context_lens.len();
        if query_start_loc.len() != num_seqs + 1 {
            return Err(Error::Shape(format!(
                "query_start_loc has {} entries, expected num_seqs + 1 = {}",
                query_start_loc.len(),
                num_seqs + 1
            )));
        }
        if query_start_loc[0] != 0 {
            return invalid(format!(
                "query_start_loc must start at 0, got {}",
                query_start_loc[0]
            ));
        }
        for (seq, (pair, &context)) in query_start_loc.windows(2).zip(context_lens).enumerate() {
            let nq = pair[1] as i64 - pair[0] as i64;
            if nq < 0 {
                return invalid(format!(
                    "query_start_loc decreases at sequence {seq}: {} then {}",
                    pair[0], pair[1]
                ));
            }
            if context < 0 || nq > context as i64 {
                return invalid(format!(
                    "sequence {seq} has {nq} query tokens but context length {context}"
                ));
            }
        }
        let num_tokens = query_start_loc[num_seqs] as usize;
        let expected = num_tokens
            .checked_mul(num_heads)
            .and_then(|n| n.checked_mul(head_dim));
        if expected.is_none_or(|e| q.len() != e || out.len() != e) {
            return Err(Error::Shape(format!(
                "q and out must hold num_tokens × num_heads × head_dim = {num_tokens} × {num_heads} × {head_dim} floats, got {} and {}",
                q.len(),
                out.len()
            )));
        }
        Ok(Problem {
            q,
            num_heads,
            num_kv_heads,
            head_dim,
            context_lens,
            query_start_loc,
            scale,
            window,
        })
    }

    pub fn num_seqs(&self) -> usize {
        self.context_lens.len()
    }

    pub fn num_queries(&self, seq: usize) -> usize {
        (self.query_start_loc[seq + 1] - self.query_start_loc[seq]) as usize
    }

    pub fn context_len(&self, seq: usize) -> usize {
        self.context_lens[seq] as usize
    }

    pub fn query_offset(&self, seq: usize) -> usize {
        self.query_start_loc[seq] as usize
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// The first key a query at `position` attends to: 0, or the start of its window.
    #[inline]
    pub fn window_start(&self, position: usize) -> usize {
        self.window
            .map_or(0, |window| (position + 1).saturating_sub(window))
    }

    /// The first key any query of `seq` attends to: its first query's window start (a later
    /// position's window never starts earlier).
    pub fn first_key(&self, seq: usize) -> usize {
        self.window_start(self.context_len(seq) - self.num_queries(seq))
    }
}

/// Checks that the tables hold a row per sequence and that the entries each sequence's queries
/// attend to are block ids ([`KvShape::used_blocks`]); those wholly before its windows are not
/// looked at (module invariants).
fn validate_tables(
    problem: &Problem<'_>,
    batch: &AttentionBatch<'_>,
    shape: &KvShape,
) -> Result<()> {
    let num_seqs = problem.num_seqs();
    let width = batch.max_blocks_per_seq;
    if num_seqs.checked_mul(width) != Some(batch.block_tables.len()) {
        return Err(Error::Shape(format!(
            "block_tables has {} entries, expected num_seqs × max_blocks_per_seq = {num_seqs} × {width}",
            batch.block_tables.len()
        )));
    }
    for seq in 0..num_seqs {
        let row = &batch.block_tables[seq * width..(seq + 1) * width];
        let keys = problem.first_key(seq)..problem.context_len(seq);
        shape.used_blocks(row, keys, || format!("sequence {seq}"))?;
    }
    Ok(())
}

fn check_path(path: Isa) -> Result<()> {
    path.check_for("attention", &ISAS)
}

/// Runs a validated call on `path`. Fails only when the thread pool cannot be had, before
/// anything is written.
fn execute<T: KvElement, L: KvLayout<T>>(
    path: Isa,
    problem: &Problem<'_>,
    layout: &L,
    out: &mut [f32],
) -> Result<()> {
    match path {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => execute_on::<simd::Avx512, T, L>(problem, layout, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => execute_on::<simd::Avx2, T, L>(problem, layout, out),
        Isa::Portable => execute_on::<Portable, T, L>(problem, layout, out),
        _ => unreachable!("check_path refuses sets attention has no kernel for, or this CPU lacks"),
    }
}

fn execute_on<K: Kernels, T: KvElement, L: KvLayout<T>>(
    problem: &Problem<'_>,
    layout: &L,
    out: &mut [f32],
) -> Result<()> {
    let threads = num_threads();
    let plan = Plan::new(
        problem,
        layout.block_size(),
        std::mem::size_of::<T>(),
        threads,
    );
    let pool = if plan.inline { None } else { Some(pool()?) };
    let max_rows = plan.max_rows;
    let mut partials =
        vec![0.0f32; plan.partial_slots() * partial_slot_len(max_rows, problem.head_dim)];
    let (out, partials) = (SharedOut::new(out), SharedOut::new(&mut partials));
    // SAFETY: `execute` only reaches here on an available path; the plan gives each item and group
    // disjoint output rows and slots, and the merge runs after every item.
    let run = |item| unsafe { run_item::<K, T, L>(problem, layout, item, max_rows, out, partials) };
    let merge = |group| unsafe { merge_group(problem, group, max_rows, out, partials) };
    match pool {
        None => {
            plan.items.iter().for_each(run);
            plan.groups.iter().for_each(merge);
        }
        Some(pool) => pool.install(|| {
            plan.items.par_iter().with_max_len(1).for_each(run);
            plan.groups.par_iter().for_each(merge);
        }),
    }
    Ok(())
}

#[cfg(test)]
mod tests;
