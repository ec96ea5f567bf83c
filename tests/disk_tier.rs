//! The disk tier behind `KvTier`: offload then load round-trips a block's bytes exactly (f32, f16,
//! bf16); a scheduler thread allocating and freeing on the shared free list while the I/O thread
//! returns offloaded blocks loses and duplicates no id, and its count never runs ahead of the
//! list; reopening recovers the blocks and says so in events; another identity or dtype clears
//! the tier; flipped and truncated data are dropped (counted), never served; a full tier evicts
//! with `BlockRemoved`; bad block ids fail their job, not the tier; loads queued behind many
//! offloads are served before the stores, a load of a block whose store is queued is served from
//! the queued copy, and a missing block counts as a miss, not as corrupt. Every test checks that
//! replaying the tier's events gives `stored_blocks`, and runs under a timeout.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use pagedkv::memory::events::{KvEvent, Medium};
use pagedkv::memory::eviction::EvictionPolicy;
use pagedkv::memory::prefix_cache::BlockKey;
use pagedkv::tier::disk::{DiskTier, DiskTierConfig, Opened};
use pagedkv::tier::{KvTier, LoadDone, LoadJob, LoadOutcome, OffloadJob, TierLink};
use pagedkv::{FreeList, KvCache, KvDtype, KvShape};

const SHAPE: KvShape = KvShape {
    num_layers: 2,
    num_blocks: 16,
    block_size: 4,
    num_kv_heads: 2,
    head_dim: 8,
};

/// Runs `test` on its own thread and fails if it takes longer than `seconds`.
fn with_timeout(seconds: u64, test: impl FnOnce() + Send + 'static) {
    let (done, finished) = mpsc::channel();
    let runner = std::thread::spawn(move || {
        test();
        let _ = done.send(());
    });
    match finished.recv_timeout(Duration::from_secs(seconds)) {
        Ok(()) => runner.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(runner.join().unwrap_err())
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("timed out after {seconds} s"),
    }
}

fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pagedkv-tier-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A cache of `dtype` with random contents, and a free list of its blocks all held (popped), as
/// a pool whose blocks are in use.
fn cache(dtype: KvDtype) -> (KvCache, TierLink) {
    cache_of(SHAPE, dtype)
}

fn cache_of(shape: KvShape, dtype: KvDtype) -> (KvCache, TierLink) {
    let mut kv = KvCache::new(shape, dtype).unwrap();
    kv.fill_random(7);
    let free = Arc::new(FreeList::full(shape.num_blocks).unwrap());
    while free.pop().is_some() {}
    let link = TierLink {
        free,
        returned: Arc::new(AtomicUsize::new(0)),
    };
    (kv, link)
}

fn config(identity: &[u8], blocks: u64, dtype: KvDtype) -> DiskTierConfig {
    DiskTierConfig {
        identity: identity.to_vec(),
        capacity_bytes: blocks * SHAPE.slot_bytes(dtype) as u64,
        policy: EvictionPolicy::Slru,
    }
}

fn open(dir: &Path, config: DiskTierConfig, kv: &KvCache, link: &TierLink) -> (DiskTier, Opened) {
    // SAFETY: each test touches a block only after `flush`, with no job on it in flight.
    unsafe { DiskTier::open(dir, config, kv.block_io(), link.clone()) }.unwrap()
}

/// Prefix hash, parent and tokens of test block `i`, of KV cache group `group_of(hash)`.
fn offload_job(block: u32, i: u32) -> OffloadJob {
    let hash = 1000 + i as u128;
    OffloadJob {
        block,
        key: BlockKey {
            hash,
            parent: i as u128,
            tokens: vec![i; SHAPE.block_size].into(),
        },
        group: group_of(hash),
    }
}

/// The KV cache group of test block `hash` (two groups: the tier records and reports each).
fn group_of(hash: u128) -> u32 {
    (hash % 2) as u32
}

fn load_job(block: u32, i: u32) -> LoadJob {
    let job = offload_job(block, i);
    LoadJob {
        block,
        key: job.key,
        group: job.group,
    }
}

fn bytes_of(kv: &KvCache, block: u32) -> Vec<u8> {
    let mut out = vec![0; kv.slot_bytes()];
    // SAFETY: called after `flush`: no job of the tier touches `block`.
    unsafe { kv.block_io().read_block(block, &mut out) }.unwrap();
    out
}

/// Flushes, then returns the loads completed.
fn flushed_loads(tier: &mut DiskTier) -> Vec<LoadDone> {
    tier.flush();
    let mut done = tier.completed_loads();
    done.sort_by_key(|d| d.block);
    done
}

