//! The block manager of one model: a block pool, the prefix cache, a block table per sequence, and
//! the driving of an optional lower tier ([`KvTier`], the protocol of [`crate::tier`]).
//!
//! Every public method either succeeds or returns an error having changed nothing: capacity is
//! checked (counting evictable prefix hits as used capacity) before any block moves. After every
//! call, for each block, its ref count equals the number of tables that hold it plus one if a load
//! whose sequence was freed still targets it (a *pending free*), and no table holds a block twice
//! (`check_invariants` verifies both plus the pool's own invariants). Construction bounds the sizes
//! so every block id fits the int32 block tables and every slot an i64.
//!
//! With a tier attached:
//! - a prefix lookup continues past the RAM hits through the blocks the tier holds; admitting such
//!   a match gives each of those blocks a fresh RAM block and a load, and the sequence is *loading*
//!   (it may not grow) until `poll_tier` reports all its loads ended. Every block under a load in
//!   flight is in `loads`, unhashed; it is registered in the prefix map only once Loaded;
//! - eviction offloads: `poll_tier` hands the eviction policy's next victims to the tier while
//!   fewer than the watermark blocks are clean, and an allocation that finds no clean block drops
//!   a cached one without offload rather than wait for the tier (see [`TierPolicy`]).

use rustc_hash::FxHashMap;

use crate::error::{ensure, Error, Result};
use crate::ids::{BlockId, CopyOp, SeqId, TokenId, MAX_NUM_BLOCKS};
use crate::memory::block_pool::BlockPool;
use crate::memory::block_table::{BlockTable, RELEASED};
use crate::memory::events::{KvEvent, Medium};
use crate::memory::eviction::EvictionPolicy;
use crate::memory::prefix_cache::{block_hashes, chain_hash, root_hash, BlockHash, BlockKey};
use crate::tier::{KvTier, LoadJob, LoadOutcome, TierCounters, TierLink};

/// The cached prefix found for a prompt: read-only, it reserves nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Chain root of the prompt (from its cache salt).
    pub root: BlockHash,
    /// Hashes of the prompt's leading full blocks that are cached, one per block in `blocks`.
    pub hashes: Vec<BlockHash>,
    /// The cached blocks, in order; a sliding-window group's match may open with [`RELEASED`]
    /// entries (blocks its next query will not read, which need not be cached:
    /// `crate::kv::coordinator`), admitted as released.
    pub blocks: Vec<BlockId>,
    /// Hashes of the full blocks right after `blocks` that the tier holds (to be loaded), when
    /// there are at least `TierPolicy::min_load_blocks` of them; else empty.
    pub tier_hashes: Vec<BlockHash>,
    /// Tokens the lookup covered (the whole prompt).
    pub num_queried_tokens: usize,
    /// Tokens per block of the table the match is for (the manager's default, or a carved
    /// group's: `crate::kv::spec`).
    pub block_size: usize,
    /// The KV cache group of that table (what its blocks' events name; 0 for the manager's own
    /// matches).
    pub group: u32,
}

impl PrefixMatch {
    /// Tokens the cached (RAM) blocks cover.
    pub fn num_cached_tokens(&self) -> usize {
        self.blocks.len() * self.block_size
    }

    /// Tokens the RAM hits and the tier hits cover together.
    pub fn num_hit_tokens(&self) -> usize {
        (self.blocks.len() + self.tier_hashes.len()) * self.block_size
    }
}

/// Fewest tier-hit blocks worth loading by default (`TierPolicy::min_load_blocks`): 1, since loading
/// won at every size measured. `python -m lab bench tiers` (SmolLM2-135M, float32 KV, page
/// cache warm, docs/tiers): the TTFT of a prompt whose N blocks are only on disk against the same
/// prompt recomputed is 29 vs 89 ms at N = 1 and 39 vs 847 ms at N = 16 (0.66 ms per loaded block
/// against 50 ms per recomputed one, plus ~29 ms of fixed cost: the step the loading sequence
/// waits). The crossover lies below one block; a model much cheaper per token than its KV is large
/// (the tiny test model: 32 KiB a block) could want more.
pub const DEFAULT_MIN_LOAD_BLOCKS: usize = 1;

/// How the manager uses an attached tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierPolicy {
    /// Fewest consecutive tier-hit blocks worth loading: a shorter run is recomputed instead (at
    /// least 1).
    pub min_load_blocks: usize,
    /// Clean blocks (counting those on their way back from the tier) `poll_tier` keeps ahead of
    /// need by offloading the eviction policy's next victims. An offloaded block is reusable only once the tier has copied it out, so blocks
    /// are offloaded ahead, while there is time; an allocation that still finds none clean drops a
    /// cached block without offload (counted) rather than stall the step on the tier's I/O.
    pub offload_watermark: usize,
}

impl Default for TierPolicy {
    fn default() -> Self {
        TierPolicy {
            min_load_blocks: DEFAULT_MIN_LOAD_BLOCKS,
            offload_watermark: 1,
        }
    }
}

/// A sequence whose loads have all ended (`poll_tier`): its table now covers `num_tokens` tokens,
/// the prefix up to the first block whose load was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadsEnded {
    pub seq: SeqId,
    pub num_tokens: usize,
}

/// A load in flight into one RAM block.
struct Load {
    /// The loading sequence, or `None` once it was freed (the block is released when the load ends).
    seq: Option<SeqId>,
    /// Position of the block in that sequence's table.
    index: usize,
    key: BlockKey,
    /// The KV cache group of that table.
    group: u32,
}

/// The loads of one loading sequence.
#[derive(Debug, Default, Clone, Copy)]
struct SeqLoads {
    in_flight: usize,
    /// Smallest table position whose load was dropped.
    first_dropped: Option<usize>,
}

/// Occupancy and activity figures of a block manager.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct BlockStats {
    pub num_blocks: usize,
    pub free_blocks: usize,
    pub cached_blocks: usize,
    pub used_blocks: usize,
    /// `used_blocks / num_blocks`.
    pub usage: f64,
    /// Prompt tokens looked up in the prefix cache at admission.
    pub prefix_queried_tokens: u64,
    /// Of those, tokens found cached.
    pub prefix_hit_tokens: u64,
    pub allocations: u64,
    /// Cached blocks dropped (not offloaded) to satisfy an allocation.
    pub evictions: u64,
    pub cow_copies: u64,
    /// Blocks sliding windows released from their sequences (`BlockManager::release_before`).
    pub window_released_blocks: u64,
    /// Blocks handed to the tier and not yet returned to the free list.
    pub offloading_blocks: usize,
    /// RAM blocks under a load in flight.
    pub loading_blocks: usize,
    /// Loads issued: one per tier-hit block an admission found.
    pub loads_issued: u64,
    /// Loads that ended `Dropped` (their tokens recomputed).
    pub loads_dropped: u64,
    pub offloads_issued: u64,
    /// Evictions since a tier was attached: cached blocks dropped because none was clean.
    pub evictions_without_offload: u64,
}

