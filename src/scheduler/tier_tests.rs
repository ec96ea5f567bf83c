//! The scheduler and block manager driving a lower tier, tested with a fake tier and a fake KV
//! content model.
//!
//! The fake tier runs its jobs in order when told to (`World::progress`, or on its own at each
//! `completed_loads` when `auto`), as an I/O thread would: an offload copies the block's content
//! out, checks it is the content its hash claims, pushes the block onto the pool's free list, bumps
//! `returned`, then stores the copy (sometimes corrupted, evicting FIFO when full); a load verifies
//! the entry (tokens, parent, not corrupt) and writes its content into the RAM block, or writes
//! garbage and reports `Dropped`.
//!
//! The content model: RAM slot `p` of a sequence holds `kv(parent, tokens of its block up to p)`,
//! a function of the whole prefix (as real K/V is), written by the "model" for every scheduled
//! token; a sequence is never scheduled over a context slot that does not hold its own value.
//! With several KV cache groups, each group's tables hold their own blocks (hashes chained from
//! the group's root, blocks of the group's size carved from pages of `page` tokens): a block's
//! cells are the first of its page's.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::ids::BlockId;
use crate::kv::coordinator::{capacity_tokens, group_root};
use crate::memory::block_manager::{LoadsEnded, TierPolicy};
use crate::memory::prefix_cache::block_hashes;
use crate::tier::{LoadDone, LoadJob, LoadOutcome, OffloadJob, TierCounters};

/// The value a slot holds once the token at its position was computed: a hash of the block's parent
/// (the whole prefix before it) and of the block's tokens up to that position.
fn kv(parent: BlockHash, tokens_upto: &[TokenId]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
    hasher.update(&parent.to_ne_bytes());
    hasher.update(bytemuck::cast_slice(tokens_upto));
    hasher.digest()
}

/// What each slot of a sequence of `tokens` under `root` must hold, by position.
fn expected_kvs(root: BlockHash, tokens: &[TokenId], bs: usize) -> Vec<u64> {
    let hashes = block_hashes(root, tokens, bs);
    (0..tokens.len())
        .map(|p| {
            let block = p / bs;
            let parent = if block == 0 { root } else { hashes[block - 1] };
            kv(parent, &tokens[block * bs..=p])
        })
        .collect()
}

/// The content a whole block after `parent` holding `tokens` has.
fn block_kv(parent: BlockHash, tokens: &[TokenId]) -> Vec<Option<u64>> {
    (0..tokens.len())
        .map(|o| Some(kv(parent, &tokens[..=o])))
        .collect()
}

enum Job {
    Offload(OffloadJob),
    Load(LoadJob),
}

struct Entry {
    parent: BlockHash,
    tokens: std::sync::Arc<[TokenId]>,
    group: u32,
    content: Vec<Option<u64>>,
    corrupt: bool,
}

/// The fake tier's state and the RAM content, shared by the test and the boxed tier.
struct World {
    link: TierLink,
    /// Tokens per page (RAM cells per block id).
    page: usize,
    /// The scheduler's KV cache groups.
    groups: Vec<GroupKeeping>,
    ram: Vec<Option<u64>>,
    store: HashMap<BlockHash, Entry>,
    order: VecDeque<BlockHash>,
    capacity: usize,
    queue: VecDeque<Job>,
    done: Vec<LoadDone>,
    events: Vec<KvEvent>,
    counters: TierCounters,
    dropped: u64,
    errors: Vec<String>,
    rng: StdRng,
    corrupt_percent: u32,
    /// Run a random number of queued jobs at each `completed_loads`.
    auto: bool,
}

impl World {
    fn new(link: TierLink, num_blocks: usize, page: usize, capacity: usize, seed: u64) -> Self {
        World {
            link,
            page,
            groups: vec![GroupKeeping::full(page)],
            ram: vec![None; num_blocks * page],
            store: HashMap::new(),
            order: VecDeque::new(),
            capacity,
            queue: VecDeque::new(),
            done: Vec::new(),
            events: Vec::new(),
            counters: TierCounters::default(),
            dropped: 0,
            errors: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
            corrupt_percent: 0,
            auto: false,
        }
    }

    fn slots(&mut self, block: BlockId) -> &mut [Option<u64>] {
        let page = self.page;
        &mut self.ram[block as usize * page..][..page]
    }

    /// The RAM cell of slot `slot` of group `group` (module doc).
    fn cell(&self, group: usize, slot: usize) -> usize {
        let bs = self.groups[group].block_size;
        slot / bs * self.page + slot % bs
    }

    /// Runs the first `jobs` queued jobs.
    fn progress(&mut self, jobs: usize) {
        for _ in 0..jobs {
            let Some(job) = self.queue.pop_front() else {
                return;
            };
            match job {
                Job::Offload(job) => self.run_offload(job),
                Job::Load(job) => self.run_load(job),
            }
        }
    }

    fn progress_some(&mut self) {
        let jobs = self.rng.random_range(0..=self.queue.len());
        self.progress(jobs);
    }

