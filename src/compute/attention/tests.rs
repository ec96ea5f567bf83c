//! The kernel against a naive f64 reference that gathers K/V through the block tables, on every
//! kernel path and dtype, plus the plan's partitioning and argument validation.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::plan::Plan;
use super::*;
use crate::compute::cpu::set_num_threads;
use crate::store::kv_cache::KvShape;

/// A cache holding `contexts[i]` tokens of sequence i in shuffled physical blocks.
struct Fixture {
    cache: KvCache,
    tables: Vec<i32>,
    width: usize,
    contexts: Vec<i32>,
}

impl Fixture {
    fn new(
        rng: &mut StdRng,
        dtype: KvDtype,
        contexts: &[usize],
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        let width = contexts
            .iter()
            .map(|c| c.div_ceil(block_size))
            .max()
            .unwrap_or(0)
            .max(1)
            + 1;
        let needed: usize = contexts.iter().map(|c| c.div_ceil(block_size)).sum();
        let num_blocks = needed + 3;
        let shape = KvShape {
            num_layers: 2,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
        };
        let mut cache = KvCache::new(shape, dtype).unwrap();
        let mut physical: Vec<i32> = (0..num_blocks as i32).collect();
        physical.shuffle(rng);
        let mut tables = vec![-1; contexts.len() * width];
        let mut next = physical.into_iter();
        for (seq, &context) in contexts.iter().enumerate() {
            for block in 0..context.div_ceil(block_size) {
                tables[seq * width + block] = next.next().unwrap();
            }
            let slots: Vec<i64> = (0..context)
                .map(|p| {
                    tables[seq * width + p / block_size] as i64 * block_size as i64
                        + (p % block_size) as i64
                })
                .collect();
            let row = num_kv_heads * head_dim;
            let keys: Vec<f32> = (0..context * row)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let values: Vec<f32> = (0..context * row)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            cache.write(1, &keys, &values, &slots).unwrap();
        }
        Fixture {
            cache,
            tables,
            width,
            contexts: contexts.iter().map(|&c| c as i32).collect(),
        }
    }

    fn batch<'a>(&'a self, query_start_loc: &'a [i32]) -> AttentionBatch<'a> {
        AttentionBatch {
            block_tables: &self.tables,
            max_blocks_per_seq: self.width,
            context_lens: &self.contexts,
            query_start_loc,
        }
    }

    /// Dense f64 attention over the gathered (dtype-rounded) K/V.
    fn reference(
        &self,
        q: &[f32],
        num_heads: usize,
        query_start_loc: &[i32],
        scale: f32,
    ) -> Vec<f64> {
        let shape = self.cache.shape();
        let (nkv, d) = (shape.num_kv_heads, shape.head_dim);
        let group = num_heads / nkv;
        let mut out = vec![0.0f64; q.len()];
        for (seq, &context) in self.contexts.iter().enumerate() {
            let table = &self.tables[seq * self.width..(seq + 1) * self.width];
            let (keys, values) = self.cache.gather(1, table, context as usize).unwrap();
            let (start, end) = (
                query_start_loc[seq] as usize,
                query_start_loc[seq + 1] as usize,
            );
            for token in start..end {
                let position = context as usize - (end - start) + (token - start);
                for head in 0..num_heads {
                    let kv = head / group;
                    let query = &q[(token * num_heads + head) * d..][..d];
                    let scores: Vec<f64> = (0..=position)
                        .map(|p| {
                            let key = &keys[(p * nkv + kv) * d..][..d];
                            scale as f64
                                * query
                                    .iter()
                                    .zip(key)
                                    .map(|(&a, &b)| a as f64 * b as f64)
                                    .sum::<f64>()
                        })
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    let dst = &mut out[(token * num_heads + head) * d..][..d];
                    for (p, w) in weights.iter().enumerate() {
                        let value = &values[(p * nkv + kv) * d..][..d];
                        for (o, &v) in dst.iter_mut().zip(value) {
                            *o += w / total * v as f64;
                        }
                    }
                }
            }
        }
        out
    }
}

fn random_queries(rng: &mut StdRng, len: usize) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-2.0..2.0)).collect()
}

/// Largest |a - b| relative to the largest |b|.
fn relative_error(actual: &[f32], expected: &[f64]) -> f64 {
    let scale = expected.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
    actual
        .iter()
        .zip(expected)
        .map(|(&a, &b)| (a as f64 - b).abs())
        .fold(0.0, f64::max)
        / scale
}

fn paths() -> Vec<Isa> {
    Isa::available_of(&ISAS)
}

const DTYPES: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];

