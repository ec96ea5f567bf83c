//! Scenario tests with exact expected figures, and a property test over random workloads.

use proptest::prelude::*;

use super::*;

fn config(num_blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig::new(num_blocks, block_size)
}

fn add(s: &mut Scheduler, id: &str, prompt: Vec<TokenId>, max_tokens: usize) {
    let params = SamplingParams {
        max_tokens,
        ..Default::default()
    };
    s.add_request(id, prompt, params, RequestOptions::default())
        .unwrap();
}

/// A deterministic "model": the token sampled after a sequence depends only on its last token
/// and its length, so a recomputed sequence produces the same continuation.
pub(super) fn next_token(last: i64, position: i64) -> TokenId {
    ((last * 31 + position * 7) % 997) as TokenId + 3
}

/// Runs one step, sampling with `next_token`; returns the step and what update produced.
fn step(s: &mut Scheduler) -> (StepOutput, UpdateOutput) {
    let out = s.schedule().unwrap().clone();
    let id = out.id;
    let sampled: Vec<TokenId> = out
        .logits_indices
        .iter()
        .zip(&out.sample_seq_indices)
        .map(|(&row, &sample)| {
            next_token(out.input_ids[row as usize], out.positions[row as usize]) + sample
        })
        .collect();
    let produced = s.update(id, &sampled).unwrap().clone();
    s.check_invariants().unwrap();
    check_events_match_stats(&out);
    (out, produced)
}

/// A step's events agree with its figures: one admission event (first or resumed) per admission,
/// one preemption event per preemption, and the admissions' hits sum to the step's prefix hits.
fn check_events_match_stats(out: &StepOutput) {
    let count = |kinds: &[RequestEventKind]| {
        out.events
            .iter()
            .filter(|e| kinds.contains(&e.kind))
            .count()
    };
    use RequestEventKind::*;
    assert_eq!(count(&[Admitted, Resumed]), out.stats.num_admitted);
    assert_eq!(count(&[Preempted]), out.stats.num_preempted);
    let hits: usize = out.events.iter().map(|e| e.prefix_hit_tokens).sum();
    assert_eq!(hits as u64, out.stats.prefix_hit_tokens);
}

pub(super) fn event(id: &str, seq_index: u32, kind: RequestEventKind, hit: usize) -> RequestEvent {
    RequestEvent {
        request_id: Arc::from(id),
        seq_index,
        kind,
        prefix_hit_tokens: hit,
    }
}

fn run_to_end(s: &mut Scheduler, max_steps: usize) -> HashMap<String, Vec<TokenId>> {
    let mut outputs: HashMap<String, Vec<TokenId>> = HashMap::new();
    for _ in 0..max_steps {
        if !s.has_unfinished() {
            return outputs;
        }
        let (_, produced) = step(s);
        for p in produced.produced {
            outputs
                .entry(format!("{}/{}", p.request_id, p.seq_index))
                .or_default()
                .push(p.token);
        }
    }
    panic!("not finished after {max_steps} steps");
}