    fn run_offload(&mut self, job: OffloadJob) {
        let content = self.slots(job.block)[..job.key.tokens.len()].to_vec();
        if content != block_kv(job.key.parent, &job.key.tokens) {
            self.errors.push(format!(
                "block {} offloaded as {:x} does not hold its tokens",
                job.block, job.key.hash
            ));
        }
        // Copy-out done: the block goes back (poisoned, as a reused block holds stale data), pushed
        // before it is counted.
        self.slots(job.block).fill(None);
        self.link.free.push(job.block);
        self.link.returned.fetch_add(1, Ordering::Release);
        self.counters.offloads += 1;
        if self.store.contains_key(&job.key.hash) {
            return;
        }
        while self.store.len() >= self.capacity {
            let victim = self.order.pop_front().expect("a full store has entries");
            if let Some(entry) = self.store.remove(&victim) {
                self.counters.evictions += 1;
                self.removed(victim, entry.group);
            }
        }
        let corrupt = self.rng.random_range(0..100) < self.corrupt_percent;
        let mut content = content;
        if corrupt {
            content[0] = Some(0xbad);
        }
        self.events.push(KvEvent::BlockStored {
            key: job.key.clone(),
            medium: Medium::Disk,
            group: job.group,
        });
        self.store.insert(
            job.key.hash,
            Entry {
                parent: job.key.parent,
                tokens: job.key.tokens,
                group: job.group,
                content,
                corrupt,
            },
        );
        self.order.push_back(job.key.hash);
        self.counters.blocks = self.store.len() as u64;
    }

    fn removed(&mut self, hash: BlockHash, group: u32) {
        self.events.push(KvEvent::BlockRemoved {
            hash,
            medium: Medium::Disk,
            group,
        });
        self.counters.blocks = self.store.len() as u64;
    }

    fn run_load(&mut self, job: LoadJob) {
        self.counters.loads += 1;
        let verified = self.store.get(&job.key.hash).and_then(|e| {
            let same = e.parent == job.key.parent && e.tokens == job.key.tokens;
            (!e.corrupt && same && e.group == job.group).then(|| e.content.clone())
        });
        let outcome = match verified {
            Some(content) => {
                self.slots(job.block)[..content.len()].copy_from_slice(&content);
                LoadOutcome::Loaded
            }
            None => {
                if let Some(entry) = self.store.remove(&job.key.hash) {
                    self.counters.dropped_corrupt += 1;
                    self.removed(job.key.hash, entry.group);
                }
                // A torn read leaves garbage behind.
                self.slots(job.block).fill(Some(0xdead));
                self.dropped += 1;
                LoadOutcome::Dropped
            }
        };
        self.done.push(LoadDone {
            block: job.block,
            outcome,
        });
    }

    /// Writes what the model computes in `step`: every scheduled token's slot.
    fn write_step(&mut self, s: &Scheduler, step: &StepOutput, roots: &HashMap<String, BlockHash>) {
        for pair in step.copy_ops.chunks_exact(2) {
            let src = self.slots(pair[0] as BlockId).to_vec();
            self.slots(pair[1] as BlockId).copy_from_slice(&src);
        }
        let t = step.num_tokens();
        for (row, (id, &index)) in step.request_ids.iter().zip(&step.seq_indices).enumerate() {
            let tokens = s.sequence_tokens(id, index).unwrap();
            for (g, kept) in self.groups.clone().into_iter().enumerate() {
                let root = group_root(roots[&**id], g);
                let expected = expected_kvs(root, tokens, kept.block_size);
                let (q0, q1) = (
                    step.query_start_loc[row] as usize,
                    step.query_start_loc[row + 1] as usize,
                );
                for q in q0..q1 {
                    let p = step.positions[q] as usize;
                    let cell = self.cell(g, step.slot_mapping[g * t + q] as usize);
                    self.ram[cell] = Some(expected[p]);
                }
            }
        }
    }

    /// Checks that every row's context (the slots before its first scheduled token that its
    /// queries read, in every group) holds its own values.
    fn check_contexts(&self, s: &Scheduler, step: &StepOutput, roots: &HashMap<String, BlockHash>) {
        let (width, rows) = (step.block_table_width, step.num_seqs());
        for (row, (id, &index)) in step.request_ids.iter().zip(&step.seq_indices).enumerate() {
            let tokens = s.sequence_tokens(id, index).unwrap();
            let start = step.positions[step.query_start_loc[row] as usize] as usize;
            for (g, kept) in self.groups.iter().enumerate() {
                let bs = kept.block_size;
                let expected = expected_kvs(group_root(roots[&**id], g), tokens, bs);
                let read_from = match kept.attention {
                    AttentionKind::Full => 0,
                    AttentionKind::Sliding { window } => (start + 1).saturating_sub(window),
                };
                let table = &step.block_tables[(g * rows + row) * width..][..width];
                for (p, &value) in expected[..start].iter().enumerate().skip(read_from) {
                    let block = table[p / bs];
                    let cell = block as usize * self.page + p % bs;
                    assert_eq!(
                        self.ram[cell],
                        Some(value),
                        "{id}/{index} scheduled over block {block} of group {g} whose position \
                         {p} is not its own"
                    );
                }
            }
        }
    }
}

