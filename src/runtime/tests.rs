//! The runtime's K/V path: a step reaches the store while it awaits its finish, and nothing else
//! does — an old step, another runtime's step, a runtime without K/V — each refused untouched.

use super::*;
use crate::compute::attention::default_isa;
use crate::kv::spec::AttentionKind;

const HEADS: usize = 2;
const HEAD_DIM: usize = 8;
const BLOCK: usize = 4;

fn runtime(kv: bool) -> KvRuntime {
    let spec = KvSpec::uniform(2, HEADS, HEAD_DIM, KvDtype::F32);
    KvRuntime::new(SchedulerConfig::new(16, BLOCK), kv.then_some(spec)).unwrap()
}

fn add(rt: &KvRuntime, id: &str, prompt_len: u32) {
    let params = SamplingParams {
        max_tokens: 4,
        ..Default::default()
    };
    let prompt = (1..=prompt_len).collect();
    rt.add_request(id, prompt, params, RequestOptions::default())
        .unwrap();
}

/// K/V rows for `n` tokens: token t, head h, element e holds `seed + t + h / 10 + e / 100`.
fn rows(n: usize, seed: f32) -> Vec<f32> {
    (0..n * HEADS * HEAD_DIM)
        .map(|i| {
            let (t, rest) = (i / (HEADS * HEAD_DIM), i % (HEADS * HEAD_DIM));
            seed + t as f32 + (rest / HEAD_DIM) as f32 / 10.0 + (rest % HEAD_DIM) as f32 / 100.0
        })
        .collect()
}

/// The store's K rows of the step's first sequence (what it wrote through the step).
fn gathered(rt: &KvRuntime, step: &Step, layer: usize) -> Vec<f32> {
    let store = lock(rt.store.as_ref().unwrap()).unwrap();
    let width = step.block_table_width;
    let n = step.context_lens[0] as usize;
    store
        .gather(layer, &step.block_tables[..width], n)
        .unwrap()
        .0
}

#[test]
fn a_step_writes_at_its_slots_and_attends_through_its_tables() {
    let rt = runtime(true);
    add(&rt, "a", 6);
    let (output, step) = rt.begin_step().unwrap();
    let n = output.num_tokens();
    let (keys, values) = (rows(n, 1.0), rows(n, 50.0));
    rt.copy_blocks(&step).unwrap();
    rt.write(&step, 1, &keys, &values).unwrap();
    assert_eq!(
        gathered(&rt, &step, 1),
        keys,
        "the rows sit where the step's slots put them"
    );
    // One query head per K/V head: attention equals the kernel run on the store by hand.
    let query = rows(n, 0.5);
    let mut out = vec![0.0; query.len()];
    let path = default_isa();
    rt.attention(&step, path, 1, &query, HEADS, 0.5, &mut out)
        .unwrap();
    let mut expected = vec![0.0; query.len()];
    let batch = AttentionBatch {
        block_tables: &output.block_tables,
        max_blocks_per_seq: output.block_table_width,
        context_lens: &output.context_lens,
        query_start_loc: &output.query_start_loc,
    };
    let store = lock(rt.store.as_ref().unwrap()).unwrap();
    attention::paged_attention_with(
        path,
        &store,
        1,
        &query,
        HEADS,
        &batch,
        0.5,
        None,
        &mut expected,
    )
    .unwrap();
    drop(store);
    assert_eq!(out, expected);
    rt.finish_step(&step, &[7]).unwrap();
}

#[test]
fn only_the_step_awaiting_its_finish_reaches_the_store() {
    let rt = runtime(true);
    add(&rt, "a", 6);
    let (output, first) = rt.begin_step().unwrap();
    let n = output.num_tokens();
    rt.write(&first, 0, &rows(n, 1.0), &rows(n, 2.0)).unwrap();
    rt.finish_step(&first, &[7]).unwrap();
    let before = gathered(&rt, &first, 0);
    // Finished: its blocks may have changed hands (a tier could be copying them now).
    let refused = rt.write(&first, 0, &rows(n, 9.0), &rows(n, 9.0));
    assert!(
        matches!(refused, Err(Error::InvalidArgument(_))),
        "{refused:?}"
    );
    assert!(rt.copy_blocks(&first).is_err());
    let mut out = vec![0.0; n * HEADS * HEAD_DIM];
    let path = default_isa();
    assert!(rt
        .attention(&first, path, 0, &rows(n, 0.0), HEADS, 1.0, &mut out)
        .is_err());
    assert_eq!(
        gathered(&rt, &first, 0),
        before,
        "a refused write wrote nothing"
    );

    // Another runtime's step awaiting its own finish opens nothing here.
    let other = runtime(true);
    add(&other, "b", 6);
    let (_, foreign) = other.begin_step().unwrap();
    let (_, second) = rt.begin_step().unwrap();
    assert!(rt.write(&foreign, 0, &rows(n, 3.0), &rows(n, 3.0)).is_err());
    rt.write(&second, 0, &rows(1, 4.0), &rows(1, 4.0)).unwrap();
    // A step is finished once: its second finish is refused by the scheduler.
    rt.finish_step(&second, &[8]).unwrap();
    assert!(rt.finish_step(&second, &[8]).is_err());
}

#[test]
fn a_runtime_without_kv_serves_steps_and_refuses_kv_calls_and_tiers() {
    let rt = runtime(false);
    assert_eq!(rt.kv_layout().unwrap(), None);
    assert!(rt.kv_spec().is_none());
    add(&rt, "a", 6);
    let (output, step) = rt.begin_step().unwrap();
    let n = output.num_tokens();
    let refused = rt.write(&step, 0, &rows(n, 1.0), &rows(n, 1.0));
    assert!(
        matches!(refused, Err(Error::InvalidArgument(_))),
        "{refused:?}"
    );
    rt.finish_step(&step, &[7]).unwrap();
    let dir = std::env::temp_dir().join(format!("pagedkv-runtime-{}", std::process::id()));
    let refused = rt.open_disk_tier(&dir, 1 << 20, b"model".to_vec());
    assert!(
        matches!(refused, Err(Error::InvalidArgument(_))),
        "{refused:?}"
    );
    assert_eq!(rt.tier_counters().unwrap(), None);
}