#[test]
fn step_output_has_the_model_runner_layout() {
    let mut s = Scheduler::new(config(8, 4)).unwrap();
    add(&mut s, "a", vec![10, 11, 12, 13, 14, 15], 2);
    add(&mut s, "b", vec![20, 21], 2);
    let out = s.schedule().unwrap().clone();
    let id = out.id;
    assert_eq!(out.input_ids, vec![10, 11, 12, 13, 14, 15, 20, 21]);
    assert_eq!(out.positions, vec![0, 1, 2, 3, 4, 5, 0, 1]);
    assert_eq!(out.query_start_loc, vec![0, 6, 8]);
    assert_eq!(out.context_lens, vec![6, 2]);
    assert_eq!(out.block_table_width, 2);
    let (a0, a1, b0) = (
        out.block_tables[0],
        out.block_tables[1],
        out.block_tables[2],
    );
    assert_eq!(out.block_tables[3], -1, "row b is padded");
    let slot = |block: i32, offset: i64| i64::from(block) * 4 + offset;
    assert_eq!(
        out.slot_mapping,
        vec![
            slot(a0, 0),
            slot(a0, 1),
            slot(a0, 2),
            slot(a0, 3),
            slot(a1, 0),
            slot(a1, 1),
            slot(b0, 0),
            slot(b0, 1)
        ]
    );
    assert_eq!(out.logits_indices, vec![5, 7]);
    assert_eq!(
        out.request_ids.iter().map(|r| &**r).collect::<Vec<_>>(),
        ["a", "b"]
    );
    s.update(id, &[100, 200]).unwrap();
    // The decode step feeds the sampled tokens at the next positions, same blocks.
    let out = s.schedule().unwrap().clone();
    let id = out.id;
    assert_eq!(out.input_ids, vec![100, 200]);
    assert_eq!(out.positions, vec![6, 2]);
    assert_eq!(out.context_lens, vec![7, 3]);
    assert_eq!(out.slot_mapping, vec![slot(a1, 2), slot(b0, 2)]);
    let produced = s.update(id, &[101, 201]).unwrap();
    assert!(produced
        .produced
        .iter()
        .all(|p| p.finish == Some(FinishReason::Length)));
    assert_eq!(produced.finished_requests.len(), 2);
    assert!(!s.has_unfinished());
    assert_eq!(s.block_manager().stats().used_blocks, 0);
}