struct FakeTier(Arc<Mutex<World>>);

impl KvTier for FakeTier {
    fn contains(&self, hash: BlockHash) -> bool {
        let w = self.0.lock().unwrap();
        w.store.contains_key(&hash)
            || w.queue
                .iter()
                .any(|j| matches!(j, Job::Offload(o) if o.key.hash == hash))
    }
    fn offload(&mut self, job: OffloadJob) {
        self.0.lock().unwrap().queue.push_back(Job::Offload(job));
    }
    fn load(&mut self, job: LoadJob) {
        self.0.lock().unwrap().queue.push_back(Job::Load(job));
    }
    fn completed_loads(&mut self) -> Vec<LoadDone> {
        let mut w = self.0.lock().unwrap();
        if w.auto {
            w.progress_some();
        }
        std::mem::take(&mut w.done)
    }
    fn flush(&mut self) {
        let mut w = self.0.lock().unwrap();
        let jobs = w.queue.len();
        w.progress(jobs);
    }
    fn counters(&self) -> TierCounters {
        self.0.lock().unwrap().counters
    }
    fn stored_blocks(&self) -> Vec<(BlockHash, u32)> {
        let world = self.0.lock().unwrap();
        world
            .store
            .iter()
            .map(|(&hash, e)| (hash, e.group))
            .collect()
    }
    fn drain_events(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.0.lock().unwrap().events);
    }
}

/// A manager of `num_blocks` blocks of 4 tokens with a fake tier of `capacity` blocks.
fn manager_with_tier(
    num_blocks: usize,
    capacity: usize,
    policy: TierPolicy,
) -> (BlockManager, Arc<Mutex<World>>) {
    let mut m = BlockManager::new(num_blocks, 4, true).unwrap();
    let world = Arc::new(Mutex::new(World::new(
        m.tier_link(),
        num_blocks,
        4,
        capacity,
        7,
    )));
    m.attach_tier(Box::new(FakeTier(world.clone()))).unwrap();
    m.set_tier_policy(policy).unwrap();
    (m, world)
}

/// Writes the content of `seq`'s whole table (as a model computing it would).
fn compute(m: &BlockManager, world: &Mutex<World>, seq: SeqId) {
    let table = m.table(seq).unwrap();
    let mut w = world.lock().unwrap();
    for (p, value) in expected_kvs(root_hash(None), table.tokens(), 4)
        .into_iter()
        .enumerate()
    {
        let slot = table.slot(p) as usize;
        w.ram[slot] = Some(value);
    }
}