/// Replays `events` over `set` (the `Disk` medium only: a tier emits no other).
fn replay(set: &mut HashSet<u128>, events: &[KvEvent]) {
    for event in events {
        match event {
            KvEvent::BlockStored { key, medium, group } => {
                assert_eq!((*medium, *group), (Medium::Disk, group_of(key.hash)));
                let hash = key.hash;
                assert!(set.insert(hash), "stored twice without a removal: {hash}");
            }
            KvEvent::BlockRemoved {
                hash,
                medium,
                group,
            } => {
                assert_eq!((*medium, *group), (Medium::Disk, group_of(*hash)));
                assert!(set.remove(hash), "removed without being stored: {hash}");
            }
            KvEvent::AllBlocksCleared { medium } => {
                assert_eq!(*medium, Medium::Disk);
                set.clear();
            }
        }
    }
}

/// Drains the tier's events, replays them over `set`, checks the result is `stored_blocks`, and
/// returns the events.
fn check_events(tier: &mut DiskTier, set: &mut HashSet<u128>) -> Vec<KvEvent> {
    let mut events = Vec::new();
    tier.drain_events(&mut events);
    replay(set, &events);
    let stored: HashSet<(u128, u32)> = tier.stored_blocks().into_iter().collect();
    let replayed: HashSet<(u128, u32)> = set.iter().map(|&h| (h, group_of(h))).collect();
    assert_eq!(
        replayed, stored,
        "replayed events differ from the stored set"
    );
    events
}

#[test]
fn offload_then_load_round_trips_every_dtype_exactly() {
    with_timeout(60, || {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
            let dir = fresh_dir(&format!("roundtrip-{}", dtype.name()));
            let (kv, link) = cache(dtype);
            let (mut tier, opened) = open(&dir, config(b"m", 8, dtype), &kv, &link);
            assert_eq!((opened.recovered, opened.cleared), (0, false));
            let originals: Vec<Vec<u8>> = (0..3).map(|b| bytes_of(&kv, b)).collect();
            assert_ne!(originals[0], originals[1], "random blocks differ");
            for b in 0..3 {
                tier.offload(offload_job(b, b));
                assert!(tier.contains(1000 + b as u128), "pending counts as held");
            }
            tier.flush();
            assert_eq!(link.returned.load(Ordering::Acquire), 3);
            let returned: HashSet<u32> = std::iter::from_fn(|| link.free.pop()).collect();
            assert_eq!(returned, HashSet::from([0, 1, 2]));
            // Load each into another block (10..13), whose bytes were different.
            for i in 0..3 {
                assert_ne!(bytes_of(&kv, 10 + i), originals[i as usize]);
                tier.load(load_job(10 + i, i));
            }
            let done = flushed_loads(&mut tier);
            let loaded: Vec<_> = (10..13)
                .map(|block| LoadDone {
                    block,
                    outcome: LoadOutcome::Loaded,
                })
                .collect();
            assert_eq!(done, loaded);
            for i in 0..3 {
                assert_eq!(bytes_of(&kv, 10 + i), originals[i as usize], "{dtype:?}");
            }
            let c = tier.counters();
            assert_eq!(
                (c.offloads, c.loads, c.blocks, c.dropped_corrupt),
                (3, 3, 3, 0)
            );
            assert_eq!(c.bytes_written, 3 * kv.slot_bytes() as u64);
            assert_eq!(c.bytes_read, 3 * kv.slot_bytes() as u64);
            assert!(tier.completed_loads().is_empty(), "each load reported once");
            let events = check_events(&mut tier, &mut HashSet::new());
            assert_eq!(
                events[0],
                KvEvent::BlockStored {
                    key: offload_job(0, 0).key,
                    medium: Medium::Disk,
                    group: 0,
                }
            );
            drop(tier);
            std::fs::remove_dir_all(&dir).unwrap();
        }
    });
}

