//! How one attention call is cut into independent work items.
//!
//! An item is (sequence, KV heads, query tile, key partition): all query heads of one KV head's
//! group, or of every KV head when the tile is small enough (decode), for up to `tile_tokens`
//! query tokens, against a contiguous range of that sequence's key blocks. An item over every KV
//! head reads each block's K (and V) as one contiguous run of `num_kv_heads` tiles, which a
//! shuffled block table of small blocks otherwise cuts into scattered 4–8 KiB pieces.
//! Invariants:
//! - Every (query token, query head) output row belongs to exactly one query tile; when the tile's
//!   keys are split into several partitions (flash-decoding), each partition writes its own
//!   partial-result slot and one [`Group`] merges them into the output rows.
//! - A tile only visits key blocks up to its last query's position: the causal mask never lets a
//!   query see later keys. With a sliding window it visits none before the block holding its
//!   first query's window start (the earliest of its queries'): a partition wholly before it
//!   never exists, and no item reads its block-table entries.
//! - Partitions exist only to give every thread work (batch 1, few KV heads, long context); a
//!   call small enough to run inline is never split.

use super::Problem;

/// Query rows (tokens × heads of a group) a prefill tile aims for: enough reuse of each K/V tile
/// loaded into L1 to make prefill compute-bound, few enough that the query rows, scores and
/// accumulators of a tile stay in L1/L2.
const TARGET_TILE_ROWS: usize = 32;
/// Key partitions aim for this many work items per thread, so rayon can balance uneven items.
const ITEMS_PER_THREAD: usize = 4;
/// A partition covers at least this many keys: below, the merge costs more than it spreads.
const MIN_PARTITION_TOKENS: usize = 256;
/// Calls estimated below this single-thread time run on the calling thread: waking pool
/// threads costs 40–60 µs on these machines, more than small calls compute.
const INLINE_NANOS: f64 = 15_000.0;
/// Rough single-thread rates for that estimate: f32 FMAs per ns and K/V bytes per ns.
const FMAS_PER_NANO: f64 = 25.0;
const BYTES_PER_NANO: f64 = 20.0;

/// A query tile and the key blocks `first_block..first_block + blocks` its queries attend to.
struct Tile {
    seq: usize,
    first_query: usize,
    queries: usize,
    first_block: usize,
    blocks: usize,
}

/// One unit of parallel work.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Item {
    pub seq: usize,
    pub heads: Heads,
    /// First query token of the tile, counted within the sequence's queries.
    pub first_query: usize,
    pub queries: usize,
    /// Key blocks `first_block..end_block` of the sequence.
    pub first_block: usize,
    pub end_block: usize,
    /// Partial-result slot when the tile is split into partitions.
    pub partial_slot: Option<usize>,
}

/// The partitions of one query tile, merged into its output rows after every item ran.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Group {
    pub seq: usize,
    pub heads: Heads,
    pub first_query: usize,
    pub queries: usize,
    pub first_slot: usize,
    pub parts: usize,
}

/// The KV heads `first..first + count` an item or group covers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub first: usize,
    pub count: usize,
}

pub(crate) struct Plan {
    pub items: Vec<Item>,
    pub groups: Vec<Group>,
    /// Output rows (query tokens × query heads) of the largest item.
    pub max_rows: usize,
    /// Whether the call is small enough to run on the calling thread.
    pub inline: bool,
}

