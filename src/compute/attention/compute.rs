//! The attention loop of one work item (online softmax over key tiles) and the merge of
//! partitions.
//!
//! Invariants:
//! - Per query row the loop keeps a running maximum `m`, a running sum `l` of `exp(s - m)` and an
//!   unnormalised output `acc = Σ exp(s - m) v`; when `m` grows, `l` and `acc` are rescaled by
//!   `exp(m_old - m_new)`. The output is `acc / l`.
//! - Query rows are pre-multiplied by the softmax scale when gathered, so scores come out scaled.
//! - A key past a query's position, or before its window, scores `-inf`, whose weight is exactly
//!   0. A row that has seen no allowed key yet keeps `m = -inf`, `l = 0`, `acc = 0`: such a
//!   partition adds nothing when merged (only partitions of prefill tiles, or before a later
//!   query's window, can be wholly masked for some rows; every row allows its own position, which
//!   some partition of its tile covers, so the merged maximum is finite).
//! - Items write disjoint output rows or their own partial slot, so they run in parallel without
//!   locks (see [`SharedOut`]).

use std::cell::RefCell;

use super::layout::KvLayout;
use super::plan::{Group, Heads, Item};
use super::simd::Kernels;
use super::Problem;
use crate::store::dtype::KvElement;

/// Keys an online-softmax step covers at least (whole blocks).
const KEYS_PER_STEP: usize = 64;

/// A raw pointer to an output buffer that work items write in disjoint regions.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: the plan gives every region to exactly one item or group (module invariants), so no
// two threads ever touch the same element.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub fn new(buffer: &mut [f32]) -> Self {
        SharedOut {
            ptr: buffer.as_mut_ptr(),
            len: buffer.len(),
        }
    }

    /// The region `start..start + len`.
    ///
    /// # Safety
    /// No other live reference may overlap the region.
    #[allow(clippy::mut_from_ref)]
    unsafe fn region(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start + len <= self.len, "output region out of bounds");
        std::slice::from_raw_parts_mut(self.ptr.add(start), len)
    }
}