/// The scheduler side of a pool: pops (allocates) and pushes (frees clean) on the shared list,
/// and evicts held blocks to the tier, whose thread pushes them back concurrently. Its count of
/// clean blocks (its own pushes plus `returned`) must never exceed the list: every pop it makes
/// while the count is positive succeeds.
#[test]
fn free_list_shared_with_the_io_thread_loses_and_duplicates_no_id() {
    with_timeout(60, || {
        let dir = fresh_dir("shared-free-list");
        let (kv, link) = cache(KvDtype::F16);
        let (mut tier, _) = open(&dir, config(b"m", 6, KvDtype::F16), &kv, &link);
        let mut held: Vec<u32> = (0..SHAPE.num_blocks as u32).collect();
        let mut is_held = [true; SHAPE.num_blocks];
        let mut clean = 0usize;
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let (mut offloads, mut reused) = (0u32, 0usize);
        while offloads < 150 {
            clean += link.returned.swap(0, Ordering::Acquire);
            match next() % 8 {
                // Evict a held block to the tier (offloading: held by nobody until returned).
                0 | 1 if !held.is_empty() => {
                    let block = held.swap_remove(next() as usize % held.len());
                    is_held[block as usize] = false;
                    tier.offload(offload_job(block, offloads));
                    offloads += 1;
                }
                // Free a held block clean.
                2 if !held.is_empty() => {
                    let block = held.swap_remove(next() as usize % held.len());
                    is_held[block as usize] = false;
                    link.free.push(block);
                    clean += 1;
                }
                // Allocate.
                _ if clean > 0 => {
                    let block = link.free.pop().expect("the count ran ahead of the list");
                    assert!(!is_held[block as usize], "block {block} handed out twice");
                    is_held[block as usize] = true;
                    held.push(block);
                    clean -= 1;
                    reused += 1;
                }
                _ => std::thread::yield_now(),
            }
        }
        tier.flush();
        clean += link.returned.swap(0, Ordering::Acquire);
        let on_list: Vec<u32> = std::iter::from_fn(|| link.free.pop()).collect();
        assert_eq!(on_list.len(), clean, "the count and the list agree");
        let mut all: Vec<u32> = on_list.into_iter().chain(held).collect();
        all.sort_unstable();
        assert_eq!(all, (0..SHAPE.num_blocks as u32).collect::<Vec<_>>());
        let c = tier.counters();
        assert!(
            reused > 2 * SHAPE.num_blocks,
            "blocks the I/O thread returned were reallocated ({reused} allocations)"
        );
        assert_eq!(c.offloads + c.offloads_lost, offloads as u64);
        assert_eq!(c.blocks, 6, "a full tier");
        assert_eq!(c.evictions, c.offloads - 6);
        check_events(&mut tier, &mut HashSet::new());
        drop(tier);
        std::fs::remove_dir_all(&dir).unwrap();
    });
}

#[test]
fn a_reopened_tier_recovers_its_blocks_and_replays_them_as_events() {
    with_timeout(60, || {
        let dir = fresh_dir("reopen");
        let (kv, link) = cache(KvDtype::F32);
        let originals: Vec<Vec<u8>> = (0..4).map(|b| bytes_of(&kv, b)).collect();
        let (mut tier, _) = open(&dir, config(b"m", 8, KvDtype::F32), &kv, &link);
        for b in 0..4 {
            tier.offload(offload_job(b, b));
        }
        drop(tier); // finishes every queued job
        let (mut tier, opened) = open(&dir, config(b"m", 8, KvDtype::F32), &kv, &link);
        assert_eq!((opened.recovered, opened.cleared), (4, false));
        let events = check_events(&mut tier, &mut HashSet::new());
        let expected: Vec<KvEvent> = (0..4)
            .map(|i| KvEvent::BlockStored {
                key: offload_job(i, i).key,
                medium: Medium::Disk,
                group: i % 2,
            })
            .collect();
        assert_eq!(events, expected);
        assert!((0..4).all(|i| tier.contains(1000 + i)));
        assert!(!tier.contains(1004));
        tier.load(load_job(12, 3));
        assert_eq!(flushed_loads(&mut tier)[0].outcome, LoadOutcome::Loaded);
        assert_eq!(bytes_of(&kv, 12), originals[3]);
        drop(tier);
        std::fs::remove_dir_all(&dir).unwrap();
    });
}

#[test]
fn a_tier_of_another_identity_or_dtype_is_cleared() {
    with_timeout(60, || {
        let dir = fresh_dir("identity");
        let (kv, link) = cache(KvDtype::F16);
        let (mut tier, _) = open(&dir, config(b"model-a", 8, KvDtype::F16), &kv, &link);
        tier.offload(offload_job(0, 0));
        drop(tier);
        let (mut tier, opened) = open(&dir, config(b"model-b", 8, KvDtype::F16), &kv, &link);
        assert_eq!((opened.recovered, opened.cleared), (0, true));
        let mut set = HashSet::from([1000]); // what a subscriber knew of the old tier
        let events = check_events(&mut tier, &mut set);
        assert_eq!(
            events,
            vec![KvEvent::AllBlocksCleared {
                medium: Medium::Disk,
            }]
        );
        assert!(!tier.contains(1000));
        tier.offload(offload_job(1, 0));
        drop(tier);
        // bf16 blocks are as large as f16 ones: only the layout identity tells them apart.
        let (bf16, bf16_link) = cache(KvDtype::Bf16);
        let (tier, opened) = open(
            &dir,
            config(b"model-b", 8, KvDtype::Bf16),
            &bf16,
            &bf16_link,
        );
        assert_eq!((opened.recovered, opened.cleared), (0, true));
        drop(tier);
        std::fs::remove_dir_all(&dir).unwrap();
    });
}

