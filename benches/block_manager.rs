//! Criterion benches of the memory manager: allocate+free on the free list (1 and 2 threads) and
//! through the block pool, prefix lookup, and fork + copy-on-write.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pagedkv::{BlockManager, BlockPool, FreeList};

fn allocate_free(c: &mut Criterion) {
    let mut group = c.benchmark_group("allocate_free");
    let list = FreeList::full(4096).unwrap();
    group.bench_function("free_list_pop_push_1_thread", |b| {
        b.iter(|| {
            let id = list.pop().unwrap();
            list.push(black_box(id));
        })
    });
    let mut pool = BlockPool::new(4096).unwrap();
    group.bench_function("block_pool_allocate_release_1_thread", |b| {
        b.iter(|| {
            let id = pool.allocate().unwrap();
            pool.release(black_box(id));
        })
    });
    // Both threads hammer the same list; the time reported is per pair per thread.
    group.bench_function("free_list_pop_push_2_threads", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            std::thread::scope(|scope| {
                for _ in 0..2 {
                    scope.spawn(|| {
                        for _ in 0..iters {
                            let id = list.pop().unwrap();
                            list.push(black_box(id));
                        }
                    });
                }
            });
            start.elapsed()
        })
    });
    group.finish();
}

fn prefix_lookup(c: &mut Criterion) {
    let mut manager = BlockManager::new(4096, 16, true).unwrap();
    let system_prompt: Vec<u32> = (0..1024).collect();
    manager.allocate(0, &system_prompt, None).unwrap();
    let mut prompt = system_prompt.clone();
    prompt.extend(5000..5100);
    c.bench_function("prefix_match_1124_tokens_64_blocks_hit", |b| {
        b.iter(|| black_box(manager.match_prefix(black_box(&prompt), None)))
    });
}

fn fork_and_copy_on_write(c: &mut Criterion) {
    let mut manager = BlockManager::new(4096, 16, true).unwrap();
    let prompt: Vec<u32> = (0..1000).collect();
    manager.allocate(0, &prompt, None).unwrap();
    c.bench_function("fork_1000_tokens_then_cow_append_then_free", |b| {
        b.iter(|| {
            manager.fork(0, 1).unwrap();
            let copy = manager.append(1, &[7]).unwrap();
            manager.free(1).unwrap();
            black_box(copy)
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = allocate_free, prefix_lookup, fork_and_copy_on_write
}
criterion_main!(benches);
