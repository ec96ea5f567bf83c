//! Criterion benches of the paged-attention kernel: decode with K/V resident in L2 (the compute
//! rate of each kernel path), decode from memory on a shuffled table vs contiguous K/V, the same
//! with a sliding window (throughput counts the bytes the window reads: a windowed call should
//! read them at the rate a full one does), and prefill. The bandwidth-vs-machine comparison lives
//! in `python -m lab bench attention`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pagedkv::compute::attention::{default_isa, paged_attention_with, ContiguousKv, ISAS};
use pagedkv::compute::cpu::Isa;
use pagedkv::{AttentionBatch, KvCache, KvDtype, KvShape};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;

struct Setup {
    cache: KvCache,
    tables: Vec<i32>,
    width: usize,
    contexts: Vec<i32>,
    query_start_loc: Vec<i32>,
    q: Vec<f32>,
}

impl Setup {
    fn new(
        dtype: KvDtype,
        kv_heads: usize,
        batch: usize,
        context: usize,
        new_tokens: usize,
        block_size: usize,
        shuffle: bool,
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(7);
        let width = context.div_ceil(block_size);
        let num_blocks = batch * width;
        let shape = KvShape {
            num_layers: 1,
            num_blocks,
            block_size,
            num_kv_heads: kv_heads,
            head_dim: HEAD_DIM,
        };
        let mut cache = KvCache::new(shape, dtype).unwrap();
        cache.fill_random(3);
        let mut tables: Vec<i32> = (0..num_blocks as i32).collect();
        if shuffle {
            tables.shuffle(&mut rng);
        }
        let heads = kv_heads * HEADS / KV_HEADS;
        let q = (0..batch * new_tokens * heads * HEAD_DIM)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        Setup {
            cache,
            tables,
            width,
            contexts: vec![context as i32; batch],
            query_start_loc: (0..=batch).map(|i| (i * new_tokens) as i32).collect(),
            q,
        }
    }

    fn heads(&self) -> usize {
        self.cache.shape().num_kv_heads * HEADS / KV_HEADS
    }

    fn run(&self, path: Isa, window: Option<usize>, out: &mut [f32]) {
        let batch = AttentionBatch {
            block_tables: &self.tables,
            max_blocks_per_seq: self.width,
            context_lens: &self.contexts,
            query_start_loc: &self.query_start_loc,
        };
        paged_attention_with(
            path,
            &self.cache,
            0,
            black_box(&self.q),
            self.heads(),
            &batch,
            0.088,
            window,
            out,
        )
        .unwrap();
    }
}

fn paths() -> Vec<Isa> {
    Isa::available_of(&ISAS)
}

/// One KV head, 256 keys (256 KiB of f32 K/V): stays in the 512 KiB L2, so this is the loop's
/// compute rate.
fn decode_in_cache(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_in_cache");
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let setup = Setup::new(dtype, 1, 1, 256, 1, 16, true);
        let mut out = vec![0.0; setup.q.len()];
        group.throughput(Throughput::Bytes(
            (2 * 256 * HEAD_DIM * dtype.size_of()) as u64,
        ));
        for path in paths() {
            group.bench_function(BenchmarkId::new(dtype.name(), path.name()), |b| {
                b.iter(|| setup.run(path, None, &mut out))
            });
        }
    }
    group.finish();
}

/// Batch 16 × context 2048, 8 KV heads (256 MiB of f32 K/V): memory-bound, paged vs contiguous.
fn decode_from_memory(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_from_memory");
    group.sample_size(10);
    let (batch, context) = (16, 2048);
    for block_size in [16, 128] {
        let setup = Setup::new(KvDtype::F32, KV_HEADS, batch, context, 1, block_size, true);
        let mut out = vec![0.0; setup.q.len()];
        group.throughput(Throughput::Bytes(
            (2 * batch * context * KV_HEADS * HEAD_DIM * 4) as u64,
        ));
        let path = default_isa();
        group.bench_function(BenchmarkId::new("paged_shuffled", block_size), |b| {
            b.iter(|| setup.run(path, None, &mut out))
        });
        let contiguous =
            ContiguousKv::random(KvDtype::F32, batch, KV_HEADS, context, HEAD_DIM, 5).unwrap();
        group.bench_function(BenchmarkId::new("contiguous", block_size), |b| {
            b.iter(|| {
                contiguous
                    .attention(
                        path,
                        &setup.q,
                        HEADS,
                        &setup.contexts,
                        &setup.query_start_loc,
                        block_size,
                        0.088,
                        None,
                        &mut out,
                    )
                    .unwrap()
            })
        });
    }
    group.finish();
}

/// The batch of `decode_from_memory` through a sliding window of 512 of its 2048 tokens (Gemma
/// 3's local layers attend over 1024): a quarter of the blocks, read at the same rate.
fn decode_window_from_memory(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_window_from_memory");
    group.sample_size(10);
    let (batch, context, window) = (16, 2048, 512);
    for block_size in [16, 128] {
        let setup = Setup::new(KvDtype::F32, KV_HEADS, batch, context, 1, block_size, true);
        let mut out = vec![0.0; setup.q.len()];
        // The window starts on a block boundary for both sizes: it reads `window` keys exactly.
        group.throughput(Throughput::Bytes(
            (2 * batch * window * KV_HEADS * HEAD_DIM * 4) as u64,
        ));
        let path = default_isa();
        group.bench_function(BenchmarkId::new("paged_shuffled", block_size), |b| {
            b.iter(|| setup.run(path, Some(window), &mut out))
        });
    }
    group.finish();
}

/// Prefill of 512 new tokens, no cached prefix: compute-bound; throughput in useful FLOPs.
fn prefill(c: &mut Criterion) {
    let mut group = c.benchmark_group("prefill");
    group.sample_size(10);
    let n = 512;
    let setup = Setup::new(KvDtype::F32, KV_HEADS, 1, n, n, 16, true);
    let mut out = vec![0.0; setup.q.len()];
    let flops = 4 * HEAD_DIM * HEADS * (n * (n + 1) / 2);
    group.throughput(Throughput::Elements(flops as u64));
    for path in paths() {
        group.bench_function(BenchmarkId::new("n512_flops", path.name()), |b| {
            b.iter(|| setup.run(path, None, &mut out))
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    decode_in_cache,
    decode_from_memory,
    decode_window_from_memory,
    prefill
);
criterion_main!(benches);