#[test]
fn flipped_and_truncated_blocks_are_dropped_and_counted_never_served() {
    with_timeout(60, || {
        let dir = fresh_dir("corrupt");
        let (kv, link) = cache(KvDtype::F16);
        let slot = kv.slot_bytes();
        let (mut tier, _) = open(&dir, config(b"m", 8, KvDtype::F16), &kv, &link);
        for b in 0..4 {
            tier.offload(offload_job(b, b)); // block i lands in slot i (lowest free first)
        }
        drop(tier);
        let data = dir.join("blocks.dat");
        let mut bytes = std::fs::read(&data).unwrap();
        assert_eq!(&bytes[slot..2 * slot], bytes_of(&kv, 1).as_slice());
        bytes[slot + 5] ^= 0x40;
        bytes.truncate(3 * slot - 1); // cuts block 2 short, block 3 away
        std::fs::write(&data, &bytes).unwrap();
        let (mut tier, opened) = open(&dir, config(b"m", 8, KvDtype::F16), &kv, &link);
        assert_eq!(opened.recovered, 4, "the index does not know yet");
        let mut set = HashSet::new();
        check_events(&mut tier, &mut set);
        let before: Vec<Vec<u8>> = (8..13).map(|b| bytes_of(&kv, b)).collect();
        for i in 0..4 {
            tier.load(load_job(8 + i, i));
        }
        tier.load(load_job(12, 99)); // never stored: a miss, not corrupt
        let outcomes: Vec<_> = flushed_loads(&mut tier).iter().map(|d| d.outcome).collect();
        use LoadOutcome::{Dropped, Loaded};
        assert_eq!(outcomes, [Loaded, Dropped, Dropped, Dropped, Dropped]);
        assert_eq!(bytes_of(&kv, 8), bytes_of(&kv, 0));
        for b in 9..13 {
            assert_eq!(
                bytes_of(&kv, b),
                before[b as usize - 8],
                "block {b} untouched"
            );
        }
        let c = tier.counters();
        assert_eq!((c.dropped_corrupt, c.load_misses, c.blocks), (3, 1, 1));
        let events = check_events(&mut tier, &mut set);
        assert_eq!(
            events.len(),
            3,
            "one BlockRemoved per dropped entry: {events:?}"
        );
        assert_eq!(set, HashSet::from([1000]));
        drop(tier);
        std::fs::remove_dir_all(&dir).unwrap();
    });
}

#[test]
fn a_full_tier_evicts_with_block_removed() {
    with_timeout(60, || {
        let dir = fresh_dir("evict");
        let (kv, link) = cache(KvDtype::F32);
        let (mut tier, _) = open(&dir, config(b"m", 2, KvDtype::F32), &kv, &link);
        tier.offload(offload_job(0, 0));
        tier.offload(offload_job(1, 1));
        tier.flush();
        tier.load(load_job(5, 0)); // a hit protects block 0 (segmented LRU)
        tier.offload(offload_job(2, 2));
        tier.flush();
        let mut set = HashSet::new();
        let events = check_events(&mut tier, &mut set);
        assert!(events.contains(&KvEvent::BlockRemoved {
            hash: 1001,
            medium: Medium::Disk,
            group: 1,
        }));
        assert_eq!(set, HashSet::from([1000, 1002]));
        assert!(!tier.contains(1001));
        assert_eq!(tier.counters().evictions, 1);
        drop(tier);
        std::fs::remove_dir_all(&dir).unwrap();
    });
}