/// Sequence 1 computes `prompt` and is freed; then every cached block is offloaded and returned.
fn offload_all(m: &mut BlockManager, world: &Mutex<World>, prompt: &[TokenId]) {
    m.allocate(1, prompt, None).unwrap();
    compute(m, world, 1);
    m.free(1).unwrap();
    let watermark = m.num_blocks();
    m.set_tier_policy(TierPolicy {
        min_load_blocks: 1,
        offload_watermark: watermark,
    })
    .unwrap();
    assert!(m.poll_tier().is_empty());
    world.lock().unwrap().progress(usize::MAX);
    m.set_tier_policy(TierPolicy {
        min_load_blocks: 1,
        offload_watermark: 0,
    })
    .unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn admission_counts_tier_hits_as_new_blocks_and_loads_them() {
    let (mut m, world) = manager_with_tier(8, 16, TierPolicy::default());
    let prompt: Vec<TokenId> = (0..13).collect(); // 3 full blocks + 1
    offload_all(&mut m, &world, &prompt);
    assert_eq!(m.stats().offloads_issued, 3);
    assert_eq!(m.stats().cached_blocks, 0);

    let found = m.match_prefix(&prompt, None);
    assert!(found.blocks.is_empty());
    assert_eq!(found.tier_hashes, block_hashes(0, &prompt[..12], 4));
    assert_eq!(m.blocks_to_admit(&found, found.num_hit_tokens()), 3);
    // Admitting more than the hit tokens with tier hits is refused, untouched.
    assert!(matches!(
        m.admit(2, &prompt, found.clone()),
        Err(Error::InvalidArgument(_))
    ));
    assert_eq!(m.admit(2, &prompt[..12], found).unwrap(), 0);
    assert!(m.is_loading(2));
    assert_eq!(m.stats().loading_blocks, 3);
    assert!(matches!(m.append(2, &[12]), Err(Error::InvalidArgument(_))));
    // Nothing is findable in RAM until its load ends.
    assert!(m.match_prefix(&prompt, None).blocks.is_empty());
    m.check_invariants().unwrap();

    world.lock().unwrap().progress(2);
    assert!(m.poll_tier().is_empty(), "one load still in flight");
    assert_eq!(m.match_prefix(&prompt, None).blocks.len(), 2);
    world.lock().unwrap().progress(1);
    assert_eq!(
        m.poll_tier(),
        vec![LoadsEnded {
            seq: 2,
            num_tokens: 12
        }]
    );
    assert!(!m.is_loading(2));
    assert_eq!(m.append(2, &[12]).unwrap(), None);
    let s = m.stats();
    assert_eq!(
        (s.loads_issued, s.loads_dropped, s.loading_blocks),
        (3, 0, 0)
    );
    m.check_invariants().unwrap();
}

#[test]
fn a_dropped_load_cuts_the_table_back_and_is_not_registered() {
    let (mut m, world) = manager_with_tier(8, 16, TierPolicy::default());
    let prompt: Vec<TokenId> = (0..13).collect();
    offload_all(&mut m, &world, &prompt);
    let hashes = block_hashes(0, &prompt[..12], 4);
    world
        .lock()
        .unwrap()
        .store
        .get_mut(&hashes[1])
        .unwrap()
        .corrupt = true;
    let found = m.match_prefix(&prompt, None);
    m.admit(2, &prompt[..12], found).unwrap();
    world.lock().unwrap().progress(3);
    assert_eq!(
        m.poll_tier(),
        vec![LoadsEnded {
            seq: 2,
            num_tokens: 4
        }]
    );
    assert_eq!(m.table(2).unwrap().blocks().len(), 1);
    // Block 0 and block 2 loaded (2 is cached, its parent missing in RAM); block 1 is gone.
    assert!(m.cached_block(hashes[0]).is_some() && m.cached_block(hashes[2]).is_some());
    assert!(m.cached_block(hashes[1]).is_none());
    assert!(!world.lock().unwrap().store.contains_key(&hashes[1]));
    assert_eq!(m.stats().loads_dropped, 1);
    assert_eq!(world.lock().unwrap().counters.dropped_corrupt, 1);
    m.check_invariants().unwrap();
}

#[test]
fn a_run_of_tier_hits_below_the_threshold_is_recomputed() {
    let (mut m, world) = manager_with_tier(8, 16, TierPolicy::default());
    let prompt: Vec<TokenId> = (0..13).collect();
    offload_all(&mut m, &world, &prompt);
    for (min_load_blocks, loaded) in [(3, 3), (4, 0)] {
        m.set_tier_policy(TierPolicy {
            min_load_blocks,
            offload_watermark: 0,
        })
        .unwrap();
        assert_eq!(
            m.match_prefix(&prompt, None).tier_hashes.len(),
            loaded,
            "min_load_blocks {min_load_blocks}"
        );
    }
    assert!(m
        .set_tier_policy(TierPolicy {
            min_load_blocks: 0,
            offload_watermark: 0
        })
        .is_err());
}

#[test]
fn the_watermark_offloads_ahead_and_a_shortfall_drops_without_offload() {
    let (mut m, world) = manager_with_tier(
        6,
        16,
        TierPolicy {
            min_load_blocks: 1,
            offload_watermark: 2,
        },
    );
    let prompt: Vec<TokenId> = (0..21).collect(); // 5 full blocks + 1: every block
    m.allocate(1, &prompt, None).unwrap();
    compute(&m, &world, 1);
    m.free(1).unwrap(); // 1 clean + 5 cached
    assert!(m.poll_tier().is_empty());
    let s = m.stats();
    assert_eq!(
        (s.offloads_issued, s.offloading_blocks, s.cached_blocks),
        (1, 1, 4),
        "1 clean + 0 on the way < 2: the next victim goes to the tier"
    );
    assert_eq!(
        m.num_available_blocks(),
        5,
        "an offloading block is not available"
    );
    m.check_invariants().unwrap();
    // Before the tier returns it, 3 allocations take the clean block then drop 2 cached ones.
    m.allocate(2, &[100; 9], None).unwrap();
    let s = m.stats();
    assert_eq!((s.evictions, s.evictions_without_offload), (2, 2));
    // Once returned, it is clean and counted so.
    world.lock().unwrap().progress(usize::MAX);
    assert_eq!(m.stats().free_blocks, 1);
    assert_eq!(m.stats().offloading_blocks, 0);
    m.allocate(3, &[200; 3], None).unwrap();
    assert_eq!(
        m.stats().evictions,
        2,
        "the returned block serves the allocation"
    );
    m.check_invariants().unwrap();
    m.free(2).unwrap();
    m.free(3).unwrap();
    m.flush_tier();
    m.check_free_list().unwrap();
}

#[test]
fn attach_and_event_recording_need_a_pristine_manager() {
    let mut m = BlockManager::new(4, 4, true).unwrap();
    m.allocate(1, &[1; 5], None).unwrap();
    let world = Arc::new(Mutex::new(World::new(m.tier_link(), 4, 4, 4, 0)));
    assert!(m.attach_tier(Box::new(FakeTier(world.clone()))).is_err());
    assert!(m.record_kv_events().is_err());
    m.free(1).unwrap();
    assert!(
        m.attach_tier(Box::new(FakeTier(world.clone()))).is_err(),
        "a cached block has no kept tokens"
    );
    let mut m = BlockManager::new(4, 4, true).unwrap();
    m.attach_tier(Box::new(FakeTier(world.clone()))).unwrap();
    assert!(m.attach_tier(Box::new(FakeTier(world))).is_err());
}

/// A scheduler of `num_blocks` blocks of 4 tokens with an auto-progressing fake tier.
fn scheduler_with_tier(
    cfg: SchedulerConfig,
    capacity: usize,
    seed: u64,
) -> (Scheduler, Arc<Mutex<World>>) {
    let full = GroupKeeping::full(cfg.block_size);
    scheduler_with_tier_keeping(cfg, vec![full], capacity, seed)
}

/// `scheduler_with_tier` for a scheduler keeping KV cache groups `groups`.
fn scheduler_with_tier_keeping(
    cfg: SchedulerConfig,
    groups: Vec<GroupKeeping>,
    capacity: usize,
    seed: u64,
) -> (Scheduler, Arc<Mutex<World>>) {
    let mut s = Scheduler::keeping(cfg, groups.clone()).unwrap();
    let mut world = World::new(
        s.tier_link(),
        s.config().num_blocks,
        s.config().block_size,
        capacity,
        seed,
    );
    world.groups = groups;
    let world = Arc::new(Mutex::new(world));
    s.attach_tier(Box::new(FakeTier(world.clone()))).unwrap();
    (s, world)
}

/// Runs one step with the content model: writes the step, checks contexts, samples.
fn tier_step(
    s: &mut Scheduler,
    world: &Mutex<World>,
    roots: &HashMap<String, BlockHash>,
    known: &mut Known,
) -> UpdateOutput {
    let out = s.schedule().unwrap().clone();
    let groups = world.lock().unwrap().groups.clone();
    for (id, &index) in out.request_ids.iter().zip(&out.seq_indices) {
        learn(
            known,
            roots[&**id],
            s.sequence_tokens(id, index).unwrap(),
            &groups,
        );
    }
    {
        let mut w = world.lock().unwrap();
        w.write_step(s, &out, roots);
        w.check_contexts(s, &out, roots);
        assert!(w.errors.is_empty(), "{:?}", w.errors);
    }
    let sampled: Vec<TokenId> = out
        .logits_indices
        .iter()
        .zip(&out.sample_seq_indices)
        .map(|(&row, &sample)| {
            super::tests::next_token(out.input_ids[row as usize], out.positions[row as usize])
                + sample
        })
        .collect();
    let produced = s.update(out.id, &sampled).unwrap().clone();
    s.check_invariants().unwrap();
    produced
}

#[test]
fn an_aborted_loading_sequence_keeps_its_blocks_until_the_loads_end() {
    let mut cfg = SchedulerConfig::new(8, 4);
    cfg.offload_watermark_blocks = 8; // offload every cached block at once
    let (mut s, world) = scheduler_with_tier(cfg, 16, 1);
    let roots: HashMap<String, BlockHash> =
        [("a", 0), ("b", 0)].map(|(k, v)| (k.to_string(), v)).into();
    let mut known = Known::new();
    let prompt: Vec<TokenId> = (0..13).collect();
    add_tokens(&mut s, "a", prompt.clone(), 1);
    while s.has_unfinished() {
        tier_step(&mut s, &world, &roots, &mut known);
    }
    tier_step(&mut s, &world, &roots, &mut known); // the watermark offloads the cached blocks
    world.lock().unwrap().progress(usize::MAX);
    assert_eq!(s.stats().offloads_issued, 3);

    add_tokens(&mut s, "b", prompt, 1);
    let out = s.schedule().unwrap().clone();
    assert_eq!(out.num_tokens(), 0, "b waits for its loads");
    assert_eq!(
        out.events,
        vec![super::tests::event("b", 0, RequestEventKind::Admitted, 0)]
    );
    s.update(out.id, &[]).unwrap();
    assert_eq!((s.num_loading(), s.stats().loads_issued), (1, 3));
    s.abort("b").unwrap();
    s.check_invariants().unwrap();
    let stats = s.block_manager().stats();
    assert_eq!(
        (stats.used_blocks, stats.loading_blocks),
        (3, 3),
        "pending frees"
    );
    world.lock().unwrap().progress(usize::MAX);
    tier_step(&mut s, &world, &roots, &mut known);
    let stats = s.block_manager().stats();
    assert_eq!((stats.used_blocks, stats.loading_blocks), (0, 0));
    assert_eq!(
        stats.cached_blocks + stats.offloading_blocks,
        3,
        "the loaded blocks are cached"
    );
    s.flush_tier();
    s.blocks.manager_mut().check_free_list().unwrap();
}

#[test]
fn a_loading_sequence_runs_from_its_loaded_prefix() {
    let mut cfg = SchedulerConfig::new(8, 4);
    cfg.offload_watermark_blocks = 8;
    let (mut s, world) = scheduler_with_tier(cfg, 16, 1);
    let roots: HashMap<String, BlockHash> =
        [("a", 0), ("b", 0)].map(|(k, v)| (k.to_string(), v)).into();
    let mut known = Known::new();
    let prompt: Vec<TokenId> = (0..14).collect();
    add_tokens(&mut s, "a", prompt.clone(), 1);
    while s.has_unfinished() {
        tier_step(&mut s, &world, &roots, &mut known);
    }
    tier_step(&mut s, &world, &roots, &mut known);
    world.lock().unwrap().progress(usize::MAX);
    add_tokens(&mut s, "b", prompt, 2);
    tier_step(&mut s, &world, &roots, &mut known);
    assert_eq!(s.num_loading(), 1);
    world.lock().unwrap().progress(usize::MAX);
    let out = s.schedule().unwrap().clone();
    assert_eq!(
        out.positions,
        vec![12, 13],
        "only the tokens after the loaded prefix run"
    );
    world.lock().unwrap().check_contexts(&s, &out, &roots);
    let stats = s.stats();
    assert_eq!(
        (
            stats.tier_hit_blocks,
            stats.tier_hit_tokens,
            stats.prefix_hit_tokens
        ),
        (3, 12, 0)
    );
    assert_eq!(stats.tier.loads, 3);
}

fn add_tokens(s: &mut Scheduler, id: &str, prompt: Vec<TokenId>, max_tokens: usize) {
    let params = SamplingParams {
        max_tokens,
        ..Default::default()
    };
    s.add_request(id, prompt, params, RequestOptions::default())
        .unwrap();
}

/// Applies `events` to `set`, checking each stores an absent block or removes a present one.
fn replay(set: &mut HashSet<(BlockHash, Medium, u32)>, events: Vec<KvEvent>) {
    for event in events {
        match event {
            KvEvent::BlockStored { key, medium, group } => {
                let hash = key.hash;
                assert!(
                    set.insert((hash, medium, group)),
                    "{hash:x} stored twice in {medium:?}"
                )
            }
            KvEvent::BlockRemoved {
                hash,
                medium,
                group,
            } => {
                assert!(
                    set.remove(&(hash, medium, group)),
                    "{hash:x} of group {group} removed but absent in {medium:?}"
                )
            }
            KvEvent::AllBlocksCleared { medium } => set.retain(|&(_, m, _)| m != medium),
        }
    }
}

fn assert_replay_matches(s: &mut Scheduler, set: &mut HashSet<(BlockHash, Medium, u32)>) {
    replay(set, s.take_kv_events());
    let blocks = s.kv_blocks();
    let now: HashSet<_> = blocks.iter().copied().collect();
    assert_eq!(now.len(), blocks.len(), "kv_blocks lists a block twice");
    assert_eq!(&now, set, "replayed events differ from kv_blocks");
}

#[test]
fn replaying_the_events_gives_kv_blocks() {
    let mut cfg = SchedulerConfig::new(6, 4);
    cfg.emit_kv_events = true;
    cfg.offload_watermark_blocks = 2;
    let (mut s, world) = scheduler_with_tier(cfg, 3, 5);
    world.lock().unwrap().auto = true;
    let mut roots = HashMap::new();
    let mut set = HashSet::new();
    let mut known = Known::new();
    for (i, base) in [0u32, 100, 0, 200, 100, 0].into_iter().enumerate() {
        let id = format!("r{i}");
        roots.insert(id.clone(), 0);
        add_tokens(&mut s, &id, (base..base + 11).collect(), 3);
        while s.has_unfinished() {
            tier_step(&mut s, &world, &roots, &mut known);
            assert_replay_matches(&mut s, &mut set);
        }
    }
    let stats = s.stats();
    assert!(
        stats.offloads_issued > 0 && stats.tier.evictions > 0,
        "{stats:?}"
    );
    assert!(
        set.iter().any(|&(_, m, _)| m == Medium::Ram)
            && set.iter().any(|&(_, m, _)| m == Medium::Disk)
    );
    // Without emit_kv_events there are none.
    let (mut quiet, _) = scheduler_with_tier(SchedulerConfig::new(6, 4), 3, 5);
    add_tokens(&mut quiet, "x", (0..11).collect(), 1);
    quiet.schedule().unwrap();
    assert!(quiet.take_kv_events().is_empty());
    assert!(!quiet.kv_blocks().is_empty());
}

#[derive(Debug, Clone)]
struct Spec {
    base: u32,
    base_len: usize,
    suffix_len: usize,
    max_tokens: usize,
    n: usize,
    salted: bool,
    arrive_at: usize,
    abort_at: Option<usize>,
    finish_sample_at: Option<usize>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        (0..3u32, 4..24usize, 1..10usize, 1..12usize, 1..3usize),
        (
            proptest::bool::weighted(0.2),
            0..150usize,
            proptest::option::weighted(0.2, 0..200usize),
            proptest::option::weighted(0.2, 0..200usize),
        ),
    )
        .prop_map(
            |(
                (base, base_len, suffix_len, max_tokens, n),
                (salted, arrive_at, abort_at, finish_sample_at),
            )| Spec {
                base,
                base_len,
                suffix_len,
                max_tokens,
                n,
                salted,
                arrive_at,
                abort_at,
                finish_sample_at,
            },
        )
}

