//! Criterion bench of the disk tier, as the scheduler sees it:
//! - `disk_tier_load_block`: `load` of one stored block, verified and written into RAM, until its
//!   `LoadDone` is taken (`flush` + `completed_loads`), from the page cache ("warm") and with the
//!   data file dropped from it by `posix_fadvise(DONTNEED)` before every load ("cold"; in a VM the
//!   host may still cache it). Criterion's throughput is the block's bytes per load.
//! - `disk_tier_load_behind_stores`: the same load sent right after 32 offloads, timed until its
//!   `LoadDone` arrives (polled, the stores still running): the wait a prefix hit pays behind
//!   evictions.
//! - `disk_tier_store`: `DiskStore` storing one group's worth of blocks into a full store
//!   (evicting), one by one (`store`) or as one group (`store_group`); throughput in blocks.
//!
//! Shapes: the built-in tiny model (4 layers, 2 KV heads, head_dim 32) and SmolLM2-135M (30
//! layers, 3 KV heads, head_dim 64), block 16, float16 and float32.

use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pagedkv::memory::eviction::EvictionPolicy;
use pagedkv::memory::prefix_cache::BlockKey;
use pagedkv::tier::disk::tier::{MAX_GROUP_BLOCKS, MAX_GROUP_BYTES};
use pagedkv::tier::disk::{DiskStore, DiskTier, DiskTierConfig, NewBlock};
use pagedkv::tier::{KvTier, LoadJob, LoadOutcome, OffloadJob, TierLink};
use pagedkv::{FreeList, KvCache, KvDtype, KvShape};

/// Blocks stored, then loaded in turn (so successive warm loads do not hit one cached page run).
const STORED: u32 = 16;

/// Offloads queued ahead of the load of `disk_tier_load_behind_stores`.
const AHEAD: u32 = 32;

fn shape(num_layers: usize, num_kv_heads: usize, head_dim: usize) -> KvShape {
    KvShape {
        num_layers,
        // Blocks 0..STORED are offloaded, STORED..2 STORED loaded into, the rest offloaded again
        // and again (`disk_tier_load_behind_stores`).
        num_blocks: (2 * STORED + AHEAD) as usize,
        block_size: 16,
        num_kv_heads,
        head_dim,
    }
}

fn tokens(i: u32) -> Vec<u32> {
    vec![i; 16]
}

/// A tier holding `STORED` blocks of a random cache (room for `capacity` blocks), its data file,
/// the cache, and the tier's free list.
fn stored_tier(
    name: &str,
    shape: KvShape,
    dtype: KvDtype,
    capacity: u32,
) -> (DiskTier, std::fs::File, KvCache, Arc<FreeList>) {
    let dir =
        std::env::temp_dir().join(format!("pagedkv-bench-tier-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut kv = KvCache::new(shape, dtype).unwrap();
    kv.fill_random(1);
    let free = Arc::new(FreeList::full(shape.num_blocks).unwrap());
    while free.pop().is_some() {}
    let link = TierLink {
        free: Arc::clone(&free),
        returned: Arc::new(AtomicUsize::new(0)),
    };
    let config = DiskTierConfig {
        identity: b"bench".to_vec(),
        capacity_bytes: capacity as u64 * kv.slot_bytes() as u64,
        policy: EvictionPolicy::Lru,
    };
    // SAFETY: blocks 0..STORED and 2 STORED.. are only offloaded (2 STORED.. again only once back
    // on the free list), STORED..2 STORED only loaded, one load at a time.
    let (mut tier, _) = unsafe { DiskTier::open(&dir, config, kv.block_io(), link) }.unwrap();
    for i in 0..STORED {
        tier.offload(OffloadJob {
            block: i,
            key: BlockKey {
                hash: i as u128 + 1,
                parent: 0,
                tokens: tokens(i).into(),
            },
            group: 0,
        });
    }
    tier.flush();
    assert_eq!(tier.counters().offloads, STORED as u64);
    let data = std::fs::File::open(dir.join("blocks.dat")).unwrap();
    (tier, data, kv, free)
}

fn load_job(i: u32) -> LoadJob {
    LoadJob {
        block: STORED + i,
        key: BlockKey {
            hash: i as u128 + 1,
            parent: 0,
            tokens: tokens(i).into(),
        },
        group: 0,
    }
}

fn load(tier: &mut DiskTier, i: u32) {
    tier.load(load_job(i));
    tier.flush();
    let done = tier.completed_loads();
    assert_eq!(done[0].outcome, LoadOutcome::Loaded);
}

fn load_one_block(c: &mut Criterion) {
    let mut group = c.benchmark_group("disk_tier_load_block");
    group.sample_size(10);
    let models = [
        ("tiny", shape(4, 2, 32)),
        ("smollm2_135m", shape(30, 3, 64)),
    ];
    for (model, shape) in models {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let (mut tier, data, _kv, _) = stored_tier(model, shape, dtype, STORED);
            group.throughput(Throughput::Bytes(shape.slot_bytes(dtype) as u64));
            let name = format!("{model}/{}", dtype.name());
            group.bench_function(BenchmarkId::new("warm", &name), |b| {
                let mut i = 0;
                b.iter(|| {
                    load(&mut tier, i % STORED);
                    i += 1;
                })
            });
            group.bench_function(BenchmarkId::new("cold", &name), |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for i in 0..iters {
                        // SAFETY: a plain syscall on an open descriptor.
                        let advised = unsafe {
                            libc::posix_fadvise(data.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED)
                        };
                        assert_eq!(advised, 0);
                        let start = Instant::now();
                        load(&mut tier, i as u32 % STORED);
                        total += start.elapsed();
                    }
                    total
                })
            });
        }
    }
    group.finish();
}