#[test]
fn schedule_and_update_must_alternate_and_count_samples() {
    let mut s = Scheduler::new(config(8, 4)).unwrap();
    add(&mut s, "a", vec![1, 2, 3], 4);
    let never = StepId::default();
    assert!(matches!(
        s.update(never, &[]),
        Err(Error::InvalidArgument(_))
    ));
    let id = s.schedule().unwrap().id;
    assert!(matches!(s.schedule(), Err(Error::InvalidArgument(_))));
    // Another scheduler's output of the same step number is refused, changing nothing.
    let mut other = Scheduler::new(config(8, 4)).unwrap();
    add(&mut other, "a", vec![1, 2, 3], 4);
    let foreign = other.schedule().unwrap().id;
    assert_eq!(foreign.number(), id.number());
    assert!(matches!(
        s.update(foreign, &[7]),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(s.update(id, &[1, 2]), Err(Error::Shape(_))));
    assert_eq!(s.update(id, &[7]).unwrap().produced[0].token, 7);
    assert_eq!(s.sequence_tokens("a", 0).unwrap(), &[1, 2, 3, 7]);
}

#[test]
fn a_sliding_window_holds_a_bounded_number_of_blocks_however_long_the_sequence() {
    // Window 6, blocks of 4, chunks of at most 5 tokens: a step's queries read back 5 tokens
    // before the first, so at most ceil((5 + 5) / 4) + 1 = 4 blocks are held at a step.
    let mut cfg = config(32, 4);
    cfg.max_num_batched_tokens = 5;
    cfg.max_model_len = 128;
    let sliding = GroupKeeping {
        attention: AttentionKind::Sliding { window: 6 },
        block_size: 4,
    };
    let mut s = Scheduler::keeping(cfg, vec![sliding]).unwrap();
    add(&mut s, "long", (0..23).collect(), 100);
    let mut peak_table_width = 0;
    while s.has_unfinished() {
        let (out, _) = step(&mut s);
        let table = &out.block_tables[..out.block_table_width];
        let held = table.iter().filter(|&&b| b >= 0).count();
        assert!(held <= 4, "{held} blocks held: {table:?}");
        // The entries before the window are -1, and only those.
        let released = table.iter().take_while(|&&b| b < 0).count();
        assert!(table[released..].iter().all(|&b| b >= 0));
        // Every block in use is one the sequence holds (released ones are only cached).
        assert!(s.stats().kv_usage <= 4.0 / 32.0);
        peak_table_width = peak_table_width.max(out.block_table_width);
    }
    assert_eq!(peak_table_width, (23 + 100 - 1usize).div_ceil(4));
    assert!(s.stats().window_released_blocks >= 25);
}

#[test]
fn preempted_requests_resume_with_the_same_tokens() {
    let workload = |s: &mut Scheduler| {
        for r in 0..6u32 {
            add(
                s,
                &format!("r{r}"),
                (0..20).map(|t| t * 13 + r).collect(),
                30,
            );
        }
    };
    let mut roomy = Scheduler::new(config(96, 4)).unwrap();
    workload(&mut roomy);
    let expected = run_to_end(&mut roomy, 1000);
    assert_eq!(roomy.stats().preemptions, 0);

    // 6 sequences of up to 49 tokens need 6 x 13 blocks; 20 blocks force preemption once
    // admission fills memory regardless of growth (no headroom).
    let mut cfg = config(20, 4);
    cfg.admission_lookahead_tokens = None;
    let mut tight = Scheduler::new(cfg).unwrap();
    workload(&mut tight);
    let got = run_to_end(&mut tight, 5000);
    assert!(tight.stats().preemptions > 0, "the workload must preempt");
    assert_eq!(got, expected);
    assert_eq!(tight.block_manager().stats().used_blocks, 0);

    // The default headroom (32 tokens, capped by max_tokens = 30: 13 - 5 = 8 blocks a sequence)
    // admits a second 5-block prompt only with 5 + 8 + 8 = 21 > 15 blocks free: the sequences
    // run one at a time, none is preempted, and the tokens are the same.
    let mut headroom = Scheduler::new(config(20, 4)).unwrap();
    workload(&mut headroom);
    assert_eq!(run_to_end(&mut headroom, 5000), expected);
    assert_eq!(headroom.stats().preemptions, 0);
    assert_eq!(headroom.stats().peak_running, 1);
}

#[test]
fn admission_keeps_headroom_for_the_growth_of_running_sequences() {
    // 16 blocks of 4, 8 tokens of headroom a sequence (2 blocks here).
    let mut cfg = config(16, 4);
    cfg.admission_lookahead_tokens = Some(8);
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    add(&mut s, "a", vec![1; 10], 50); // 3 blocks, headroom ceil(18 / 4) - 3 = 2
    add(&mut s, "b", vec![2; 12], 50); // 3 blocks + 2: 3 + 2 + 2 = 7 <= 13 free
    add(&mut s, "c", vec![3; 20], 50); // 5 blocks + 2: 5 + 2 + 4 = 11 > 10 free
    let (out, _) = step(&mut s);
    assert_eq!(out.stats.num_admitted, 2);
    assert_eq!(out.context_lens, vec![10, 12]);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    assert_eq!(s.block_manager().num_available_blocks(), 10);

    // Without headroom c fits now (5 <= 10) and is admitted in the same step.
    cfg.admission_lookahead_tokens = None;
    let mut legacy = Scheduler::new(cfg).unwrap();
    add(&mut legacy, "a", vec![1; 10], 50);
    add(&mut legacy, "b", vec![2; 12], 50);
    add(&mut legacy, "c", vec![3; 20], 50);
    let (out, _) = step(&mut legacy);
    assert_eq!(out.stats.num_admitted, 3);
    assert_eq!(legacy.block_manager().num_available_blocks(), 5);
}

#[test]
fn an_empty_batch_admits_the_head_whenever_it_fits() {
    // 60 tokens take 15 of 16 blocks; the headroom (8 tokens: 2 blocks) does not fit, but
    // nothing runs, so the head is admitted anyway and finishes without preemption.
    let mut cfg = config(16, 4);
    cfg.admission_lookahead_tokens = Some(8);
    let mut s = Scheduler::new(cfg).unwrap();
    add(&mut s, "big", vec![7; 60], 4);
    add(&mut s, "small", vec![8; 2], 4);
    let (out, _) = step(&mut s);
    assert_eq!(out.stats.num_admitted, 1);
    assert_eq!(out.context_lens, vec![60]);
    assert_eq!(s.block_manager().num_available_blocks(), 1);
    let outputs = run_to_end(&mut s, 100);
    assert_eq!(
        outputs["big/0"].len(),
        3,
        "after the first, sampled at step 0"
    );
    assert_eq!(outputs["small/0"].len(), 4);
    assert_eq!(s.stats().preemptions, 0);
}

#[test]
fn admission_reserves_the_rest_of_a_chunked_prompt() {
    // Budget 16, at most 8 prompt tokens a sequence a step, no decode headroom: only the rest of
    // the prompts is reserved. a (40 tokens, 10 blocks) is prefilled over 5 steps; b (28 tokens,
    // 7 blocks) would need its first 2 blocks + 5 more + a's remaining 8, 6, 4, 2, 0 blocks:
    // 15 > 14, 13 > 12, 11 > 10, 9 > 8, then 7 > 6 free. It waits until a finishes (step 6,
    // a's second token) and is admitted at step 7, with no preemption.
    let workload = |lookahead| {
        let mut cfg = config(16, 4);
        cfg.max_num_batched_tokens = 16;
        cfg.long_prefill_token_threshold = 8;
        cfg.admission_lookahead_tokens = lookahead;
        let mut s = Scheduler::new(cfg).unwrap();
        add(&mut s, "a", vec![1; 40], 2);
        add(&mut s, "b", vec![2; 28], 2);
        s
    };
    let mut s = workload(Some(0));
    let mut admitted = Vec::new();
    let mut outputs: HashMap<String, Vec<TokenId>> = HashMap::new();
    while s.has_unfinished() {
        let (out, produced) = step(&mut s);
        admitted.push(out.stats.num_admitted);
        for p in produced.produced {
            outputs
                .entry(p.request_id.to_string())
                .or_default()
                .push(p.token);
        }
    }
    assert_eq!(admitted, vec![1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]);
    assert_eq!(s.stats().preemptions, 0);
    assert_eq!(s.stats().prefill_tokens, 40 + 28);

    // Admitted at once, b's chunks take the blocks a's prompt needs: a preemption, and b's
    // computed chunks are recomputed.
    let mut legacy = workload(None);
    let legacy_outputs = run_to_end(&mut legacy, 100);
    assert_eq!(legacy.stats().preemptions, 1);
    assert!(legacy.stats().prefill_tokens > 40 + 28);
    assert_eq!(legacy_outputs["a/0"], outputs["a"]);
    assert_eq!(legacy_outputs["b/0"], outputs["b"]);
}

#[test]
fn the_victim_is_the_most_recently_admitted_sequence() {
    // 4 blocks of 4: a (5 tokens) and b (3 tokens) take 2 + 1 blocks; a third prompt c fits 1
    // when admission keeps no headroom.
    let mut cfg = config(4, 4);
    cfg.admission_lookahead_tokens = None;
    let mut s = Scheduler::new(cfg).unwrap();
    add(&mut s, "a", vec![1; 7], 10);
    add(&mut s, "b", vec![2; 3], 10);
    add(&mut s, "c", vec![3; 3], 10);
    let (out, _) = step(&mut s);
    assert_eq!(out.context_lens, vec![7, 3, 3]);
    // a: 8 tokens (2 blocks), b: 4 (1 block), c: 4 (1 block): all full.
    let (out, _) = step(&mut s);
    assert_eq!(out.context_lens, vec![8, 4, 4]);
    // a needs a third block: c (admitted last) is preempted; then b needs one: b goes too.
    let (out, _) = step(&mut s);
    assert_eq!(out.stats.num_preempted, 2);
    assert_eq!(out.context_lens, vec![9]);
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn admission_events_report_the_prefix_hit() {
    let mut s = Scheduler::new(config(16, 4)).unwrap();
    add(&mut s, "a", (0..10).collect(), 2);
    let (out, _) = step(&mut s);
    assert_eq!(
        out.events,
        vec![event("a", 0, RequestEventKind::Admitted, 0)]
    );
    let (out, _) = step(&mut s);
    assert!(out.events.is_empty(), "a decode step admits nothing");
    assert!(!s.has_unfinished());
    // b shares a's 10-token prompt: its two full blocks (8 tokens) are cached.
    add(&mut s, "b", (0..10).chain([99]).collect(), 2);
    let (out, _) = step(&mut s);
    assert_eq!(
        out.events,
        vec![event("b", 0, RequestEventKind::Admitted, 8)]
    );
}

#[test]
fn preempted_sequences_are_reported_then_resumed() {
    let mut cfg = config(4, 4);
    cfg.admission_lookahead_tokens = None;
    let mut s = Scheduler::new(cfg).unwrap();
    add(&mut s, "a", vec![1; 7], 10);
    add(&mut s, "b", vec![2; 3], 10);
    add(&mut s, "c", vec![3; 3], 10);
    let (out, _) = step(&mut s);
    let admitted = |id| event(id, 0, RequestEventKind::Admitted, 0);
    assert_eq!(
        out.events,
        vec![admitted("a"), admitted("b"), admitted("c")]
    );
    step(&mut s);
    // As in the victim test: c then b are preempted at the third step.
    let (out, _) = step(&mut s);
    let preempted = |id| event(id, 0, RequestEventKind::Preempted, 0);
    assert_eq!(out.events, vec![preempted("c"), preempted("b")]);
    let mut later = Vec::new();
    while s.has_unfinished() {
        later.extend(step(&mut s).0.events);
    }
    // Each comes back as a resumption (never a second first admission), b first (FCFS), with no
    // hit: a, growing to max_model_len (16 tokens, the 4 blocks), evicted their cached blocks.
    // Then b's growth preempts c again, and c resumes with its first (full) block still cached.
    use RequestEventKind::*;
    let expected = [
        ("b", Resumed, 0),
        ("c", Resumed, 0),
        ("c", Preempted, 0),
        ("c", Resumed, 4),
    ];
    assert_eq!(
        later,
        expected.map(|(id, kind, hit)| event(id, 0, kind, hit))
    );
}

#[test]
fn parallel_samples_share_the_prompt_until_they_diverge() {
    let mut s = Scheduler::new(config(16, 4)).unwrap();
    let params = SamplingParams {
        max_tokens: 3,
        n: 3,
        ..Default::default()
    };
    s.add_request("p", vec![5; 6], params, RequestOptions::default())
        .unwrap();
    let (out, _) = step(&mut s);
    assert_eq!(out.num_seqs(), 1, "the prompt is computed once");
    assert_eq!(out.logits_indices, vec![5, 5, 5], "and sampled three times");
    assert_eq!(out.sample_seq_indices, vec![0, 1, 2]);
    assert_eq!(s.num_running(), 3);
    assert_eq!(
        s.block_manager().stats().used_blocks,
        2,
        "the forks share both prompt blocks"
    );
    // Each sample writes into the shared partial block: the first two copy it, the last owns it.
    let (out, _) = step(&mut s);
    assert_eq!(out.num_seqs(), 3);
    assert_eq!(out.copy_ops.len(), 2 * 2);
    assert_eq!(s.block_manager().stats().used_blocks, 4);
    let tables: Vec<_> = out.block_tables.chunks(out.block_table_width).collect();
    assert!(
        tables.iter().all(|t| t[0] == tables[0][0]),
        "the full block stays shared"
    );
    run_to_end(&mut s, 10);
    assert_eq!(s.block_manager().stats().used_blocks, 0);
}

#[test]
fn a_sample_finished_early_frees_its_blocks_while_its_siblings_run() {
    let mut s = Scheduler::new(config(16, 4)).unwrap();
    let params = SamplingParams {
        max_tokens: 6,
        n: 3,
        ..Default::default()
    };
    s.add_request("p", vec![5; 6], params, RequestOptions::default())
        .unwrap();
    step(&mut s);
    step(&mut s); // each sample now owns its partial block
    let used = s.block_manager().stats().used_blocks;
    s.finish_sample("p", 1).unwrap();
    s.check_invariants().unwrap();
    assert_eq!(s.num_running(), 2);
    assert_eq!(s.block_manager().stats().used_blocks, used - 1);
    assert!(matches!(
        s.finish_sample("p", 1),
        Err(Error::UnknownSequence(_))
    ));
    assert!(matches!(
        s.finish_sample("q", 0),
        Err(Error::UnknownSequence(_))
    ));

    // Finished between schedule and update: its sample is dropped, its sibling's goes through.
    let id = s.schedule().unwrap().id;
    s.finish_sample("p", 2).unwrap();
    let produced = s.update(id, &[7, 8]).unwrap();
    assert_eq!(produced.produced.len(), 1);
    assert_eq!(
        (produced.produced[0].seq_index, produced.produced[0].token),
        (0, 7)
    );
    s.check_invariants().unwrap();
    assert!(matches!(
        s.finish_sample("p", 0),
        Err(Error::InvalidArgument(_))
    ));

    let outputs = run_to_end(&mut s, 10);
    assert_eq!(outputs.keys().collect::<Vec<_>>(), vec!["p/0"]);
    assert_eq!(s.block_manager().stats().used_blocks, 0);
    assert_eq!(s.stats().finished_requests, 1);
}

#[test]
fn aging_bounds_how_long_a_low_priority_request_waits() {
    // One sequence at a time; each request runs 1 prefill + 1 decode step, so a new urgent
    // request arriving every step would starve priority 3 forever without aging.
    let aging_steps = 4;
    let mut cfg = config(64, 4);
    cfg.max_num_seqs = 1;
    cfg.policy = Policy::Priority { aging_steps };
    let mut s = Scheduler::new(cfg).unwrap();
    let options = |priority| RequestOptions {
        priority,
        ..Default::default()
    };
    let params = SamplingParams {
        max_tokens: 2,
        ..Default::default()
    };
    s.add_request("low", vec![1, 2], params.clone(), options(3))
        .unwrap();
    let mut admitted_before_low = Vec::new();
    for t in 0..40u64 {
        s.add_request(&format!("hi{t}"), vec![1, 2], params.clone(), options(0))
            .unwrap();
        let (out, _) = step(&mut s);
        if out.stats.num_admitted == 1 {
            let id = out.request_ids[0].to_string();
            if id == "low" {
                break;
            }
            admitted_before_low.push(id);
        }
    }
    // Bound: nothing added after step 0 + (3 - 0) * 4 = 12 goes ahead of "low" (added at 0).
    // hi0..hi12 have rank <= 12 = rank of low, and low wins the tie by add order, so exactly
    // hi0..hi11 go first.
    let expected: Vec<String> = (0..12).map(|t| format!("hi{t}")).collect();
    assert_eq!(admitted_before_low, expected);
}

#[test]
fn abort_in_every_state_returns_every_block() {
    let mut s = Scheduler::new(config(8, 4)).unwrap();
    add(&mut s, "running", vec![1; 9], 100);
    add(&mut s, "waiting", vec![2; 25], 100);
    step(&mut s);
    assert_eq!((s.num_running(), s.num_waiting()), (1, 1));
    s.abort("waiting").unwrap();
    s.abort("running").unwrap();
    assert!(matches!(s.abort("running"), Err(Error::UnknownSequence(_))));
    s.check_invariants().unwrap();
    assert_eq!(s.block_manager().stats().used_blocks, 0);

    // Aborted between schedule and update: its sample is dropped, the others go through.
    add(&mut s, "x", vec![1; 3], 5);
    add(&mut s, "y", vec![2; 3], 5);
    let id = s.schedule().unwrap().id;
    s.abort("x").unwrap();
    let produced = s.update(id, &[7, 8]).unwrap();
    assert_eq!(produced.produced.len(), 1);
    assert_eq!(&*produced.produced[0].request_id, "y");
    assert_eq!(produced.produced[0].token, 8);
    s.check_invariants().unwrap();
    assert_eq!(s.block_manager().stats().used_blocks, 1);
}

#[test]
fn finishing_on_stop_tokens_eos_and_max_model_len() {
    let mut cfg = config(16, 4);
    cfg.eos_token_ids = vec![2, 7];
    cfg.max_model_len = 6;
    let mut s = Scheduler::new(cfg).unwrap();
    let with = |stop: Vec<TokenId>, ignore_eos| SamplingParams {
        max_tokens: 100,
        stop_token_ids: stop,
        ignore_eos,
        n: 1,
    };
    s.add_request(
        "eos",
        vec![9; 3],
        with(vec![], false),
        RequestOptions::default(),
    )
    .unwrap();
    s.add_request(
        "ignore",
        vec![9; 3],
        with(vec![], true),
        RequestOptions::default(),
    )
    .unwrap();
    s.add_request(
        "stop",
        vec![9; 3],
        with(vec![5], true),
        RequestOptions::default(),
    )
    .unwrap();
    let id = s.schedule().unwrap().id;
    let produced = s.update(id, &[2, 2, 5]).unwrap();
    let finishes: Vec<_> = produced.produced.iter().map(|p| p.finish).collect();
    assert_eq!(
        finishes,
        vec![Some(FinishReason::Stop), None, Some(FinishReason::Stop)]
    );
    // "ignore" now holds 4 tokens; it ends when it holds 6 = max_model_len.
    let id = s.schedule().unwrap().id;
    assert_eq!(s.update(id, &[2]).unwrap().produced[0].finish, None);
    let id = s.schedule().unwrap().id;
    assert_eq!(
        s.update(id, &[2]).unwrap().produced[0].finish,
        Some(FinishReason::MaxModelLen)
    );
    let too_long = s.add_request(
        "long",
        vec![1; 6],
        SamplingParams::default(),
        RequestOptions::default(),
    );
    assert!(matches!(too_long, Err(Error::InvalidArgument(_))));
    assert!(!s.contains("long"));
}

#[test]
fn every_eos_id_finishes_unless_ignore_eos() {
    let mut cfg = config(16, 4);
    cfg.eos_token_ids = vec![2, 465];
    let mut s = Scheduler::new(cfg).unwrap();
    for (id, ignore_eos) in [("a", false), ("b", false), ("c", true)] {
        let params = SamplingParams {
            max_tokens: 4,
            ignore_eos,
            ..SamplingParams::default()
        };
        s.add_request(id, vec![9; 3], params, RequestOptions::default())
            .unwrap();
    }
    let id = s.schedule().unwrap().id;
    let produced = s.update(id, &[465, 2, 465]).unwrap();
    let finishes: Vec<_> = produced.produced.iter().map(|p| p.finish).collect();
    assert_eq!(
        finishes,
        vec![Some(FinishReason::Stop), Some(FinishReason::Stop), None]
    );
}

#[test]
fn limits_that_overflow_the_step_arrays_are_refused() {
    let refused = |edit: fn(&mut SchedulerConfig)| {
        let mut cfg = config(1 << 20, 1 << 12);
        edit(&mut cfg);
        matches!(Scheduler::new(cfg), Err(Error::InvalidArgument(_)))
    };
    // context_lens and query_start_loc are int32; sample indices u32.
    assert!(refused(|c| c.max_model_len = MAX_TOKENS_PER_ARRAY + 1));
    assert!(refused(
        |c| c.max_num_batched_tokens = MAX_TOKENS_PER_ARRAY + 1
    ));
    assert!(refused(|c| c.max_num_seqs = MAX_NUM_SEQS + 1));
    // The default max_model_len of a cache larger than an int32 is capped, not refused.
    let cfg = config(1 << 20, 1 << 12);
    assert_eq!(cfg.max_model_len, MAX_TOKENS_PER_ARRAY);
    assert!(matches!(
        Scheduler::new(config(4, 1 << 62)),
        Err(Error::InvalidArgument(_))
    ));
}

/// One random request of the property test.
#[derive(Debug, Clone)]
struct Spec {
    prompt_len: usize,
    shared_prefix: usize,
    max_tokens: usize,
    n: usize,
    priority: i64,
    stop: TokenId,
    arrive_at: usize,
    abort_at: Option<usize>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        1..60usize,
        0..40usize,
        1..20usize,
        1..4usize,
        0..3i64,
        0..50u32,
        0..30usize,
        proptest::option::weighted(0.15, 0..60usize),
    )
        .prop_map(
            |(prompt_len, shared_prefix, max_tokens, n, priority, stop, arrive_at, abort_at)| {
                Spec {
                    prompt_len,
                    shared_prefix,
                    max_tokens,
                    n,
                    priority,
                    stop,
                    arrive_at,
                    abort_at,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random workloads (arrivals, shared prefixes, forks, aborts, tight memory, both scheduling
    /// policies, both eviction policies):
    /// invariants hold after every call, no block leaks, and every request either finishes with
    /// a valid reason or was aborted, within a bounded number of steps.
    #[test]
    fn random_workloads_finish_every_request_without_leaks(
        specs in proptest::collection::vec(spec(), 1..24),
        num_blocks in 16..48usize,
        budget in 1..64usize,
        threshold in 0..20usize,
        max_num_seqs in 3..8usize,
        priority in any::<bool>(),
        slru in any::<bool>(),
        windows in proptest::collection::vec((proptest::option::of(1..12usize), 0..3u32), 1..4),
    ) {
        let mut cfg = config(num_blocks, 4);
        cfg.max_num_batched_tokens = budget;
        cfg.long_prefill_token_threshold = threshold;
        cfg.max_num_seqs = max_num_seqs;
        cfg.policy = if priority { Policy::Priority { aging_steps: 3 } } else { Policy::Fcfs };
        cfg.eviction_policy = if slru { EvictionPolicy::Slru } else { EvictionPolicy::Lru };
        // KV cache groups, each keeping every token or a window (a hybrid model's layout), in
        // blocks of 4, 2 or 1 tokens (pages of 4 carved into parts).
        let kept: Vec<GroupKeeping> = windows
            .iter()
            .map(|&(w, carve)| GroupKeeping {
                attention: w.map_or(AttentionKind::Full, |window| AttentionKind::Sliding { window }),
                block_size: 4 >> carve,
            })
            .collect();
        let chunk = chunk_limit(&cfg, budget);
        cfg.max_model_len = capacity_tokens(&kept, num_blocks, chunk).min(64);
        prop_assume!(cfg.max_model_len >= 2);
        let max_model_len = cfg.max_model_len;
        let mut s = Scheduler::keeping(cfg, kept).unwrap();
        let mut outcome: HashMap<String, &str> = HashMap::new();
        for t in 0..4000usize {
            for (i, spec) in specs.iter().enumerate() {
                let id = format!("r{i}");
                if spec.arrive_at == t {
                    let prompt: Vec<TokenId> = (0..spec.prompt_len)
                        .map(|p| if p < spec.shared_prefix { p as TokenId } else { (i * 1000 + p) as TokenId })
                        .collect();
                    let params = SamplingParams { max_tokens: spec.max_tokens, stop_token_ids: vec![spec.stop], ignore_eos: false, n: spec.n };
                    let options = RequestOptions { priority: spec.priority, ..Default::default() };
                    match s.add_request(&id, prompt, params, options) {
                        Ok(()) => { outcome.insert(id.clone(), "pending"); }
                        Err(_) => {
                            prop_assert!(spec.n > max_num_seqs || spec.prompt_len >= max_model_len);
                            outcome.insert(id.clone(), "rejected");
                        }
                    }
                }
                if spec.abort_at == Some(t) && s.contains(&id) {
                    s.abort(&id).unwrap();
                    outcome.insert(id, "aborted");
                }
            }
            s.check_invariants().map_err(TestCaseError::fail)?;
            if t > 60 && !s.has_unfinished() {
                break;
            }
            let (_, produced) = step(&mut s);
            for p in &produced.produced {
                prop_assert_eq!(outcome.get(&*p.request_id).copied(), Some("pending"));
            }
            for id in &produced.finished_requests {
                outcome.insert(id.to_string(), "finished");
            }
        }
        prop_assert!(!s.has_unfinished(), "requests left after 4000 steps");
        prop_assert_eq!(outcome.len(), specs.len(), "every request was submitted");
        prop_assert!(outcome.values().all(|&o| o != "pending"), "lost requests: {:?}", outcome);
        let stats = s.block_manager().stats();
        prop_assert_eq!(stats.used_blocks, 0);
        prop_assert_eq!(stats.free_blocks + stats.cached_blocks, num_blocks);
    }
}