#[test]
fn jobs_with_bad_block_ids_fail_alone() {
    with_timeout(60, || {
        let dir = fresh_dir("bad-ids");
        let (kv, link) = cache(KvDtype::F32);
        let (mut tier, _) = open(&dir, config(b"m", 4, KvDtype::F32), &kv, &link);
        let outside = SHAPE.num_blocks as u32;
        tier.offload(offload_job(outside, 0));
        tier.offload(offload_job(1, 1));
        tier.load(load_job(outside, 1));
        let done = flushed_loads(&mut tier);
        assert_eq!(done[0].outcome, LoadOutcome::Dropped);
        let c = tier.counters();
        assert_eq!(
            (
                c.offloads,
                c.offloads_lost,
                c.dropped_corrupt,
                c.load_misses
            ),
            (1, 1, 0, 1),
            "a failed job is a miss, nothing corrupt"
        );
        assert_eq!(link.returned.load(Ordering::Acquire), 1, "only block 1");
        assert!(!tier.contains(1000) && tier.contains(1001));
        let (other, other_link) = cache(KvDtype::F32);
        let short = TierLink {
            free: Arc::new(FreeList::full(3).unwrap()),
            ..other_link
        };
        // SAFETY: the tier is never opened.
        let refused =
            unsafe { DiskTier::open(&dir, config(b"m", 4, KvDtype::F32), other.block_io(), short) };
        assert!(matches!(refused, Err(pagedkv::Error::InvalidArgument(_))));
        drop(tier);
        std::fs::remove_dir_all(&dir).unwrap();
    });
}

/// 96 offloads, then three loads: a stored block (verifies), a stored block asked with other
/// tokens (does not verify: dropped, its `BlockRemoved` marks when the loads ran), and the block
/// of the last offload (still queued). The loads run before the stores queued ahead of them: once
/// the loads are sent, at most one group of stores (the one under way) finishes before them. So
/// of the 96 `BlockStored` events, at most `stored + MAX_GROUP_BLOCKS` come before the
/// `BlockRemoved`, where `stored` is the offloads counter read just after sending (no wall time:
/// the event order is the clock).
#[test]
fn loads_queued_behind_offloads_run_before_the_stores() {
    with_timeout(60, || {
        const QUEUED: u32 = 96;
        let dir = fresh_dir("loads-first");
        let shape = KvShape {
            num_blocks: 128,
            ..SHAPE
        };
        let (kv, link) = cache_of(shape, KvDtype::F32);
        let (mut tier, _) = open(&dir, config(b"m", 128, KvDtype::F32), &kv, &link);
        let originals: Vec<Vec<u8>> = (0..shape.num_blocks as u32)
            .map(|b| bytes_of(&kv, b))
            .collect();
        tier.offload(offload_job(0, 0));
        tier.offload(offload_job(1, 1));
        tier.flush();
        let mut set = HashSet::new();
        check_events(&mut tier, &mut set);
        for i in 2..2 + QUEUED {
            tier.offload(offload_job(i, i));
        }
        tier.load(load_job(120, 0));
        let mut other_tokens = load_job(121, 1);
        let mut tokens = other_tokens.key.tokens.to_vec();
        tokens[0] += 1;
        other_tokens.key.tokens = tokens.into();
        tier.load(other_tokens);
        let last = 1 + QUEUED;
        tier.load(load_job(122, last));
        let stored = tier.counters().offloads - 2;
        let done = flushed_loads(&mut tier);
        use LoadOutcome::{Dropped, Loaded};
        let outcomes: Vec<_> = done.iter().map(|d| d.outcome).collect();
        assert_eq!(outcomes, [Loaded, Dropped, Loaded]);
        assert_eq!(bytes_of(&kv, 120), originals[0]);
        assert_eq!(
            bytes_of(&kv, 122),
            originals[last as usize],
            "the queued copy"
        );
        let events = check_events(&mut tier, &mut set);
        let removed = KvEvent::BlockRemoved {
            hash: 1001,
            medium: Medium::Disk,
            group: 1,
        };
        let at = events.iter().position(|e| *e == removed).expect("dropped");
        let stored_before = events[..at]
            .iter()
            .filter(|e| matches!(e, KvEvent::BlockStored { .. }))
            .count() as u64;
        let bound = stored + pagedkv::tier::disk::tier::MAX_GROUP_BLOCKS as u64;
        assert!(
            stored_before <= bound,
            "{stored_before} stores ran before the loads (at most {bound})"
        );
        let c = tier.counters();
        assert_eq!(
            (c.offloads, c.loads, c.dropped_corrupt, c.load_misses),
            (2 + QUEUED as u64, 2, 1, 0)
        );
        if bound < QUEUED as u64 {
            // The last offload was still queued when the loads ran: its load read no disk.
            assert_eq!(c.bytes_read, kv.slot_bytes() as u64);
        }
        assert_eq!(c.jobs_in_flight, 0);
        drop(tier);
        std::fs::remove_dir_all(&dir).unwrap();
    });
}
