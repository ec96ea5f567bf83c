//! The kernel against a naive f64 reference that gathers K/V through the block tables, on every
//! kernel path and dtype, with and without a sliding window (whose runs poison the table entries
//! before the window: they must never be read), plus the plan's partitioning and argument
//! validation.

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

    /// Dense f64 attention over the gathered (dtype-rounded) K/V: a naive softmax over each
    /// query's keys, the last `window` positions only when given.
    fn reference(
        &self,
        q: &[f32],
        num_heads: usize,
        query_start_loc: &[i32],
        scale: f32,
        window: Option<usize>,
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
                let first = window.map_or(0, |w| (position + 1).saturating_sub(w));
                for head in 0..num_heads {
                    let kv = head / group;
                    let query = &q[(token * num_heads + head) * d..][..d];
                    let scores: Vec<f64> = (first..=position)
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
                    for (p, w) in (first..).zip(&weights) {
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

    /// The tables with every entry of a block wholly before all windows of its sequence's
    /// queries (for `contexts`, a chunk's or the fixture's) replaced by -1 or an id outside the
    /// cache: what a sliding layer's released blocks may leave there, which the kernel must never
    /// read.
    fn poisoned_before(
        &self,
        contexts: &[i32],
        query_start_loc: &[i32],
        window: usize,
    ) -> Vec<i32> {
        let block_size = self.cache.shape().block_size;
        let mut tables = self.tables.clone();
        for (seq, &context) in contexts.iter().enumerate() {
            let nq = (query_start_loc[seq + 1] - query_start_loc[seq]) as usize;
            let first_key = (context as usize - nq + 1).saturating_sub(window);
            for block in 0..first_key / block_size {
                tables[seq * self.width + block] = match block % 3 {
                    0 => -1,
                    1 => self.cache.shape().num_blocks as i32,
                    _ => i32::MIN,
                };
            }
        }
        tables
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

/// Runs one case of full attention on every path and dtype and checks it against the reference.
fn check_case(
    seed: u64,
    contexts: &[usize],
    queries: &[usize],
    block_size: usize,
    num_kv_heads: usize,
    group: usize,
    head_dim: usize,
) {
    check_window_case(
        seed,
        contexts,
        queries,
        block_size,
        num_kv_heads,
        group,
        head_dim,
        None,
    );
}

/// [`check_case`] through a sliding `window`, if any, over tables whose entries before the
/// windows are poisoned ([`Fixture::poisoned_before`]).
#[allow(clippy::too_many_arguments)]
fn check_window_case(
    seed: u64,
    contexts: &[usize],
    queries: &[usize],
    block_size: usize,
    num_kv_heads: usize,
    group: usize,
    head_dim: usize,
    window: Option<usize>,
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
        let expected = fixture.reference(&q, num_heads, &query_start_loc, scale, window);
        let tables = match window {
            None => fixture.tables.clone(),
            Some(window) => fixture.poisoned_before(&fixture.contexts, &query_start_loc, window),
        };
        let batch = AttentionBatch {
            block_tables: &tables,
            ..fixture.batch(&query_start_loc)
        };
        for path in paths() {
            let mut out = vec![f32::NAN; q.len()];
            paged_attention_with(
                path,
                &fixture.cache,
                1,
                &q,
                num_heads,
                &batch,
                scale,
                window,
                &mut out,
            )
            .unwrap();
            let error = relative_error(&out, &expected);
            assert!(
                error <= 1e-5,
                "{dtype:?} {path:?} contexts {contexts:?} queries {queries:?} bs {block_size} kv {num_kv_heads} group {group} d {head_dim} window {window:?}: error {error}"
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
fn every_head_dim_shape_of_the_vector_loops_matches_reference() {
    // AVX-512 takes 64 columns at a time then 16 (d = 48, 80, 256: Gemma 3's) and hands rows that
    // are not a multiple of 16 to AVX2 (d = 24); 1-3 query rows per KV head take other blockings.
    for (seed, d) in [(40, 24), (41, 48), (42, 80), (43, 256)] {
        for group in [1, 2, 3, 4] {
            check_case(seed, &[37, 70], &[1, 9], 16, 1, group, d);
        }
    }
}

#[test]
fn long_decode_uses_partitions_and_matches_reference() {
    // One sequence, one KV head: only key partitions can spread the work over threads.
    let problem_threads = 4;
    let (q, context, qsl) = (vec![0.0f32; 4 * 64], [3000i32], [0i32, 1]);
    let out = vec![0.0f32; q.len()];
    let problem = Problem::validate(&q, 4, 1, 64, &context, &qsl, 1.0, None, &out).unwrap();
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
        None,
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
            None,
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
                path, &q, num_heads, &contexts, &qsl, block_size, 0.2, None, &mut out,
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
            None,
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
        let result = paged_attention(
            &fixture.cache,
            layer,
            q,
            num_heads,
            &batch,
            1.0,
            None,
            &mut out,
        );
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
        None,
        &mut [0.0; 12]
    )));
}

#[test]
fn windowed_decode_matches_reference() {
    // Windows of 1, smaller than a block, not a block multiple, a block multiple, and larger
    // than every context (which is full attention).
    for (seed, window) in [(20, 1), (21, 5), (22, 20), (23, 32), (24, 1000)] {
        check_window_case(
            seed,
            &[1, 17, 100, 33],
            &[1, 1, 1, 1],
            16,
            2,
            4,
            64,
            Some(window),
        );
    }
    // One KV head of a long context: partitions over the window only.
    set_num_threads(4).unwrap();
    check_window_case(25, &[3000], &[1], 16, 1, 4, 64, Some(700));
    check_window_case(26, &[2049, 700], &[1, 1], 64, 1, 2, 32, Some(333));
}

#[test]
fn windowed_prefill_matches_reference() {
    for (seed, window) in [(30, 1), (31, 7), (32, 20), (33, 64), (34, 500)] {
        check_window_case(seed, &[50], &[50], 16, 2, 4, 64, Some(window)); // whole prompt
                                                                           // A cached prefix of 70, and a fresh prompt.
        check_window_case(seed + 10, &[90, 37], &[20, 37], 16, 2, 2, 32, Some(window));
    }
    // Long enough to be partitioned: tiles whose partitions lie partly before some windows.
    set_num_threads(4).unwrap();
    check_window_case(45, &[600], &[300], 16, 1, 8, 64, Some(100));
    // Decode, prefill and a chunk mixed.
    check_window_case(46, &[31, 9, 70], &[1, 9, 5], 8, 4, 1, 16, Some(12));
}

#[test]
fn windowed_chunked_prefill_across_the_boundary_equals_whole_prefill() {
    // Window 20 over a prompt of 77 in chunks of 30, 30, 17 of blocks of 16: the first chunk's
    // windows start at 0 then move, the later chunks' start inside a block and cross the next
    // one, so tiles straddle the boundary and mask per query.
    let (nkv, group, d, bs, prompt, window) = (2, 2, 32, 16, 77, 20);
    let num_heads = nkv * group;
    let row = num_heads * d;
    for dtype in DTYPES {
        let mut rng = StdRng::seed_from_u64(50);
        let fixture = Fixture::new(&mut rng, dtype, &[prompt], bs, nkv, d);
        let q = random_queries(&mut rng, prompt * num_heads * d);
        let expected = fixture.reference(&q, num_heads, &[0, prompt as i32], 0.3, Some(window));
        for path in paths() {
            let mut whole = vec![0.0; q.len()];
            paged_attention_with(
                path,
                &fixture.cache,
                1,
                &q,
                num_heads,
                &fixture.batch(&[0, prompt as i32]),
                0.3,
                Some(window),
                &mut whole,
            )
            .unwrap();
            assert!(
                relative_error(&whole, &expected) <= 1e-5,
                "{dtype:?} {path:?}"
            );
            let mut start = 0;
            for chunk in [30, 30, 17] {
                let (context, query_start_loc) = ([(start + chunk) as i32], [0, chunk as i32]);
                let tables = fixture.poisoned_before(&context, &query_start_loc, window);
                let batch = AttentionBatch {
                    block_tables: &tables,
                    context_lens: &context,
                    ..fixture.batch(&query_start_loc)
                };
                let mut out = vec![0.0; chunk * row];
                paged_attention_with(
                    path,
                    &fixture.cache,
                    1,
                    &q[start * row..(start + chunk) * row],
                    num_heads,
                    &batch,
                    0.3,
                    Some(window),
                    &mut out,
                )
                .unwrap();
                let chunk_expected = &expected[start * row..(start + chunk) * row];
                assert!(
                    relative_error(&out, chunk_expected) <= 1e-5,
                    "{dtype:?} {path:?} chunk at {start}"
                );
                start += chunk;
            }
        }
    }
}

#[test]
fn table_entries_before_the_window_are_never_read_and_those_read_are_checked() {
    let mut rng = StdRng::seed_from_u64(60);
    let (bs, nkv, group, d) = (8, 2, 2, 16);
    let num_heads = nkv * group;
    // Decode at position 40 through a window of 10: keys 31..=40, blocks 3..=5 of 6.
    let fixture = Fixture::new(&mut rng, KvDtype::F32, &[41], bs, nkv, d);
    let q = random_queries(&mut rng, num_heads * d);
    let qsl = [0, 1];
    let expected = fixture.reference(&q, num_heads, &qsl, 0.25, Some(10));
    let run = |tables: &[i32], window: Option<usize>| {
        let mut out = vec![7.0; q.len()];
        let batch = AttentionBatch {
            block_tables: tables,
            ..fixture.batch(&qsl)
        };
        let result = paged_attention(
            &fixture.cache,
            1,
            &q,
            num_heads,
            &batch,
            0.25,
            window,
            &mut out,
        );
        result.map(|()| out)
    };
    for poison in [-1, fixture.cache.shape().num_blocks as i32, i32::MIN] {
        let mut tables = fixture.tables.clone();
        tables[..3].fill(poison);
        let out = run(&tables, Some(10)).unwrap();
        assert!(relative_error(&out, &expected) <= 1e-5, "poison {poison}");
        // Full attention reads those entries, so it refuses them.
        assert!(matches!(run(&tables, None), Err(Error::InvalidArgument(_))));
        // An entry the window reads is still checked.
        tables[3] = poison;
        assert!(matches!(
            run(&tables, Some(10)),
            Err(Error::InvalidArgument(m)) if m.contains("sequence 0")
        ));
    }
    assert!(matches!(
        run(&fixture.tables, Some(0)),
        Err(Error::InvalidArgument(m)) if m.contains("window")
    ));
}

#[test]
fn a_window_leaves_no_item_before_it() {
    let (q, context, qsl) = (vec![0.0f32; 4 * 64], [3000i32], [0i32, 1]);
    let out = vec![0.0f32; q.len()];
    let full = Problem::validate(&q, 4, 1, 64, &context, &qsl, 1.0, None, &out).unwrap();
    let windowed = Problem::validate(&q, 4, 1, 64, &context, &qsl, 1.0, Some(700), &out).unwrap();
    let (full, windowed) = (Plan::new(&full, 16, 4, 4), Plan::new(&windowed, 16, 4, 4));
    // Keys 2300..=2999: blocks 143..188 (2300 = 143.75 blocks of 16).
    assert_eq!(windowed.items.first().unwrap().first_block, 143);
    assert_eq!(windowed.items.last().unwrap().end_block, 188);
    assert!(windowed
        .items
        .windows(2)
        .all(|w| w[0].end_block == w[1].first_block));
    // Partitions split the window's 45 blocks only, so fewer of them clear the minimum size.
    assert_eq!(full.items.first().unwrap().first_block, 0);
    assert!(1 < windowed.items.len() && windowed.items.len() < full.items.len());
}

#[test]
fn contiguous_layout_takes_the_window_too() {
    let kv = ContiguousKv::random(KvDtype::F32, 2, 2, 100, 32, 4).unwrap();
    let mut rng = StdRng::seed_from_u64(61);
    let num_heads = 4;
    let q = random_queries(&mut rng, 7 * num_heads * 32);
    // A decode and a chunk of 6 across the window's start, tiles of 16 and 64 rows.
    let (contexts, qsl) = ([100, 41], [0, 1, 7]);
    let run = |block_size, window, path| {
        let mut out = vec![0.0; q.len()];
        kv.attention(
            path, &q, num_heads, &contexts, &qsl, block_size, 0.2, window, &mut out,
        )
        .unwrap();
        out
    };
    let first: Vec<f64> = run(16, Some(30), Isa::Portable)
        .iter()
        .map(|&x| x as f64)
        .collect();
    for block_size in [16, 64] {
        for path in paths() {
            assert!(relative_error(&run(block_size, Some(30), path), &first) <= 1e-5);
            // A window longer than every context is full attention.
            let full: Vec<f64> = run(block_size, None, path)
                .iter()
                .map(|&x| x as f64)
                .collect();
            assert!(relative_error(&run(block_size, Some(101), path), &full) <= 1e-6);
            assert!(relative_error(&run(block_size, Some(30), path), &full) > 1e-3);
        }
    }
}