/// Queues the offloads of round `round` (fresh hashes) from blocks `2 STORED..`.
fn offload_round(tier: &mut DiskTier, round: u128) {
    for k in 0..AHEAD {
        tier.offload(OffloadJob {
            block: 2 * STORED + k,
            key: BlockKey {
                hash: (round << 32) + k as u128,
                parent: 0,
                tokens: tokens(k).into(),
            },
            group: 0,
        });
    }
}

/// A load of a block of the previous round, sent right after `AHEAD` offloads of this round,
/// until its `LoadDone` (the stores still running; they are flushed, untimed, before the next
/// one). The tier has room for two rounds and the stored blocks, so each store writes and evicts
/// as in steady state, and the previous round's blocks stay.
fn load_behind_stores(c: &mut Criterion) {
    let mut group = c.benchmark_group("disk_tier_load_behind_stores");
    group.sample_size(10);
    let shape = shape(30, 3, 64);
    let (mut tier, _, _kv, free) = stored_tier("behind", shape, KvDtype::F16, STORED + 2 * AHEAD);
    let mut round = 1u128;
    offload_round(&mut tier, round);
    tier.flush();
    while free.pop().is_some() {} // the offloaded blocks, back for the next round
    group.bench_function("smollm2_135m/f16/32_offloads_ahead", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                round += 1;
                offload_round(&mut tier, round);
                let k = i as u32 % AHEAD;
                let start = Instant::now();
                tier.load(LoadJob {
                    block: STORED + k % STORED,
                    key: BlockKey {
                        hash: ((round - 1) << 32) + k as u128,
                        parent: 0,
                        tokens: tokens(k).into(),
                    },
                    group: 0,
                });
                let done = loop {
                    let done = tier.completed_loads();
                    if !done.is_empty() {
                        break done;
                    }
                    std::thread::yield_now();
                };
                total += start.elapsed();
                assert_eq!(done[0].outcome, LoadOutcome::Loaded);
                tier.flush();
                while free.pop().is_some() {}
            }
            total
        })
    });
    group.finish();
}

/// One group's worth of blocks stored into a full `DiskStore`, one by one and as one group.
fn store_blocks(c: &mut Criterion) {
    let mut group = c.benchmark_group("disk_tier_store");
    group.sample_size(10);
    let models = [
        ("tiny", shape(4, 2, 32)),
        ("smollm2_135m", shape(30, 3, 64)),
    ];
    for (model, shape) in models {
        let slot = shape.slot_bytes(KvDtype::F16);
        let size = (MAX_GROUP_BYTES / slot).clamp(1, MAX_GROUP_BLOCKS);
        let dir = std::env::temp_dir().join(format!(
            "pagedkv-bench-store-{model}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let capacity = 2 * size as u64;
        let (mut store, _) = DiskStore::open(
            &dir,
            b"bench",
            slot,
            capacity * slot as u64,
            EvictionPolicy::Lru,
        )
        .unwrap();
        let data: Vec<u8> = (0..slot).map(|b| (b * 7) as u8).collect();
        let toks = tokens(0);
        let mut next = 0u128;
        let mut fresh = |count: usize| -> Vec<NewBlock<'_>> {
            (0..count)
                .map(|_| {
                    next += 1;
                    NewBlock {
                        hash: next,
                        parent: 0,
                        group: 0,
                        tokens: &toks,
                        data: &data,
                    }
                })
                .collect()
        };
        store.store_group(&fresh(capacity as usize)).unwrap(); // full: every store evicts
        group.throughput(Throughput::Elements(size as u64));
        let name = format!("{model}/f16/{size}_blocks");
        group.bench_function(BenchmarkId::new("one_by_one", &name), |b| {
            b.iter(|| {
                for block in fresh(size) {
                    assert!(store.store(block).unwrap());
                }
            })
        });
        group.bench_function(BenchmarkId::new("grouped", &name), |b| {
            b.iter(|| {
                let stored = store.store_group(&fresh(size)).unwrap();
                assert!(stored.iter().all(|&s| s));
            })
        });
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    targets = load_one_block, load_behind_stores, store_blocks
}
criterion_main!(benches);