/// One random workload of `random_workloads_with_a_tier_serve_only_their_own_kv`.
#[derive(Debug, Clone)]
struct Workload {
    specs: Vec<Spec>,
    num_blocks: usize,
    capacity: usize,
    corrupt_percent: u32,
    min_load_blocks: usize,
    watermark: usize,
    budget: usize,
    events: bool,
    slru: bool,
    seed: u64,
    /// A sliding-window group beside the full one: its window and its block size (a divisor of
    /// the pages' 4 tokens); none: one full group.
    sliding: Option<(usize, usize)>,
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        proptest::collection::vec(spec(), 4..20),
        (10..16usize, 1..24usize, 0..40u32, 1..3usize, 0..4usize),
        (4..40usize, any::<bool>(), any::<bool>(), any::<u64>()),
        proptest::option::of((2..12usize, proptest::sample::select(vec![1usize, 2, 4]))),
    )
        .prop_map(
            |(
                specs,
                (num_blocks, capacity, corrupt_percent, min_load_blocks, watermark),
                (budget, events, slru, seed),
                sliding,
            )| Workload {
                specs,
                num_blocks,
                capacity,
                corrupt_percent,
                min_load_blocks,
                watermark,
                budget,
                events,
                slru,
                seed,
                sliding,
            },
        )
}