/// Per-thread buffers of the loop, grown on demand and reused across items and calls.
#[derive(Default)]
struct Scratch {
    queries: Vec<f32>,
    scores: Vec<f32>,
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn resize(buffer: &mut Vec<f32>, len: usize, value: f32) {
    buffer.clear();
    buffer.resize(len, value);
}

/// Floats in one partial slot: `max[rows]`, `sum[rows]`, `acc[rows × head_dim]`.
pub(crate) fn partial_slot_len(max_rows: usize, head_dim: usize) -> usize {
    max_rows * (head_dim + 2)
}

/// Runs one item: writes its output rows, or its partial slot when the tile is partitioned.
///
/// # Safety
/// `K` must be available on this CPU; `out` and `partials` must be sized for the plan.
pub(crate) unsafe fn run_item<K: Kernels, T: KvElement, L: KvLayout<T>>(
    problem: &Problem<'_>,
    layout: &L,
    item: &Item,
    max_rows: usize,
    out: SharedOut,
    partials: SharedOut,
) {
    SCRATCH.with(|scratch| {
        let scratch = &mut *scratch.borrow_mut();
        let (d, group, bs) = (problem.head_dim, problem.group_size(), layout.block_size());
        // Rows are grouped by KV head: `head_rows` rows (query i / group, query head i % group of
        // the KV head's group) per KV head of the item.
        let head_rows = item.queries * group;
        let rows = head_rows * item.heads.count;
        // Keys scored per online-softmax step: several small blocks at once, so the per-row
        // softmax bookkeeping is paid per 64 keys rather than per block.
        let blocks_per_step = (KEYS_PER_STEP / bs).max(1);
        let stride = (blocks_per_step * bs).next_multiple_of(8);
        // Tiles are visited block by block, KV head by KV head within a block; while one computes,
        // the tile `ahead` places later in that order is prefetched: about `KEYS_PER_STEP` rows
        // ahead. With shuffled blocks the hardware prefetcher cannot run ahead across tiles, one
        // tile of 16 rows is too short to cover memory latency, and much more leaves L2 before use.
        let ahead = (KEYS_PER_STEP / bs).max(1);
        let heads = item.heads.count;
        let kv_head = |h: usize| item.heads.first + h;
        // The K and V tiles to prefetch while tile (b, h) computes (empty past the item's end).
        let tiles_ahead = |b: usize, h: usize| {
            let later = (b - item.first_block) * heads + h + ahead;
            let (block, head) = (item.first_block + later / heads, later % heads);
            layout.tile_or_empty(item.seq, kv_head(head), block, item.end_block)
        };
        let first_position =
            problem.context_len(item.seq) - problem.num_queries(item.seq) + item.first_query;
        let last_position = first_position + item.queries - 1;

        resize(&mut scratch.queries, rows * d, 0.0);
        let query_base = problem.query_offset(item.seq) + item.first_query;
        for (i, row) in scratch.queries.chunks_exact_mut(d).enumerate() {
            let (h, j) = (i / head_rows, i % head_rows);
            let head = kv_head(h) * group + j % group;
            let at = ((query_base + j / group) * problem.num_heads + head) * d;
            for (dst, &x) in row.iter_mut().zip(&problem.q[at..at + d]) {
                *dst = x * problem.scale;
            }
        }
        resize(&mut scratch.scores, rows * stride, 0.0);
        resize(&mut scratch.acc, rows * d, 0.0);
        resize(&mut scratch.max, rows, f32::NEG_INFINITY);
        resize(&mut scratch.sum, rows, 0.0);

        // The first tiles are requested together, so their misses overlap; every later tile is
        // prefetched `ahead` blocks early while the kernels work (see `Kernels::scores`).
        for t in 0..ahead {
            let (b, h) = (item.first_block + t / heads, t % heads);
            if b >= item.end_block {
                break;
            }
            let (keys, values) = layout.tile(item.seq, kv_head(h), b);
            K::prefetch(keys);
            K::prefetch(values);
        }
        let mut block = item.first_block;
        while block < item.end_block {
            let step_end = (block + blocks_per_step).min(item.end_block);
            let first_key = block * bs;
            // Score the step's key blocks side by side: only the sequence's last block can be
            // partial, so its keys occupy columns 0..columns without gaps.
            let mut columns = 0;
            for b in block..step_end {
                let valid = bs.min(last_position + 1 - b * bs);
                for h in 0..heads {
                    let (keys, _) = layout.tile(item.seq, kv_head(h), b);
                    let (next_keys, _) = tiles_ahead(b, h);
                    K::scores(
                        &scratch.queries[h * head_rows * d..],
                        head_rows,
                        keys,
                        valid,
                        d,
                        &mut scratch.scores[h * head_rows * stride + columns..],
                        stride,
                        next_keys,
                    );
                }
                columns += valid;
            }
            for i in 0..rows {
                // The row's allowed columns: its window start (0 without a window) through its
                // own position.
                let position = first_position + (i % head_rows) / group;
                let end = (position + 1).saturating_sub(first_key).min(columns);
                let start = problem
                    .window_start(position)
                    .saturating_sub(first_key)
                    .min(end);
                let scores = &mut scratch.scores[i * stride..i * stride + columns];
                scores[end..].fill(f32::NEG_INFINITY);
                if start == end {
                    scores.fill(0.0);
                    continue;
                }
                scores[..start].fill(f32::NEG_INFINITY);
                let block_max = K::max(&scores[start..end]);
                let running_max = &mut scratch.max[i];
                if block_max > *running_max {
                    if scratch.sum[i] > 0.0 {
                        let correction = (*running_max - block_max).exp();
                        scratch.sum[i] *= correction;
                        K::scale(&mut scratch.acc[i * d..(i + 1) * d], correction);
                    }
                    *running_max = block_max;
                }
                scratch.sum[i] += K::exp_sub_sum(scores, *running_max);
            }
            let mut column = 0;
            for b in block..step_end {
                let valid = bs.min(last_position + 1 - b * bs);
                for h in 0..heads {
                    let (_, values) = layout.tile(item.seq, kv_head(h), b);
                    let (_, next_values) = tiles_ahead(b, h);
                    K::accumulate(
                        &scratch.scores[h * head_rows * stride + column..],
                        stride,
                        head_rows,
                        values,
                        valid,
                        d,
                        &mut scratch.acc[h * head_rows * d..],
                        next_values,
                    );
                }
                column += valid;
            }
            block = step_end;
        }
        match item.partial_slot {
            None => {
                for i in 0..rows {
                    let dst = out.region(
                        output_offset(
                            problem,
                            item.seq,
                            item.heads,
                            item.first_query,
                            item.queries,
                            i,
                        ),
                        d,
                    );
                    let inverse = 1.0 / scratch.sum[i];
                    for (o, &a) in dst.iter_mut().zip(&scratch.acc[i * d..(i + 1) * d]) {
                        *o = a * inverse;
                    }
                }
            }
            Some(slot) => {
                let slot = partials.region(
                    slot * partial_slot_len(max_rows, d),
                    partial_slot_len(max_rows, d),
                );
                let (max, rest) = slot.split_at_mut(max_rows);
                let (sum, acc) = rest.split_at_mut(max_rows);
                max[..rows].copy_from_slice(&scratch.max);
                sum[..rows].copy_from_slice(&scratch.sum);
                acc[..rows * d].copy_from_slice(&scratch.acc);
            }
        }
    })
}

/// Offset in `out` of row `i` of an item or group of `queries` query tokens over `heads` (rows
/// ordered KV head, query token, query head of the group).
fn output_offset(
    problem: &Problem<'_>,
    seq: usize,
    heads: Heads,
    first_query: usize,
    queries: usize,
    i: usize,
) -> usize {
    let group = problem.group_size();
    let (h, j) = (i / (queries * group), i % (queries * group));
    let token = problem.query_offset(seq) + first_query + j / group;
    (token * problem.num_heads + (heads.first + h) * group + j % group) * problem.head_dim
}

/// Merges the partial results of a group's partitions into its output rows.
///
/// # Safety
/// `out` and `partials` must be sized for the plan, and the group's items must have run.
pub(crate) unsafe fn merge_group(
    problem: &Problem<'_>,
    group: &Group,
    max_rows: usize,
    out: SharedOut,
    partials: SharedOut,
) {
    let d = problem.head_dim;
    let slot_len = partial_slot_len(max_rows, d);
    let slots: Vec<&[f32]> = (0..group.parts)
        .map(|p| &*partials.region((group.first_slot + p) * slot_len, slot_len))
        .collect();
    for i in 0..group.queries * problem.group_size() * group.heads.count {
        let global_max = slots.iter().map(|s| s[i]).fold(f32::NEG_INFINITY, f32::max);
        let dst = out.region(
            output_offset(
                problem,
                group.seq,
                group.heads,
                group.first_query,
                group.queries,
                i,
            ),
            d,
        );
        dst.fill(0.0);
        let mut total = 0.0;
        for slot in &slots {
            let weight = if slot[i] == f32::NEG_INFINITY {
                0.0
            } else {
                (slot[i] - global_max).exp()
            };
            total += weight * slot[max_rows + i];
            let acc = &slot[2 * max_rows + i * d..2 * max_rows + (i + 1) * d];
            for (o, &a) in dst.iter_mut().zip(acc) {
                *o += weight * a;
            }
        }
        let inverse = 1.0 / total;
        dst.iter_mut().for_each(|o| *o *= inverse);
    }
}