/// Runs one case on every path and dtype and checks it against the reference.
fn check_case(
    seed: u64,
    contexts: &[usize],
    queries: &[usize],
    block_size: usize,
    num_kv_heads: usize,
    group: usize,
    head_dim: usize,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let num_heads = num_kv_heads * group;
    let mut query_start_loc = vec![0i32];
    for &nq in queries {
        query_start_loc.push(query_start_loc.last().unwrap() + nq as i32);
    }
    let num_tokens = *query_start_loc.last().unwrap() as usize;
    let q = random_queries(&mut rng, num_tokens * num_heads * head_dim);
    let scale = 1.0 / (head_dim as f32).sqrt();
    for dtype in DTYPES {
        let fixture = Fixture::new(
            &mut rng,
            dtype,
            contexts,
            block_size,
            num_kv_heads,
            head_dim,
        );
        let expected = fixture.reference(&q, num_heads, &query_start_loc, scale);
        for path in paths() {
            let mut out = vec![f32::NAN; q.len()];
            paged_attention_with(
                path,
                &fixture.cache,
                1,
                &q,
                num_heads,
                &fixture.batch(&query_start_loc),
                scale,
                &mut out,
            )
            .unwrap();
            let error = relative_error(&out, &expected);
            assert!(
                error <= 1e-5,
                "{dtype:?} {path:?} contexts {contexts:?} queries {queries:?} bs {block_size} kv {num_kv_heads} group {group} d {head_dim}: error {error}"
            );
        }
    }
}

#[test]
fn decode_matches_reference() {
    // Context lengths that are not block multiples, context 1, GQA ratios 1/2/4/8.
    check_case(1, &[1, 17, 100, 33], &[1, 1, 1, 1], 16, 2, 4, 64);
    check_case(2, &[5, 64], &[1, 1], 8, 1, 8, 128);
    check_case(3, &[40], &[1], 16, 4, 1, 32);
    check_case(4, &[129, 3], &[1, 1], 32, 2, 2, 8);
}

#[test]
fn long_decode_uses_partitions_and_matches_reference() {
    // One sequence, one KV head: only key partitions can spread the work over threads.
    let problem_threads = 4;
    let (q, context, qsl) = (vec![0.0f32; 4 * 64], [3000i32], [0i32, 1]);
    let out = vec![0.0f32; q.len()];
    let problem = Problem::validate(&q, 4, 1, 64, &context, &qsl, 1.0, &out).unwrap();
    let plan = Plan::new(&problem, 16, 4, problem_threads);
    assert!(
        !plan.inline && plan.groups.len() == 1 && plan.groups[0].parts > 1,
        "expected a partitioned plan"
    );
    // Partition boundaries fall inside and at the ends of blocks: 3000 = 187.5 blocks of 16.
    set_num_threads(problem_threads).unwrap();
    check_case(5, &[3000], &[1], 16, 1, 4, 64);
    check_case(6, &[2049, 700], &[1, 1], 64, 1, 2, 32);
}

#[test]
fn prefill_with_and_without_prefix_matches_reference() {
    check_case(7, &[50], &[50], 16, 2, 4, 64); // whole prompt, no cached prefix
    check_case(8, &[90, 37], &[20, 37], 16, 2, 2, 32); // cached prefix of 70, and a fresh prompt
    check_case(9, &[600], &[300], 16, 1, 8, 64); // long enough to be partitioned
    check_case(10, &[31, 9, 70], &[1, 9, 5], 8, 4, 1, 16); // decode, prefill and a chunk mixed
}

#[test]
fn chunked_prefill_equals_whole_prefill() {
    let mut rng = StdRng::seed_from_u64(11);
    let (nkv, group, d, bs, prompt) = (2, 2, 32, 16, 77);
    let num_heads = nkv * group;
    let fixture = Fixture::new(&mut rng, KvDtype::F32, &[prompt], bs, nkv, d);
    let q = random_queries(&mut rng, prompt * num_heads * d);
    let row = num_heads * d;
    let mut whole = vec![0.0; q.len()];
    paged_attention(
        &fixture.cache,
        1,
        &q,
        num_heads,
        &fixture.batch(&[0, prompt as i32]),
        0.3,
        &mut whole,
    )
    .unwrap();
    // Chunks of 30, 30, 17: each sees the K/V of everything before it plus itself.
    let mut start = 0;
    for chunk in [30, 30, 17] {
        let (context, query_start_loc) = ([(start + chunk) as i32], [0, chunk as i32]);
        let batch = AttentionBatch {
            context_lens: &context,
            ..fixture.batch(&query_start_loc)
        };
        let mut out = vec![0.0; chunk * row];
        paged_attention(
            &fixture.cache,
            1,
            &q[start * row..(start + chunk) * row],
            num_heads,
            &batch,
            0.3,
            &mut out,
        )
        .unwrap();
        let expected: Vec<f64> = whole[start * row..(start + chunk) * row]
            .iter()
            .map(|&x| x as f64)
            .collect();
        assert!(relative_error(&out, &expected) <= 1e-6, "chunk at {start}");
        start += chunk;
    }
}