/// Block pool + prefix cache + block tables.
pub struct BlockManager {
    pool: BlockPool,
    /// Keyed by small sequential ids: a multiplicative hash beats SipHash on the per-step path.
    tables: FxHashMap<SeqId, BlockTable>,
    block_size: usize,
    enable_prefix_caching: bool,
    prefix_queried_tokens: u64,
    prefix_hit_tokens: u64,
    cow_copies: u64,
    /// Blocks released by sliding windows (`release_before`).
    window_released: u64,
    tier: Option<Box<dyn KvTier>>,
    tier_policy: TierPolicy,
    /// Loads in flight, by target block.
    loads: FxHashMap<BlockId, Load>,
    /// Loading sequences (those with a load in flight).
    seq_loads: FxHashMap<SeqId, SeqLoads>,
    emit_kv_events: bool,
    loads_issued: u64,
    loads_dropped: u64,
    evictions_at_attach: u64,
}

/// Tokens per block when a configuration does not say. Measured on Gemma 3's hybrid layout
/// (`python -m lab bench kv-groups`, the conversation trace's lengths x 4): slots held but not
/// read are 0.25% of those read in the full group and 2.9% in the sliding groups at 16 tokens
/// (8: 0.12% / 1.3%; 32: 0.53% / 5.9%; 64: 1.1% / 12%), the tables twice as wide at 8 as at 16,
/// and the attention kernel's paged/contiguous ratio flat from 16 to 128 (`bench attention`):
/// 16 for pages, the sliding groups carving theirs into blocks of 8
/// (`crate::kv::spec::default_sliding_block_size`).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

impl BlockManager {
    /// A manager of `num_blocks` blocks of `block_size` tokens each, evicting least recently used
    /// cached blocks first. Fails with
    /// `InvalidArgument` unless both are positive, `num_blocks <= MAX_NUM_BLOCKS`, and every slot
    /// (`num_blocks * block_size`) fits an i64; with `OutOfMemory` if the pool cannot be allocated.
    pub fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> Result<Self> {
        Self::with_eviction_policy(
            num_blocks,
            block_size,
            enable_prefix_caching,
            EvictionPolicy::Lru,
        )
    }

    /// `new` with the cached blocks evicted under `policy`.
    pub fn with_eviction_policy(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        policy: EvictionPolicy,
    ) -> Result<Self> {
        ensure(num_blocks > 0, || "num_blocks must be positive".into())?;
        ensure(num_blocks <= MAX_NUM_BLOCKS, || {
            format!("num_blocks {num_blocks} exceeds {MAX_NUM_BLOCKS}: block tables hold int32 ids")
        })?;
        ensure(block_size > 0, || "block_size must be positive".into())?;
        ensure(
            num_blocks
                .checked_mul(block_size)
                .is_some_and(|slots| slots <= i64::MAX as usize),
            || format!("{num_blocks} blocks x {block_size} tokens overflow int64 slot numbers"),
        )?;
        Ok(BlockManager {
            pool: BlockPool::with_policy(num_blocks, policy)?,
            tables: FxHashMap::default(),
            block_size,
            enable_prefix_caching,
            prefix_queried_tokens: 0,
            prefix_hit_tokens: 0,
            cow_copies: 0,
            window_released: 0,
            tier: None,
            tier_policy: TierPolicy::default(),
            loads: FxHashMap::default(),
            seq_loads: FxHashMap::default(),
            emit_kv_events: false,
            loads_issued: 0,
            loads_dropped: 0,
            evictions_at_attach: 0,
        })
    }

    /// What a tier needs of this manager's pool (its shared free list and returned count): build
    /// the tier from it, then `attach_tier`.
    pub fn tier_link(&self) -> TierLink {
        self.pool.tier_link()
    }

    /// Drives `tier` from now on: offload on eviction, load on a prefix hit. Fails, changing
    /// nothing, with `InvalidArgument` if a tier is attached already or the manager holds a
    /// sequence or a cached block (their blocks' tokens were not kept for offload jobs), or
    /// `OutOfMemory`.
    pub fn attach_tier(&mut self, tier: Box<dyn KvTier>) -> Result<()> {
        ensure(self.tier.is_none(), || "a tier is attached already".into())?;
        self.ensure_pristine("attach a tier")?;
        self.pool.keep_content(self.block_size)?;
        self.evictions_at_attach = self.pool.counters().evictions;
        self.tier = Some(tier);
        Ok(())
    }

    /// Sets how an attached tier is used; `InvalidArgument` unless `min_load_blocks >= 1` and
    /// `offload_watermark <= num_blocks`.
    pub fn set_tier_policy(&mut self, policy: TierPolicy) -> Result<()> {
        ensure(policy.min_load_blocks >= 1, || {
            "min_load_blocks must be at least 1".into()
        })?;
        ensure(policy.offload_watermark <= self.num_blocks(), || {
            format!(
                "offload_watermark {} exceeds the {} blocks",
                policy.offload_watermark,
                self.num_blocks()
            )
        })?;
        self.tier_policy = policy;
        Ok(())
    }

    /// Gives the tier up (drop it to close it), once no load is in flight: callers `flush_tier`
    /// and `poll_tier` first. None without a tier, or while a load's RAM block is the tier's. Cached
    /// blocks stay cached in RAM; evictions drop them from now on.
    pub fn detach_tier(&mut self) -> Option<Box<dyn KvTier>> {
        if self.loads.is_empty() {
            self.tier.take()
        } else {
            None
        }
    }

    /// Whether a tier is attached.
    pub fn has_tier(&self) -> bool {
        self.tier.is_some()
    }

    /// Records KV events from now on (`take_kv_events`). `InvalidArgument` unless nothing is
    /// cached or held yet: a replay of the events starts from an empty set.
    pub fn record_kv_events(&mut self) -> Result<()> {
        self.ensure_pristine("record KV events")?;
        self.pool.record_events();
        self.emit_kv_events = true;
        Ok(())
    }

    fn ensure_pristine(&self, what: &str) -> Result<()> {
        ensure(
            self.tables.is_empty() && self.pool.cached_hashes().next().is_none(),
            || format!("{what} before any sequence or cached block"),
        )
    }