#[test]
fn the_store_is_shaped_by_the_spec_and_the_pool() {
    let rt = runtime(true);
    let (spec, layout) = rt.kv_spec().unwrap();
    assert_eq!(spec, &KvSpec::uniform(2, HEADS, HEAD_DIM, KvDtype::F32));
    assert_eq!(layout.groups.len(), 1);
    assert_eq!(
        (layout.groups[0].layers.clone(), layout.groups[0].block_size),
        (vec![0, 1], BLOCK)
    );
    let (shape, dtype) = rt.kv_layout().unwrap().unwrap();
    assert_eq!(
        (shape.num_layers, shape.num_blocks, shape.block_size),
        (2, 16, BLOCK)
    );
    assert_eq!(
        (shape.num_kv_heads, shape.head_dim, dtype),
        (HEADS, HEAD_DIM, KvDtype::F32)
    );
}

#[test]
fn layers_of_several_shapes_are_refused_and_a_sliding_layer_gets_its_own_group() {
    let mut spec = KvSpec::uniform(2, HEADS, HEAD_DIM, KvDtype::F32);
    spec.layers[1].num_kv_heads = 2 * HEADS;
    let refused = KvRuntime::new(SchedulerConfig::new(16, BLOCK), Some(spec));
    assert!(matches!(refused, Err(Error::InvalidArgument(m)) if m.contains("pages of one size")));
    // A sliding layer of the same shape is a group of its own, which keeps its window; the
    // store's pages hold one layer each.
    let mut spec = KvSpec::uniform(2, HEADS, HEAD_DIM, KvDtype::F32);
    spec.layers[1].attention = AttentionKind::Sliding { window: 8 };
    let mut config = SchedulerConfig::new(16, BLOCK);
    // The sliding group's peak (its window and a 2048-token chunk) exceeds a sequence of the
    // whole pool: it may hold as many blocks as the full group, so 64 tokens need 32 blocks.
    assert!(KvRuntime::new(config.clone(), Some(spec.clone())).is_err());
    config.max_model_len = 32;
    let rt = KvRuntime::new(config, Some(spec.clone())).unwrap();
    let (kept, layout) = rt.kv_spec().unwrap();
    assert_eq!(kept, &spec, "the windows stay in the spec");
    let groups: Vec<_> = layout
        .groups
        .iter()
        .map(|g| (g.layers.clone(), g.layer.attention))
        .collect();
    assert_eq!(
        groups,
        [
            (vec![0], AttentionKind::Full),
            (vec![1], AttentionKind::Sliding { window: 8 })
        ]
    );
    assert_eq!(rt.kv_layout().unwrap().unwrap().0.num_layers, 1);
}

#[test]
fn a_sliding_layer_attends_over_the_window_of_its_spec() {
    let (window, prompt) = (3, 10);
    // Small enough that the softmax does not put all its weight on the last key.
    const SCALE: f32 = 1e-3;
    let mut spec = KvSpec::uniform(2, HEADS, HEAD_DIM, KvDtype::F32);
    spec.layers[1].attention = AttentionKind::Sliding { window };
    let mut config = SchedulerConfig::new(16, BLOCK);
    config.max_model_len = 32;
    let rt = KvRuntime::new(config, Some(spec)).unwrap();
    add(&rt, "a", prompt);
    let (output, step) = rt.begin_step().unwrap();
    let n = output.num_tokens();
    assert_eq!(n, prompt as usize, "the whole prompt in one step");
    assert_eq!(output.num_kv_groups, 2);
    for layer in 0..2 {
        rt.write(&step, layer, &rows(n, 1.0), &rows(n, 50.0))
            .unwrap();
    }
    let query = rows(n, 0.5);
    let path = default_isa();
    // Layer g is group g's, at layer 0 of its pages, through its own tables.
    let by_hand = |group: usize, window| {
        let batch = AttentionBatch {
            block_tables: step.group_tables(group),
            max_blocks_per_seq: output.block_table_width,
            context_lens: &output.context_lens,
            query_start_loc: &output.query_start_loc,
        };
        let store = lock(rt.store.as_ref().unwrap()).unwrap();
        let mut out = vec![0.0; query.len()];
        attention::paged_attention_with(
            path, &store, 0, &query, HEADS, &batch, SCALE, window, &mut out,
        )
        .unwrap();
        out
    };
    assert_ne!(
        step.group_tables(0),
        step.group_tables(1),
        "each group has blocks of its own"
    );
    let (full, windowed) = (by_hand(0, None), by_hand(1, Some(window)));
    assert_ne!(
        full, windowed,
        "the window changes what the last queries see"
    );
    for (layer, expected) in [(0, full), (1, windowed)] {
        let mut out = vec![0.0; query.len()];
        rt.attention(&step, path, layer, &query, HEADS, SCALE, &mut out)
            .unwrap();
        assert_eq!(out, expected, "layer {layer}");
    }
    // A layer the spec does not have is refused, typed.
    let mut out = vec![0.0; query.len()];
    let refused = rt.attention(&step, path, 2, &query, HEADS, SCALE, &mut out);
    assert!(
        matches!(refused, Err(Error::InvalidArgument(_))),
        "{refused:?}"
    );
    rt.finish_step(&step, &[7]).unwrap();
}