#[test]
fn contiguous_layout_runs_the_same_computation() {
    let kv = ContiguousKv::random(KvDtype::F16, 2, 2, 100, 32, 3).unwrap();
    let mut rng = StdRng::seed_from_u64(12);
    let num_heads = 4;
    let q = random_queries(&mut rng, 2 * num_heads * 32);
    let (contexts, qsl) = ([100, 41], [0, 1, 2]);
    let mut by_block = Vec::new();
    for block_size in [16, 64] {
        for path in paths() {
            let mut out = vec![0.0; q.len()];
            kv.attention(
                path, &q, num_heads, &contexts, &qsl, block_size, 0.2, &mut out,
            )
            .unwrap();
            by_block.push(out);
        }
    }
    let first: Vec<f64> = by_block[0].iter().map(|&x| x as f64).collect();
    for out in &by_block[1..] {
        assert!(relative_error(out, &first) <= 1e-5);
    }
    assert!(kv
        .attention(
            Isa::Portable,
            &q,
            num_heads,
            &[101, 1],
            &qsl,
            16,
            0.2,
            &mut vec![0.0; q.len()]
        )
        .is_err());
}

#[test]
fn bad_arguments_are_typed_errors_and_leave_out_untouched() {
    let mut rng = StdRng::seed_from_u64(13);
    let fixture = Fixture::new(&mut rng, KvDtype::F32, &[20, 5], 8, 2, 16);
    let (nh, d) = (4, 16);
    let qsl = [0, 1, 2];
    let q = vec![0.5; 2 * nh * d];
    let run = |batch: AttentionBatch<'_>, q: &[f32], num_heads: usize, layer: usize| {
        let mut out = vec![7.0; q.len()];
        let result = paged_attention(&fixture.cache, layer, q, num_heads, &batch, 1.0, &mut out);
        assert!(result.is_err() || out.iter().all(|&x| x != 7.0));
        if result.is_err() {
            assert!(
                out.iter().all(|&x| x == 7.0),
                "an error must leave out untouched"
            );
        }
        result
    };
    let is_shape = |r: Result<()>| matches!(r, Err(Error::Shape(_)));
    let is_invalid = |r: Result<()>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(run(fixture.batch(&qsl), &q, nh, 1).is_ok());
    assert!(is_shape(run(fixture.batch(&qsl), &q[1..], nh, 1)));
    assert!(is_shape(run(fixture.batch(&[0, 1]), &q, nh, 1)));
    assert!(is_invalid(run(fixture.batch(&qsl), &q, nh, 9)));
    assert!(is_invalid(run(
        fixture.batch(&qsl),
        &vec![0.5; 2 * 3 * d],
        3,
        1
    )));
    assert!(is_invalid(run(fixture.batch(&[0, 2, 1]), &q, nh, 1)));
    assert!(is_invalid(run(fixture.batch(&[1, 1, 2]), &q, nh, 1)));
    let tables_short = AttentionBatch {
        block_tables: &fixture.tables[1..],
        ..fixture.batch(&qsl)
    };
    assert!(is_shape(run(tables_short, &q, nh, 1)));
    let too_long = [(fixture.width * 8 + 1) as i32, 5];
    assert!(is_invalid(run(
        AttentionBatch {
            context_lens: &too_long,
            ..fixture.batch(&qsl)
        },
        &q,
        nh,
        1
    )));
    let more_queries_than_context = [20, 1];
    assert!(is_invalid(run(
        AttentionBatch {
            context_lens: &more_queries_than_context,
            ..fixture.batch(&[0, 1, 3])
        },
        &vec![0.5; 3 * nh * d],
        nh,
        1
    )));
    let mut bad_table = fixture.tables.clone();
    bad_table[0] = fixture.cache.shape().num_blocks as i32;
    assert!(is_invalid(run(
        AttentionBatch {
            block_tables: &bad_table,
            ..fixture.batch(&qsl)
        },
        &q,
        nh,
        1
    )));
    bad_table[0] = -1;
    assert!(is_invalid(run(
        AttentionBatch {
            block_tables: &bad_table,
            ..fixture.batch(&qsl)
        },
        &q,
        nh,
        1
    )));
    // Padding past the used blocks is never read, whatever it holds.
    let mut padded = fixture.tables.clone();
    padded[fixture.width - 1] = i32::MIN;
    assert!(run(
        AttentionBatch {
            block_tables: &padded,
            ..fixture.batch(&qsl)
        },
        &q,
        nh,
        1
    )
    .is_ok());
    let odd_dim = KvCache::new(
        KvShape {
            num_layers: 1,
            num_blocks: 1,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 12,
        },
        KvDtype::F32,
    )
    .unwrap();
    let batch = AttentionBatch {
        block_tables: &[0],
        max_blocks_per_seq: 1,
        context_lens: &[1],
        query_start_loc: &[0, 1],
    };
    assert!(is_invalid(paged_attention(
        &odd_dim,
        0,
        &[0.0; 12],
        1,
        &batch,
        1.0,
        &mut [0.0; 12]
    )));
}
