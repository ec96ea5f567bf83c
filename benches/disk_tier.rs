//! Criterion bench of the disk tier's load path, as the scheduler sees it: `load` of one stored
//! block, verified and written into RAM, until its `LoadDone` is taken (`flush` +
//! `completed_loads`), from the page cache ("warm") and with the data file dropped from it by
//! `posix_fadvise(DONTNEED)` before every load ("cold"; in a VM the host may still cache it).
//! Shapes: the built-in tiny model (4 layers, 2 KV heads, head_dim 32) and SmolLM2-135M (30
//! layers, 3 KV heads, head_dim 64), block 16, float16 and float32. Criterion's throughput is the
//! block's bytes per load.

use std::os::fd::AsRawFd;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pagedkv::disk::{DiskTier, DiskTierConfig};
use pagedkv::lru::EvictionPolicy;
use pagedkv::tier::{KvTier, LoadJob, LoadOutcome, OffloadJob, TierLink};
use pagedkv::{FreeList, KvCache, KvDtype, KvShape};

/// Blocks stored, then loaded in turn (so successive warm loads do not hit one cached page run).
const STORED: u32 = 16;

fn shape(num_layers: usize, num_kv_heads: usize, head_dim: usize) -> KvShape {
    KvShape {
        num_layers,
        num_blocks: 2 * STORED as usize,
        block_size: 16,
        num_kv_heads,
        head_dim,
    }
}

fn tokens(i: u32) -> Vec<u32> {
    vec![i; 16]
}

/// A tier holding `STORED` blocks of a random cache, its data file, and the cache.
fn stored_tier(name: &str, shape: KvShape, dtype: KvDtype) -> (DiskTier, std::fs::File, KvCache) {
    let dir =
        std::env::temp_dir().join(format!("pagedkv-bench-tier-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut kv = KvCache::new(shape, dtype).unwrap();
    kv.fill_random(1);
    let free = Arc::new(FreeList::full(shape.num_blocks).unwrap());
    while free.pop().is_some() {}
    let link = TierLink {
        free,
        returned: Arc::new(AtomicUsize::new(0)),
    };
    let config = DiskTierConfig {
        identity: b"bench".to_vec(),
        capacity_bytes: STORED as u64 * kv.slot_bytes() as u64,
        policy: EvictionPolicy::Lru,
    };
    // SAFETY: blocks 0..STORED are only offloaded, STORED.. only loaded, one job at a time.
    let (mut tier, _) = unsafe { DiskTier::open(&dir, config, kv.block_io(), link) }.unwrap();
    for i in 0..STORED {
        tier.offload(OffloadJob {
            block: i,
            hash: i as u128 + 1,
            parent: 0,
            tokens: tokens(i),
        });
    }
    tier.flush();
    assert_eq!(tier.counters().offloads, STORED as u64);
    let data = std::fs::File::open(dir.join("blocks.dat")).unwrap();
    (tier, data, kv)
}

fn load(tier: &mut DiskTier, i: u32) {
    tier.load(LoadJob {
        block: STORED + i,
        hash: i as u128 + 1,
        parent: 0,
        tokens: tokens(i),
    });
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
            let (mut tier, data, _kv) = stored_tier(model, shape, dtype);
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

criterion_group! {
    name = benches;
    config = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500));
    targets = load_one_block
}
criterion_main!(benches);