impl Plan {
    pub fn new(
        problem: &Problem<'_>,
        block_size: usize,
        elem_bytes: usize,
        threads: usize,
    ) -> Plan {
        let group = problem.group_size();
        let tile_tokens = (TARGET_TILE_ROWS / group).max(1);
        let d = problem.head_dim;

        // First pass: the query tiles, their key blocks and the work they hold.
        let mut tiles = Vec::new();
        let (mut fmas, mut bytes) = (0f64, 0f64);
        for seq in 0..problem.num_seqs() {
            let (nq, context) = (problem.num_queries(seq), problem.context_len(seq));
            for first_query in (0..nq).step_by(tile_tokens) {
                let queries = tile_tokens.min(nq - first_query);
                let first_position = context - nq + first_query;
                let first_block = problem.window_start(first_position) / block_size;
                let end_block = (first_position + queries).div_ceil(block_size);
                let keys = first_position + queries - first_block * block_size;
                tiles.push(Tile {
                    seq,
                    first_query,
                    queries,
                    first_block,
                    blocks: end_block - first_block,
                });
                // In f64: an absurd call (huge group × context) must not overflow usize here.
                let (queries_f, keys_f, d_f) = (queries as f64, keys as f64, d as f64);
                fmas += 2.0 * queries_f * group as f64 * keys_f * d_f;
                bytes += 2.0 * keys_f * d_f * elem_bytes as f64;
            }
        }
        let kv_heads = problem.num_kv_heads;
        let estimate = kv_heads as f64 * (fmas / FMAS_PER_NANO).max(bytes / BYTES_PER_NANO);
        let inline = threads <= 1 || estimate < INLINE_NANOS;
        let min_blocks = MIN_PARTITION_TOKENS.div_ceil(block_size);
        // Items per tile and partitions per item, with small tiles' items covering every KV
        // head (see the module doc) or not.
        let layout = |merge_heads: bool| {
            let head_count = move |queries: usize| {
                if merge_heads && queries * group * kv_heads <= TARGET_TILE_ROWS {
                    kv_heads
                } else {
                    1
                }
            };
            let base_items: usize = tiles.iter().map(|t| kv_heads / head_count(t.queries)).sum();
            let wanted_parts = if inline {
                1
            } else {
                (ITEMS_PER_THREAD * threads).div_ceil(base_items.max(1))
            };
            let items: usize = tiles
                .iter()
                .map(|t| {
                    kv_heads / head_count(t.queries)
                        * wanted_parts.min(t.blocks / min_blocks).max(1)
                })
                .sum();
            (head_count, base_items, wanted_parts, items)
        };
        // Merged heads only when they still give every thread an item (a short context of one
        // sequence cannot be partitioned enough).
        let merged = layout(true);
        let (head_count, base_items, wanted_parts, _) = if inline || merged.3 >= threads {
            merged
        } else {
            layout(false)
        };
        let head_sets = |queries: usize| {
            let count = head_count(queries);
            (0..kv_heads / count).map(move |set| Heads {
                first: set * count,
                count,
            })
        };

        let mut items = Vec::with_capacity(base_items * wanted_parts);
        let mut groups = Vec::new();
        let mut next_slot = 0;
        let mut max_rows = 0;
        for tile in &tiles {
            let Tile {
                seq,
                first_query,
                queries,
                first_block: tile_block,
                blocks,
            } = *tile;
            let parts = wanted_parts.min(blocks / min_blocks).max(1);
            for heads in head_sets(queries) {
                max_rows = max_rows.max(queries * group * heads.count);
                if parts > 1 {
                    groups.push(Group {
                        seq,
                        heads,
                        first_query,
                        queries,
                        first_slot: next_slot,
                        parts,
                    });
                }
                for part in 0..parts {
                    let partial_slot = (parts > 1).then(|| next_slot + part);
                    let (first_block, end_block) = (
                        tile_block + blocks * part / parts,
                        tile_block + blocks * (part + 1) / parts,
                    );
                    items.push(Item {
                        seq,
                        heads,
                        first_query,
                        queries,
                        first_block,
                        end_block,
                        partial_slot,
                    });
                }
                if parts > 1 {
                    next_slot += parts;
                }
            }
        }
        Plan {
            items,
            groups,
            max_rows,
            inline,
        }
    }

    /// Number of partial-result slots the items write.
    pub fn partial_slots(&self) -> usize {
        self.groups.last().map_or(0, |g| g.first_slot + g.parts)
    }
}