/// Random workloads over a tiny RAM pool — one full KV cache group, or a sliding-window group
/// beside it whose blocks may carve the pages — and a fake tier whose jobs run after random delays,
/// some of its blocks corrupt or evicted (their loads dropped): no sequence is ever scheduled over
/// a block that does not hold its own KV, no offloaded block is reused before it is copied out, a
/// hash findable in RAM and in the tier has the same content in both, invariants hold after every
/// step, every request ends, the events replay to `kv_blocks`, and once the tier is flushed every
/// block is back and the counts balance. A fixed seed (so CI is reproducible); over its cases the
/// workloads must have loaded, dropped loads, offloaded and evicted without offload, or the test
/// proves nothing.
#[test]
fn random_workloads_with_a_tier_serve_only_their_own_kv() {
    let config = ProptestConfig {
        cases: 120, // about 0.3 s in release
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = proptest::test_runner::TestRunner::new_with_rng(
        config,
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    // Per layout (one full group; a sliding group beside it).
    let totals = std::cell::Cell::new([[0u64; 4]; 2]);
    let result = runner.run(&workload(), |w| {
        let stats = run_workload(&w)?;
        let mut all = totals.get();
        let t = &mut all[usize::from(w.sliding.is_some())];
        t[0] += stats.loads_issued;
        t[1] += stats.loads_dropped;
        t[2] += stats.offloads_issued;
        t[3] += stats.evictions_without_offload;
        totals.set(all);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    for [loads, dropped, offloads, drops] in totals.get() {
        assert!(
            loads > 0 && dropped > 0 && offloads > 0 && drops > 0,
            "loads {loads}, dropped {dropped}, offloads {offloads}, evictions without offload \
             {drops}"
        );
    }
}

fn run_workload(w: &Workload) -> std::result::Result<SchedulerStats, TestCaseError> {
    let Workload {
        ref specs,
        num_blocks,
        capacity,
        corrupt_percent,
        min_load_blocks,
        watermark,
        budget,
        events,
        slru,
        seed,
        sliding,
    } = *w;
    let mut groups = vec![GroupKeeping::full(4)];
    if let Some((window, block_size)) = sliding {
        groups.push(GroupKeeping {
            attention: AttentionKind::Sliding { window },
            block_size,
        });
    }
    let mut cfg = SchedulerConfig::new(num_blocks, 4);
    cfg.max_num_batched_tokens = budget;
    cfg.max_num_seqs = 4;
    cfg.max_model_len = 40.min(capacity_tokens(&groups, num_blocks, budget));
    cfg.emit_kv_events = events;
    cfg.min_load_blocks = min_load_blocks;
    cfg.offload_watermark_blocks = watermark;
    cfg.eviction_policy = if slru {
        EvictionPolicy::Slru
    } else {
        EvictionPolicy::Lru
    };
    let max_model_len = cfg.max_model_len;
    let (mut s, world) = scheduler_with_tier_keeping(cfg, groups.clone(), capacity, seed);
    {
        let mut w = world.lock().unwrap();
        w.auto = true;
        w.corrupt_percent = corrupt_percent;
    }
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut roots = HashMap::new();
    let mut outcome: HashMap<String, &str> = HashMap::new();
    let mut set = HashSet::new();
    let mut known = Known::new();
    for t in 0..3000usize {
        for (i, spec) in specs.iter().enumerate() {
            let id = format!("r{i}");
            if spec.arrive_at == t {
                let prompt: Vec<TokenId> = (0..spec.base_len)
                    .map(|p| spec.base * 100 + p as TokenId + 1)
                    .chain((0..spec.suffix_len).map(|p| (i * 1000 + p) as TokenId))
                    .collect();
                let salt = spec.salted.then(|| b"tenant".to_vec());
                roots.insert(id.clone(), root_hash(salt.as_deref()));
                learn(&mut known, roots[&id], &prompt, &groups);
                let params = SamplingParams {
                    max_tokens: spec.max_tokens,
                    n: spec.n,
                    ..Default::default()
                };
                let options = RequestOptions {
                    cache_salt: salt,
                    ..Default::default()
                };
                let len = prompt.len();
                match s.add_request(&id, prompt, params, options) {
                    Ok(()) => outcome.insert(id.clone(), "pending"),
                    Err(_) => {
                        // A sliding group's pages leave fewer tokens to a sequence of a tiny pool.
                        prop_assert!(len >= max_model_len, "{len} tokens refused");
                        outcome.insert(id.clone(), "rejected")
                    }
                };
            }
            if spec.abort_at == Some(t) && s.contains(&id) {
                s.abort(&id).unwrap();
                outcome.insert(id.clone(), "aborted");
            }
            if spec.finish_sample_at == Some(t) && s.contains(&id) {
                let _ = s.finish_sample(&id, 1); // refused unless sample 1 lives beside another
            }
        }
        s.check_invariants().map_err(TestCaseError::fail)?;
        if t > 150 && !s.has_unfinished() {
            break;
        }
        let produced = tier_step(&mut s, &world, &roots, &mut known);
        for id in &produced.finished_requests {
            prop_assert_eq!(outcome.get(&**id).copied(), Some("pending"));
            outcome.insert(id.to_string(), "finished");
        }
        check_one_content_per_hash(&s, &world, &known);
        if events {
            assert_replay_matches(&mut s, &mut set);
        }
        // The I/O thread also runs while the model computes.
        let jobs = rng.random_range(0..3);
        world.lock().unwrap().progress(jobs);
    }
    prop_assert!(!s.has_unfinished(), "requests left after 3000 steps");
    prop_assert!(
        outcome.values().all(|&o| o != "pending"),
        "lost requests: {:?}",
        outcome
    );

    // Quiesce: the last loads end, the last offloads return.
    s.flush_tier();
    tier_step(&mut s, &world, &roots, &mut known);
    s.flush_tier();
    s.blocks
        .manager_mut()
        .check_free_list()
        .map_err(TestCaseError::fail)?;
    let stats = s.stats();
    let blocks = s.block_manager().stats();
    let w = world.lock().unwrap();
    prop_assert!(w.errors.is_empty(), "{:?}", w.errors);
    prop_assert_eq!(
        (
            blocks.used_blocks,
            blocks.loading_blocks,
            blocks.offloading_blocks
        ),
        (0, 0, 0)
    );
    prop_assert_eq!(blocks.free_blocks + blocks.cached_blocks, num_blocks);
    prop_assert_eq!(stats.offloads_issued, w.counters.offloads);
    prop_assert_eq!(stats.loads_issued, w.counters.loads);
    prop_assert_eq!(stats.loads_dropped, w.dropped);
    prop_assert_eq!(stats.tier, w.counters);
    Ok(stats)
}

/// The parent and tokens of every full block a sequence ever had, by hash.
type Known = HashMap<BlockHash, (BlockHash, Vec<TokenId>)>;

fn learn(known: &mut Known, root: BlockHash, tokens: &[TokenId], groups: &[GroupKeeping]) {
    for (g, kept) in groups.iter().enumerate() {
        let (root, bs) = (group_root(root, g), kept.block_size);
        let hashes = block_hashes(root, tokens, bs);
        for (i, &hash) in hashes.iter().enumerate() {
            let parent = if i == 0 { root } else { hashes[i - 1] };
            known.insert(hash, (parent, tokens[i * bs..][..bs].to_vec()));
        }
    }
}

/// Every block findable in RAM holds the content its hash claims; an uncorrupted tier entry too,
/// so a hash held in both has the same content in both.
fn check_one_content_per_hash(s: &Scheduler, world: &Mutex<World>, known: &Known) {
    let findable = s.kv_blocks(); // before locking: it asks the tier
    let w = world.lock().unwrap();
    for (hash, medium, _) in findable {
        let (parent, tokens) = &known[&hash];
        let claimed = block_kv(*parent, tokens);
        let held = match medium {
            Medium::Ram => {
                let block = s.block_manager().cached_block(hash).expect("findable");
                w.ram[block as usize * w.page..][..tokens.len()].to_vec()
            }
            Medium::Disk if w.store[&hash].corrupt => continue,
            Medium::Disk => w.store[&hash].content.clone(),
        };
        assert_eq!(
            held, claimed,
            "{hash:x} in {medium:?} does not hold its content"
        );
    }
}