    /// The KV events since the last call: the pool's (`Ram`), then the tier's (`Disk`). Empty
    /// unless `record_kv_events` was called.
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        let mut out = Vec::new();
        self.pool.take_events(&mut out);
        if let (true, Some(tier)) = (self.emit_kv_events, self.tier.as_mut()) {
            tier.drain_events(&mut out);
        }
        out
    }

    /// The blocks findable now, with their KV cache group: every hash of the RAM prefix map,
    /// then the tier's committed ones. Replaying every event
    /// `take_kv_events` returned gives this set.
    pub fn kv_blocks(&self) -> Vec<(BlockHash, Medium, u32)> {
        let ram = self.pool.cached_blocks();
        let mut out: Vec<_> = ram.map(|(h, g)| (h, Medium::Ram, g)).collect();
        if let Some(tier) = &self.tier {
            let disk = tier.stored_blocks().into_iter();
            out.extend(disk.map(|(h, g)| (h, Medium::Disk, g)));
        }
        out
    }

    /// The RAM block registered for the prefix ending in `hash`, if any.
    pub fn cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.pool.lookup(hash)
    }

    /// Whether the attached tier holds (or is storing) the block of prefix hash `hash` (a hint,
    /// as `KvTier::contains`); false without a tier.
    pub fn tier_holds(&self, hash: BlockHash) -> bool {
        self.tier.as_ref().is_some_and(|tier| tier.contains(hash))
    }

    /// How an attached tier is used.
    pub fn tier_policy(&self) -> TierPolicy {
        self.tier_policy
    }

    /// The tier's own counters (zero without a tier).
    pub fn tier_counters(&self) -> TierCounters {
        self.tier.as_ref().map(|t| t.counters()).unwrap_or_default()
    }

    /// Blocks until the tier has finished every queued job (its loads are then reported by the
    /// next `poll_tier`). Without a tier, nothing.
    pub fn flush_tier(&mut self) {
        if let Some(tier) = &mut self.tier {
            tier.flush();
        }
    }

    /// Whether `seq` is loading (a load of it is in flight).
    pub fn is_loading(&self, seq: SeqId) -> bool {
        self.seq_loads.contains_key(&seq)
    }

    /// Takes the tier's finished loads: registers each Loaded block in the prefix map, releases the
    /// blocks of freed sequences, and returns the sequences whose loads have all ended (a table
    /// whose load was dropped is cut back to the blocks before it, the rest released). Then
    /// offloads cached blocks up to the watermark. Without a tier, nothing.
    pub fn poll_tier(&mut self) -> Vec<LoadsEnded> {
        let Some(tier) = self.tier.as_mut() else {
            return Vec::new();
        };
        let done = tier.completed_loads();
        if !self.emit_kv_events {
            // Nobody takes the tier's events: drop them so they do not pile up.
            tier.drain_events(&mut Vec::new());
        }
        let mut ended = Vec::new();
        for d in done {
            let Some(load) = self.loads.remove(&d.block) else {
                debug_assert!(
                    false,
                    "the tier finished a load of block {} it was not given",
                    d.block
                );
                continue;
            };
            match d.outcome {
                LoadOutcome::Loaded => {
                    let key = &load.key;
                    (self.pool).register(d.block, key.hash, key.parent, &key.tokens, load.group);
                }
                LoadOutcome::Dropped => self.loads_dropped += 1,
            }
            let Some(seq) = load.seq else {
                self.pool.release(d.block); // a pending free
                continue;
            };
            let state = self.seq_loads.get_mut(&seq).expect("a loading sequence");
            state.in_flight -= 1;
            if d.outcome == LoadOutcome::Dropped {
                state.first_dropped = Some(
                    state
                        .first_dropped
                        .map_or(load.index, |i| i.min(load.index)),
                );
            }
            if state.in_flight == 0 {
                let state = self.seq_loads.remove(&seq).expect("checked");
                let table = self
                    .tables
                    .get_mut(&seq)
                    .expect("a loading sequence has a table");
                if let Some(cut) = state.first_dropped {
                    // Loads follow the released entries (a window's) and the RAM hits.
                    debug_assert!(cut >= table.released, "a load into a released entry");
                    for &block in table.blocks[cut..].iter().rev() {
                        self.pool.release(block);
                    }
                    table.blocks.truncate(cut);
                    table.hashes.truncate(cut);
                    table.tokens.truncate(cut * table.block_size);
                }
                ended.push(LoadsEnded {
                    seq,
                    num_tokens: table.num_tokens(),
                });
            }
        }
        self.offload_to_watermark();
        ended
    }

    /// Offloads the eviction policy's next victims while fewer than the watermark blocks are clean
    /// or on their way back from the tier.
    fn offload_to_watermark(&mut self) {
        let Some(tier) = self.tier.as_mut() else {
            return;
        };
        while self.pool.num_clean() + self.pool.num_offloading()
            < self.tier_policy.offload_watermark
        {
            match self.pool.start_offload() {
                Some(job) => tier.offload(job),
                None => break,
            }
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    /// Blocks an allocation could obtain now (clean + evictable cached).
    pub fn num_available_blocks(&self) -> usize {
        self.pool.num_available()
    }

    /// Whether prefix caching is on.
    pub fn prefix_caching_enabled(&self) -> bool {
        self.enable_prefix_caching
    }

    /// Number of live sequences.
    pub fn num_sequences(&self) -> usize {
        self.tables.len()
    }

    /// Whether `seq` is live.
    pub fn contains(&self, seq: SeqId) -> bool {
        self.tables.contains_key(&seq)
    }

    /// The longest cached prefix of `prompt` in whole blocks, always leaving at least the last
    /// token uncached so the model has logits to sample from: the RAM hits, then the blocks after
    /// them the tier holds (`tier_hashes`). Changes nothing.
    pub fn match_prefix(&self, prompt: &[TokenId], salt: Option<&[u8]>) -> PrefixMatch {
        let root = root_hash(salt);
        if !self.enable_prefix_caching || prompt.is_empty() {
            return PrefixMatch {
                root,
                num_queried_tokens: prompt.len(),
                block_size: self.block_size,
                ..Default::default()
            };
        }
        let cacheable = &prompt[..(prompt.len() - 1) / self.block_size * self.block_size];
        self.match_prefix_hashes(
            root,
            &block_hashes(root, cacheable, self.block_size),
            prompt.len(),
        )
    }

    /// `match_prefix` for a prompt of `num_tokens` tokens whose leading full-block hashes (chained
    /// from `root`) the caller already has, so a prompt retried at every step is hashed once.
    /// Only the hashes of blocks before the last token are used. Changes nothing.
    pub fn match_prefix_hashes(
        &self,
        root: BlockHash,
        hashes: &[BlockHash],
        num_tokens: usize,
    ) -> PrefixMatch {
        let mut found = PrefixMatch {
            root,
            num_queried_tokens: num_tokens,
            block_size: self.block_size,
            ..Default::default()
        };
        if !self.enable_prefix_caching || num_tokens == 0 {
            return found;
        }
        let cacheable_blocks = (num_tokens - 1) / self.block_size;
        let cacheable = &hashes[..cacheable_blocks.min(hashes.len())];
        for &hash in cacheable {
            match self.pool.lookup(hash) {
                Some(block) => {
                    found.hashes.push(hash);
                    found.blocks.push(block);
                }
                None => break,
            }
        }
        if let Some(tier) = &self.tier {
            let rest = &cacheable[found.blocks.len()..];
            let run = rest.iter().take_while(|&&h| tier.contains(h)).count();
            if run >= self.tier_policy.min_load_blocks {
                found.tier_hashes = rest[..run].to_vec();
            }
        }
        found
    }

    /// Available blocks that admitting `num_tokens` tokens over `found` would use up: new blocks
    /// (the tier hits' among them) plus cached hits that must be revived from the evictable set.
    pub fn blocks_to_admit(&self, found: &PrefixMatch, num_tokens: usize) -> usize {
        let revived = found
            .blocks
            .iter()
            .filter(|&&b| b != RELEASED && self.pool.is_evictable(b))
            .count();
        num_tokens
            .div_ceil(found.block_size.max(1))
            .saturating_sub(found.blocks.len())
            + revived
    }

    /// Whether `allocate` of `prompt` would succeed now (counting evictable prefix hits as used
    /// capacity). Changes nothing.
    pub fn can_allocate(&self, prompt: &[TokenId], salt: Option<&[u8]>) -> bool {
        let found = self.match_prefix(prompt, salt);
        !prompt.is_empty()
            && self.blocks_to_admit(&found, prompt.len()) <= self.num_available_blocks()
    }

    /// Creates sequence `seq` holding `tokens` (the prompt, or its first chunk), reusing the
    /// blocks of `found`, which must come from `match_prefix` on this state with `tokens` as a
    /// prefix of the looked-up prompt. Returns the number of tokens served from the (RAM) cache.
    ///
    /// With tier hits in `found`, `tokens` must be exactly the hit tokens: each tier hit gets a new
    /// block and a load, and `seq` is loading (nothing may be appended) until `poll_tier` reports
    /// its loads ended.
    pub fn admit(&mut self, seq: SeqId, tokens: &[TokenId], found: PrefixMatch) -> Result<usize> {
        self.admit_tables(&[seq], tokens, vec![found])
    }

    /// `admit` of one sequence's tables in several KV cache groups at once (`crate::kv::coordinator`):
    /// table `seqs[g]` holds `tokens` over `found[g]`, all or none. Without tier hits every match
    /// must serve the same number of cached tokens; with some, every match must cover exactly
    /// `tokens` with its RAM and tier hits, and each table with tier hits is loading. Capacity is
    /// checked for all together, and every table's hits are retained before any block is
    /// allocated, so no allocation evicts another table's hit. Returns the tokens every table
    /// serves from RAM; the prefix figures count them once.
    pub fn admit_tables(
        &mut self,
        seqs: &[SeqId],
        tokens: &[TokenId],
        found: Vec<PrefixMatch>,
    ) -> Result<usize> {
        ensure(!seqs.is_empty() && seqs.len() == found.len(), || {
            format!("{} tables but {} prefix matches", seqs.len(), found.len())
        })?;
        let cached = found.iter().map(PrefixMatch::num_cached_tokens).min();
        let cached = cached.expect("a table");
        for (index, &seq) in seqs.iter().enumerate() {
            if self.tables.contains_key(&seq) || seqs[..index].contains(&seq) {
                return Err(Error::DuplicateSequence(seq.to_string()));
            }
        }
        ensure(
            found
                .iter()
                .all(|f| (1..=self.block_size).contains(&f.block_size)),
            || {
                format!(
                    "a table's blocks hold 1 to {} tokens (its pages' share)",
                    self.block_size
                )
            },
        )?;
        let tier_hits = found.iter().any(|f| !f.tier_hashes.is_empty());
        if !tier_hits {
            ensure(
                found.iter().all(|f| f.num_cached_tokens() == cached),
                || "the tables' prefix matches differ in cached tokens".into(),
            )?;
            ensure(tokens.len() > cached, || {
                format!(
                    "{} tokens do not extend the {cached} cached ones",
                    tokens.len()
                )
            })?;
        } else {
            ensure(
                self.tier.is_some() && found.iter().all(|f| f.num_hit_tokens() == tokens.len()),
                || {
                    format!(
                        "a match with tier hits admits exactly its hit tokens in every table \
                         (with a tier), not {}",
                        tokens.len()
                    )
                },
            )?;
        }
        let stale = found.iter().any(|f| {
            let released = f.blocks.iter().take_while(|&&b| b == RELEASED).count();
            f.blocks.len() != f.hashes.len()
                || f.blocks[released..]
                    .iter()
                    .zip(&f.hashes[released..])
                    .any(|(&b, &h)| self.pool.hash_of(b) != Some(h))
        });
        ensure(!stale, || {
            "prefix match is stale: the cache changed since match_prefix".into()
        })?;
        let needed = found
            .iter()
            .map(|f| self.blocks_to_admit(f, tokens.len()))
            .sum();
        self.ensure_available(needed)?;

        for f in &found {
            for &block in f.blocks.iter().filter(|&&b| b != RELEASED) {
                self.pool.retain_hit(block);
            }
        }
        let num_queried = found[0].num_queried_tokens;
        for (&seq, found) in seqs.iter().zip(found) {
            self.admit_table(seq, tokens, found);
        }
        self.prefix_queried_tokens += num_queried as u64;
        self.prefix_hit_tokens += cached as u64;
        Ok(cached)
    }

    /// Builds the table of `seq` over `found`, whose hits are retained (`admit_tables` checked all).
    fn admit_table(&mut self, seq: SeqId, tokens: &[TokenId], found: PrefixMatch) {
        let bs = found.block_size;
        let cached = found.num_cached_tokens();
        let released = found.blocks.iter().take_while(|&&b| b == RELEASED).count();
        let mut table = BlockTable {
            blocks: found.blocks,
            tokens: tokens[..cached].to_vec(),
            hashes: found.hashes,
            root: found.root,
            block_size: bs,
            group: found.group,
            released,
        };
        if found.tier_hashes.is_empty() {
            grow(
                &mut self.pool,
                self.enable_prefix_caching,
                &mut table,
                &tokens[cached..],
            );
        } else {
            let tier = self.tier.as_mut().expect("checked above");
            for (&hash, block_tokens) in found
                .tier_hashes
                .iter()
                .zip(tokens[cached..].chunks_exact(bs))
            {
                let block = self.pool.allocate().expect("capacity checked");
                let key = BlockKey {
                    hash,
                    parent: table.hashes.last().copied().unwrap_or(table.root),
                    tokens: block_tokens.into(),
                };
                tier.load(LoadJob {
                    block,
                    key: key.clone(),
                    group: table.group,
                });
                self.loads.insert(
                    block,
                    Load {
                        seq: Some(seq),
                        index: table.blocks.len(),
                        key,
                        group: table.group,
                    },
                );
                table.blocks.push(block);
                table.hashes.push(hash);
                table.tokens.extend_from_slice(block_tokens);
            }
            self.loads_issued += found.tier_hashes.len() as u64;
            self.seq_loads.insert(
                seq,
                SeqLoads {
                    in_flight: found.tier_hashes.len(),
                    first_dropped: None,
                },
            );
        }
        self.tables.insert(seq, table);
    }

    /// `match_prefix` then `admit` of the whole prompt: creates `seq` holding all of `prompt`, its
    /// tier hits (if any) recomputed rather than loaded. Returns the number of prompt tokens served
    /// from the cache.
    pub fn allocate(
        &mut self,
        seq: SeqId,
        prompt: &[TokenId],
        salt: Option<&[u8]>,
    ) -> Result<usize> {
        ensure(!prompt.is_empty(), || {
            "a sequence needs at least one token".into()
        })?;
        let mut found = self.match_prefix(prompt, salt);
        found.tier_hashes.clear();
        self.admit(seq, prompt, found)
    }

    /// Gives `tokens` slots at the end of `seq`, allocating blocks as the tail fills. If the tail
    /// block is shared (after a fork), it is first copied to a private block and the copy is returned.
    /// Fails with `InvalidArgument` for a loading sequence.
    pub fn append(&mut self, seq: SeqId, tokens: &[TokenId]) -> Result<Option<CopyOp>> {
        let table = self
            .tables
            .get(&seq)
            .ok_or_else(|| Error::UnknownSequence(seq.to_string()))?;
        self.ensure_not_loading(seq)?;
        if tokens.is_empty() {
            return Ok(None);
        }
        self.ensure_available(self.blocks_to_append(table, tokens.len()))?;
        let shared_tail = table.partial_tail().filter(|&b| self.pool.ref_count(b) > 1);
        let table = self.tables.get_mut(&seq).expect("checked above");
        let copy = shared_tail.map(|src| {
            let dst = self.pool.allocate().expect("capacity checked");
            self.pool.release(src);
            *table.blocks.last_mut().expect("a tail exists") = dst;
            self.cow_copies += 1;
            CopyOp { src, dst }
        });
        grow(&mut self.pool, self.enable_prefix_caching, table, tokens);
        Ok(copy)
    }

    /// Available blocks that appending `extra` tokens to `seq` would use up: new blocks, plus a
    /// copy of its tail if shared. `UnknownSequence` for a sequence without a table.
    pub fn blocks_needed_to_append(&self, seq: SeqId, extra: usize) -> Result<usize> {
        let table = self
            .tables
            .get(&seq)
            .ok_or_else(|| Error::UnknownSequence(seq.to_string()))?;
        Ok(self.blocks_to_append(table, extra))
    }

    fn blocks_to_append(&self, table: &BlockTable, extra: usize) -> usize {
        if extra == 0 {
            return 0;
        }
        let shared_tail = table
            .partial_tail()
            .is_some_and(|b| self.pool.ref_count(b) > 1);
        table.blocks_to_grow(extra) + usize::from(shared_tail)
    }

    /// Makes `child` share every block of `parent`, the partial tail included. Fails with
    /// `InvalidArgument` for a loading `parent`.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        if self.tables.contains_key(&child) {
            return Err(Error::DuplicateSequence(child.to_string()));
        }
        self.ensure_not_loading(parent)?;
        let table = self
            .tables
            .get(&parent)
            .ok_or_else(|| Error::UnknownSequence(parent.to_string()))?
            .clone();
        for &block in table.held() {
            self.pool.retain(block);
        }
        self.tables.insert(child, table);
        Ok(())
    }

    /// Releases the blocks of `seq` wholly before token position `first_needed`: what a sliding
    /// window no query of `seq` will read again. Each goes back to the pool (to the prefix cache if
    /// hashed, where a later prompt may still hit it; else free); its entry becomes
    /// [`RELEASED`]. Returns how many were released. Fails with `UnknownSequence`, or
    /// `InvalidArgument` for a loading sequence.
    pub fn release_before(&mut self, seq: SeqId, first_needed: usize) -> Result<usize> {
        self.ensure_not_loading(seq)?;
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or_else(|| Error::UnknownSequence(seq.to_string()))?;
        let gone = table.release_before(first_needed);
        for &block in gone.iter().rev() {
            self.pool.release(block);
        }
        self.window_released += gone.len() as u64;
        Ok(gone.len())
    }

    /// The sequences with a table, in no particular order.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.tables.keys().copied()
    }

    /// Drops `seq`, releasing its blocks tail first so its prefix outlives its tail in the cache.
    /// A block under a load in flight is released only when its load ends (the tier writes it).
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let table = self
            .tables
            .remove(&seq)
            .ok_or_else(|| Error::UnknownSequence(seq.to_string()))?;
        let loading = self.seq_loads.remove(&seq).is_some();
        for &block in table.held().iter().rev() {
            match self.loads.get_mut(&block) {
                Some(load) if loading => load.seq = None,
                _ => self.pool.release(block),
            }
        }
        Ok(())
    }

    /// Cuts `seq`'s table back to its first `num_tokens` tokens (a multiple of its block size, at
    /// most what it holds), releasing the blocks after them: what a sequence of several tables
    /// whose loads ended unequally keeps (`crate::kv::coordinator`). Returns how many it released.
    /// Fails with `UnknownSequence`, or `InvalidArgument` for a loading sequence or a cut inside a
    /// block or past the end, changing nothing.
    pub fn truncate(&mut self, seq: SeqId, num_tokens: usize) -> Result<usize> {
        self.ensure_not_loading(seq)?;
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or_else(|| Error::UnknownSequence(seq.to_string()))?;
        ensure(
            num_tokens <= table.tokens.len() && num_tokens.is_multiple_of(table.block_size),
            || {
                format!(
                    "sequence {seq}: cannot cut {} tokens in blocks of {} back to {num_tokens}",
                    table.tokens.len(),
                    table.block_size
                )
            },
        )?;
        let keep = num_tokens / table.block_size;
        let gone: Vec<BlockId> = table.blocks[keep.max(table.released)..].to_vec();
        table.blocks.truncate(keep);
        table.hashes.truncate(keep);
        table.tokens.truncate(num_tokens);
        table.released = table.released.min(keep);
        for &block in gone.iter().rev() {
            self.pool.release(block);
        }
        Ok(gone.len())
    }

    fn ensure_not_loading(&self, seq: SeqId) -> Result<()> {
        ensure(!self.is_loading(seq), || {
            format!("sequence {seq} is loading from the tier")
        })
    }

    /// The block table of `seq`.
    pub fn table(&self, seq: SeqId) -> Result<&BlockTable> {
        self.tables
            .get(&seq)
            .ok_or_else(|| Error::UnknownSequence(seq.to_string()))
    }

    /// The cache slots of the last `num_new_tokens[i]` tokens of each `seqs[i]`, concatenated:
    /// the slot mapping of one step. Fails (`Shape` for unequal lengths, `UnknownSequence`,
    /// `InvalidArgument` for a count above a sequence's tokens) before producing anything.
    pub fn slot_mapping(&self, seqs: &[SeqId], num_new_tokens: &[usize]) -> Result<Vec<i64>> {
        if seqs.len() != num_new_tokens.len() {
            return Err(Error::Shape(format!(
                "{} seq_ids but {} num_new_tokens",
                seqs.len(),
                num_new_tokens.len()
            )));
        }
        let mut ranges = Vec::with_capacity(seqs.len());
        for (&seq, &count) in seqs.iter().zip(num_new_tokens) {
            let table = self.table(seq)?;
            let end = table.num_tokens();
            let start = end.checked_sub(count).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "sequence {seq} has {end} tokens, fewer than {count}"
                ))
            })?;
            if count > 0 && start < table.num_released() * table.block_size {
                return Err(Error::InvalidArgument(format!(
                    "sequence {seq}: tokens {start}..{end} reach into blocks its window released"
                )));
            }
            ranges.push((table, start, end));
        }
        let mut out = Vec::with_capacity(num_new_tokens.iter().sum());
        for (table, start, end) in ranges {
            table.extend_slots(start, end, &mut out);
        }
        Ok(out)
    }

    /// Writes the block tables of `seqs` as rows of a `[seqs.len(), width]` matrix into `out`,
    /// padded with -1; `width` is the longest table (or `min_width` if larger). Returns `width`.
    pub fn batch_block_tables(
        &self,
        seqs: &[SeqId],
        min_width: usize,
        out: &mut Vec<i32>,
    ) -> Result<usize> {
        let tables = seqs
            .iter()
            .map(|&s| self.table(s))
            .collect::<Result<Vec<_>>>()?;
        let width = tables
            .iter()
            .map(|t| t.blocks.len())
            .max()
            .unwrap_or(0)
            .max(min_width);
        out.clear();
        out.resize(seqs.len() * width, -1);
        for (row, table) in out.chunks_exact_mut(width.max(1)).zip(&tables) {
            for (cell, entry) in row.iter_mut().zip(table.entries()) {
                *cell = entry;
            }
        }
        Ok(width)
    }

    /// Occupancy and activity figures.
    pub fn stats(&self) -> BlockStats {
        let counters = self.pool.counters();
        BlockStats {
            num_blocks: self.pool.num_blocks(),
            free_blocks: self.pool.num_clean(),
            cached_blocks: self.pool.num_cached(),
            used_blocks: self.pool.num_in_use(),
            usage: self.pool.num_in_use() as f64 / self.pool.num_blocks() as f64,
            prefix_queried_tokens: self.prefix_queried_tokens,
            prefix_hit_tokens: self.prefix_hit_tokens,
            allocations: counters.allocations,
            evictions: counters.evictions,
            cow_copies: self.cow_copies,
            window_released_blocks: self.window_released,
            offloading_blocks: self.pool.num_offloading(),
            loading_blocks: self.loads.len(),
            loads_issued: self.loads_issued,
            loads_dropped: self.loads_dropped,
            offloads_issued: counters.offloads,
            evictions_without_offload: if self.tier.is_some() {
                counters.evictions - self.evictions_at_attach
            } else {
                0
            },
        }
    }

    /// With the tier flushed (`flush_tier`) and nothing else pushing: checks that the pool's free
    /// list holds exactly its clean blocks (see `BlockPool::check_free_list`).
    pub fn check_free_list(&mut self) -> std::result::Result<(), String> {
        self.pool.check_free_list()
    }

    /// Verifies every invariant of this module and of the pool; `Err` names the first broken one.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.pool.check_invariants()?;
        let mut holders = vec![0u32; self.pool.num_blocks()];
        let mut in_flight: FxHashMap<SeqId, usize> = FxHashMap::default();
        for (&block, load) in &self.loads {
            if self.pool.hash_of(block).is_some() {
                return Err(format!("block {block} is registered while loading"));
            }
            match load.seq {
                None => holders[block as usize] += 1,
                Some(seq) => {
                    let held = self.tables.get(&seq).and_then(|t| t.blocks.get(load.index));
                    if held != Some(&block) || !self.seq_loads.contains_key(&seq) {
                        return Err(format!(
                            "load into block {block} names a table that does not hold it"
                        ));
                    }
                    *in_flight.entry(seq).or_default() += 1;
                }
            }
        }
        for (seq, state) in &self.seq_loads {
            if in_flight.get(seq) != Some(&state.in_flight) {
                return Err(format!(
                    "sequence {seq}: {} loads counted, {:?} in flight",
                    state.in_flight,
                    in_flight.get(seq)
                ));
            }
        }
        for (seq, table) in &self.tables {
            let mut seen = std::collections::HashSet::new();
            if table.blocks[..table.released.min(table.blocks.len())]
                .iter()
                .any(|&b| b != RELEASED)
                || table.released > table.blocks.len()
            {
                return Err(format!("sequence {seq}: a released entry holds a block"));
            }
            for &block in table.held() {
                if !seen.insert(block) {
                    return Err(format!("sequence {seq} holds block {block} twice"));
                }
                holders[block as usize] += 1;
            }
            let bs = table.block_size;
            if !(1..=self.block_size).contains(&bs)
                || table.blocks.len() != table.tokens.len().div_ceil(bs)
                || table.hashes.len() != table.tokens.len() / bs
            {
                return Err(format!(
                    "sequence {seq}: table shape does not match its tokens"
                ));
            }
        }
        for (block, &count) in holders.iter().enumerate() {
            if count != self.pool.ref_count(block as BlockId) {
                return Err(format!(
                    "block {block}: ref count {} but held by {count} tables",
                    self.pool.ref_count(block as BlockId)
                ));
            }
        }
        Ok(())
    }

    fn ensure_available(&self, needed: usize) -> Result<()> {
        let available = self.pool.num_available();
        if needed > available {
            return Err(Error::OutOfBlocks { needed, available });
        }
        Ok(())
    }
}

/// Appends `tokens` to `table`, hashing each block as it fills (and registering it in the prefix
/// cache when caching is on) and taking new blocks from `pool` as needed. The caller has checked
/// capacity.
fn grow(
    pool: &mut BlockPool,
    enable_prefix_caching: bool,
    table: &mut BlockTable,
    tokens: &[TokenId],
) {
    let bs = table.block_size;
    for chunk in split_at_block_boundaries(table.tokens.len(), tokens, bs) {
        if table.tokens.len().is_multiple_of(bs) {
            table
                .blocks
                .push(pool.allocate().expect("capacity checked"));
        }
        table.tokens.extend_from_slice(chunk);
        if table.tokens.len().is_multiple_of(bs) {
            let full = table.hashes.len();
            let parent = table.hashes.last().copied().unwrap_or(table.root);
            let hash = chain_hash(parent, &table.tokens[full * bs..]);
            table.hashes.push(hash);
            if enable_prefix_caching {
                let tokens = &table.tokens[full * bs..];
                pool.register(table.blocks[full], hash, parent, tokens, table.group);
            }
        }
    }
}

/// Splits `tokens`, to be appended after `filled` tokens, into pieces that each end at a block
/// boundary (the last piece may end inside a block).
fn split_at_block_boundaries(
    filled: usize,
    tokens: &[TokenId],
    block_size: usize,
) -> impl Iterator<Item = &[TokenId]> {
    let first = (block_size - filled % block_size).min(tokens.len());
    let (head, rest) = tokens.split_at(first);
    std::iter::once(head)
        .filter(|h| !h.is_empty())
        .chain(rest.chunks(block_size))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manager(num_blocks: usize) -> BlockManager {
        BlockManager::new(num_blocks, 4, true).unwrap()
    }

    /// A system prompt hit once, then one-off prompts that need all memory but one block pair:
    /// under SLRU the hit prompt survives, under LRU it is the oldest and goes first.
    #[test]
    fn slru_keeps_a_hit_prefix_that_lru_evicts() {
        for (policy, survives) in [(EvictionPolicy::Lru, false), (EvictionPolicy::Slru, true)] {
            let mut m = BlockManager::with_eviction_policy(12, 4, true, policy).unwrap();
            let system: Vec<u32> = (0..9).collect(); // 2 full blocks + 1
            m.allocate(1, &system, None).unwrap();
            m.free(1).unwrap();
            assert_eq!(m.allocate(2, &system, None).unwrap(), 8);
            m.free(2).unwrap();
            for (seq, base) in (3..6).zip([100u32, 200, 300]) {
                let one_off: Vec<u32> = (base..base + 9).collect();
                assert_eq!(m.allocate(seq, &one_off, None).unwrap(), 0);
                m.free(seq).unwrap();
                m.check_invariants().unwrap();
            }
            let big: Vec<u32> = (1000..1036).collect(); // 9 blocks: every block but the system's 2
            m.allocate(9, &big, None).unwrap();
            m.check_invariants().unwrap();
            assert_eq!(
                m.match_prefix(&system, None).blocks.len() == 2,
                survives,
                "{policy:?}"
            );
        }
    }

    #[test]
    fn a_window_releases_leading_blocks_to_the_cache_and_never_the_ones_it_reads() {
        let mut m = manager(16); // blocks of 4 tokens
        let tokens: Vec<u32> = (0..18).collect(); // 4 full blocks + 2 tokens
        m.allocate(1, &tokens, None).unwrap();
        let held = m.table(1).unwrap().blocks().to_vec();
        // Tokens 9.. are still read: blocks 0 and 1 (tokens 0..8) go, block 2 (8..12) stays.
        assert_eq!(m.release_before(1, 9).unwrap(), 2);
        let table = m.table(1).unwrap();
        assert_eq!(
            table.entries().collect::<Vec<_>>()[..3],
            [-1, -1, held[2] as i32]
        );
        assert_eq!(
            (table.num_released(), table.held(), table.num_tokens()),
            (2, &held[2..], 18)
        );
        m.check_invariants().unwrap();
        // Released full blocks stay cached: the same prompt hits them.
        assert_eq!(m.match_prefix(&tokens, None).blocks[..2], held[..2]);
        // Moving back releases nothing; appends and slots past the window still work.
        assert_eq!(m.release_before(1, 3).unwrap(), 0);
        m.append(1, &[100, 101, 102]).unwrap();
        assert_eq!(
            m.slot_mapping(&[1], &[1]).unwrap(),
            [i64::from(m.table(1).unwrap().blocks()[5]) * 4]
        );
        // A fork shares only what is held; freeing both returns every block.
        m.fork(1, 2).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(m.release_before(2, 21).unwrap(), 3);
        m.check_invariants().unwrap();
        m.free(1).unwrap();
        m.free(2).unwrap();
        m.check_invariants().unwrap();
        assert_eq!(m.stats().used_blocks, 0);
        assert_eq!(m.stats().window_released_blocks, 5);
        assert!(matches!(
            m.release_before(1, 4),
            Err(Error::UnknownSequence(_))
        ));
    }

    #[test]
    fn without_prefix_caching_released_blocks_are_free_for_the_next_allocation() {
        let mut m = BlockManager::new(3, 4, false).unwrap();
        m.allocate(1, &(0..12).collect::<Vec<u32>>(), None).unwrap();
        assert_eq!(m.num_available_blocks(), 0);
        assert_eq!(m.release_before(1, 8).unwrap(), 2);
        assert_eq!(m.num_available_blocks(), 2);
        m.append(1, &[7; 8]).unwrap();
        m.check_invariants().unwrap();
    }

    #[test]
    fn shared_prefix_reuses_full_blocks_and_leaves_the_last_token() {
        let mut m = manager(16);
        let prompt: Vec<u32> = (0..10).collect(); // 2 full blocks + 2 tokens
        assert_eq!(m.allocate(1, &prompt, None).unwrap(), 0);
        let mut other = prompt[..8].to_vec();
        other.extend([50, 51, 52]);
        assert_eq!(m.allocate(2, &other, None).unwrap(), 8);
        assert_eq!(
            m.table(1).unwrap().blocks()[..2],
            m.table(2).unwrap().blocks()[..2]
        );
        // An identical 8-token prompt only gets 4 tokens: the last token must be computed.
        assert_eq!(m.allocate(3, &prompt[..8], None).unwrap(), 4);
        // A different salt shares nothing.
        assert_eq!(m.allocate(4, &prompt, Some(b"other tenant")).unwrap(), 0);
        let s = m.stats();
        assert_eq!(
            (s.prefix_queried_tokens, s.prefix_hit_tokens),
            (10 + 11 + 8 + 10, 12)
        );
        m.check_invariants().unwrap();
    }

    #[test]
    fn prefix_shorter_than_a_block_gives_no_hit() {
        let mut m = manager(8);
        m.allocate(1, &[1, 2, 3, 9, 9], None).unwrap();
        assert_eq!(m.allocate(2, &[1, 2, 3, 7, 7], None).unwrap(), 0);
    }

    #[test]
    fn freed_blocks_stay_cached_and_are_evicted_tail_first() {
        let mut m = manager(4);
        let prompt: Vec<u32> = (0..13).collect(); // 3 full blocks + 1 partial
        m.allocate(1, &prompt, None).unwrap();
        let blocks = m.table(1).unwrap().blocks().to_vec();
        m.free(1).unwrap();
        let s = m.stats();
        assert_eq!((s.free_blocks, s.cached_blocks, s.used_blocks), (1, 3, 0));
        // Needs 2 blocks: the clean one, then the evictable block holding the prompt's tail.
        m.allocate(2, &[100, 101, 102, 103, 104], None).unwrap();
        assert_eq!(m.stats().evictions, 1);
        assert!(!m.table(2).unwrap().blocks().contains(&blocks[0]));
        assert!(!m.table(2).unwrap().blocks().contains(&blocks[1]));
        // The first two blocks of the old prompt are still there.
        m.free(2).unwrap();
        assert_eq!(m.allocate(3, &prompt, None).unwrap(), 8);
        m.check_invariants().unwrap();
    }

    #[test]
    fn fork_shares_the_partial_tail_until_a_write_copies_it() {
        let mut m = manager(8);
        m.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        m.fork(1, 2).unwrap();
        assert_eq!(m.table(1).unwrap().blocks(), m.table(2).unwrap().blocks());
        let shared_tail = m.table(1).unwrap().blocks()[1];
        let copy = m
            .append(2, &[7])
            .unwrap()
            .expect("the shared tail is copied");
        assert_eq!(copy.src, shared_tail);
        assert_eq!(m.table(2).unwrap().blocks()[1], copy.dst);
        // The parent now owns the tail alone: no copy.
        assert_eq!(m.append(1, &[8]).unwrap(), None);
        assert_eq!(m.table(1).unwrap().blocks()[1], shared_tail);
        assert_eq!(m.stats().cow_copies, 1);
        m.free(1).unwrap();
        m.free(2).unwrap();
        assert_eq!(m.stats().used_blocks, 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn refusals_change_nothing() {
        let mut m = manager(3);
        m.allocate(1, &[1; 9], None).unwrap(); // 3 blocks
        let before = m.stats();
        assert!(matches!(
            m.allocate(2, &[5], None),
            Err(Error::OutOfBlocks {
                needed: 1,
                available: 0
            })
        ));
        assert!(matches!(
            m.append(1, &[1; 4]),
            Err(Error::OutOfBlocks { .. })
        ));
        assert!(matches!(
            m.allocate(1, &[5], None),
            Err(Error::DuplicateSequence(_))
        ));
        assert!(matches!(m.append(9, &[5]), Err(Error::UnknownSequence(_))));
        assert!(matches!(m.fork(9, 10), Err(Error::UnknownSequence(_))));
        assert!(matches!(m.fork(1, 1), Err(Error::DuplicateSequence(_))));
        assert!(matches!(m.free(9), Err(Error::UnknownSequence(_))));
        assert!(matches!(
            m.allocate(3, &[], None),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(m.stats(), before);
        assert_eq!(m.table(1).unwrap().num_tokens(), 9);
        m.check_invariants().unwrap();
    }

    /// A lookup whose blocks were evicted and reused since (random operation sequences never
    /// produced this: 0 of 300 proptest cases, 15 s of fuzzing).
    #[test]
    fn admitting_over_a_stale_lookup_is_refused_and_changes_nothing() {
        let mut m = manager(2);
        let prompt: Vec<u32> = (0..9).collect(); // 2 full blocks + 1
        m.allocate(1, &prompt[..8], None).unwrap();
        m.free(1).unwrap();
        let found = m.match_prefix(&prompt, None);
        assert_eq!(found.blocks.len(), 2);
        m.allocate(2, &[7; 8], None).unwrap(); // evicts both and hashes them anew
        m.free(2).unwrap();
        let before = m.stats();
        assert!(matches!(
            m.admit(3, &prompt, found),
            Err(Error::InvalidArgument(message)) if message.contains("stale")
        ));
        assert_eq!(m.stats(), before);
        assert!(!m.contains(3));
        m.check_invariants().unwrap();
    }

    #[test]
    fn admission_counts_evictable_hits_against_capacity() {
        let mut m = manager(3);
        m.allocate(1, &[1, 2, 3, 4, 5, 6, 7, 8, 9], None).unwrap();
        m.free(1).unwrap(); // 2 cached + 1 clean
                            // Reviving 2 cached blocks and adding 2 new needs 4 > 3 available: refused untouched.
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13];
        let found = m.match_prefix(&prompt, None);
        assert_eq!(found.blocks.len(), 2);
        assert_eq!(m.blocks_to_admit(&found, prompt.len()), 4);
        assert!(matches!(
            m.admit(2, &prompt, found),
            Err(Error::OutOfBlocks {
                needed: 4,
                available: 3
            })
        ));
        assert_eq!(m.stats().cached_blocks, 2);
        // Admitting only the first chunk fits.
        let found = m.match_prefix(&prompt, None);
        assert_eq!(m.admit(2, &prompt[..12], found).unwrap(), 8);
        m.check_invariants().unwrap();
    }

    #[test]
    fn slots_follow_the_block_table() {
        let mut m = manager(8);
        m.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        let table = m.table(1).unwrap();
        let mut slots = Vec::new();
        table.extend_slots(0, 6, &mut slots);
        let b = table.blocks().to_vec();
        let expected: Vec<i64> = (0..6)
            .map(|p| b[p / 4] as i64 * 4 + (p % 4) as i64)
            .collect();
        assert_eq!(slots, expected);
        let mut out = Vec::new();
        m.allocate(2, &[9], None).unwrap();
        assert_eq!(m.batch_block_tables(&[1, 2], 0, &mut out).unwrap(), 2);
        assert_eq!(
            out,
            vec![
                b[0] as i32,
                b[1] as i32,
                m.table(2).unwrap().blocks()[0] as i32,
                -1
            ]
        );
    }

    #[test]
    fn slot_mapping_is_checked_whole_before_any_slot() {
        let mut m = manager(8);
        m.allocate(1, &[1, 2, 3, 4, 5, 6], None).unwrap();
        m.allocate(2, &[9], None).unwrap();
        let b = m.table(1).unwrap().blocks().to_vec();
        let s2 = i64::from(m.table(2).unwrap().blocks()[0]) * 4;
        let last_two = [i64::from(b[1]) * 4, i64::from(b[1]) * 4 + 1];
        assert_eq!(
            m.slot_mapping(&[1, 2], &[2, 1]).unwrap(),
            [last_two[0], last_two[1], s2]
        );
        assert!(matches!(
            m.slot_mapping(&[1], &[1, 1]),
            Err(Error::Shape(_))
        ));
        assert!(matches!(
            m.slot_mapping(&[1, 2], &[1, 2]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            m.slot_mapping(&[1, 3], &[1, 0]),
            Err(Error::UnknownSequence(_))
        ));
    }

    #[test]
    fn can_allocate_counts_evictable_hits_and_refuses_empty_prompts() {
        let mut m = manager(3);
        assert!(!m.can_allocate(&[], None));
        assert!(m.can_allocate(&[1; 12], None) && !m.can_allocate(&[1; 13], None));
        m.allocate(1, &[1; 5], None).unwrap();
        // One block left: enough for a prompt sharing the first full block, not for a new one.
        assert!(m.can_allocate(&[1; 5], None) && !m.can_allocate(&[2; 5], None));
        assert!(!m.can_allocate(&[1; 9], None));
    }

    #[test]
    fn sizes_whose_ids_or_slots_overflow_are_refused_at_construction() {
        // Slots block * block_size + offset must fit an i64 (they wrapped negative).
        assert!(matches!(
            BlockManager::new(4, 1 << 62, true),
            Err(Error::InvalidArgument(_))
        ));
        // Block ids must fit the int32 block tables (ids >= 2^31 turned negative).
        assert!(matches!(
            BlockManager::new(MAX_NUM_BLOCKS + 1, 1, true),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            BlockManager::new(0, 4, true),
            Err(Error::InvalidArgument(_))
        ));
    }
}
