//! Fuzz target: a `Scheduler` driven by requests, aborts (in any state, mid-step included) and
//! schedule/update steps with sampled tokens decoded from the input, under a random configuration:
//! its KV cache groups too (one to three, each keeping every token or a sliding window, each in
//! blocks of its own size carved from the pages).
//!
//! Beside the scheduler runs a model of what it promises: the live requests with each sample's
//! tokens, and a simulated KV cache in which every slot holds a hash of the (salt, tokens) prefix
//! and the KV cache group whose K/V was last written there. Checked:
//! - every call either succeeds or returns the error class the model predicts, and a refused call
//!   changes nothing observable; `check_invariants` holds after every call;
//! - `update` accepts only the id of the step awaiting it: the previous step's id, another
//!   scheduler's (with the same step number), or any id while no step is pending, is refused;
//! - each step has the model-runner layout (one slot mapping and one block table per group),
//!   schedules only live samples' next tokens at their positions, writes no slot twice (in any
//!   group), and every position a row attends to in a group (after applying the copy-on-write ops,
//!   then the step's writes) holds that row's own prefix in that group: no sequence ever reads
//!   another's K/V, another group's or a stale block. A full group's table holds every block of
//!   the context; a sliding group's (window `w`) may show -1 only for a prefix of blocks wholly
//!   before `first + 1 - w` (`first` the row's first new position), which no query of the step
//!   reads;
//! - `update` yields one token per live sample in sample order, with the finish reason the
//!   request's limits and the configuration's end-of-sequence tokens imply, and finishes a request
//!   when its last sample ends;
//! - every added request ends exactly once (finished or aborted), a step with unfinished work
//!   schedules a token or preempts, a drain finishes everything, and with nothing unfinished every
//!   block is back in the pool. No call panics.
#![no_main]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pagedkv::kv::coordinator::capacity_tokens;
use pagedkv::scheduler::{
    FinishReason, Policy, RequestOptions, SamplingParams, SchedulerStats, StepId, StepOutput,
};
use pagedkv::{AttentionKind, Error, GroupKeeping, Scheduler, SchedulerConfig};

/// Request ids drawn from `r0..r{IDS}`: ids collide, repeat after a request ends, and miss.
const IDS: u8 = 10;
/// Prompt tokens are drawn from `0..PROMPT_ALPHABET` (so prompts share prefixes), sampled, stop
/// and end-of-sequence tokens from `0..TOKEN_ALPHABET`.
const PROMPT_ALPHABET: u8 = 4;
const TOKEN_ALPHABET: u8 = 8;
const MAX_PROMPT: usize = 80;
const HISTORY: usize = 16;
const SALTS: [Option<&[u8]>; 3] = [None, Some(b"a"), Some(b"b")];
/// Steps the final drain may take before the harness calls it a livelock.
const DRAIN_STEPS: usize = 20_000;
/// Longest sliding window drawn, in tokens.
const MAX_WINDOW: u8 = 12;

#[derive(Debug, Arbitrary)]
struct Config {
    num_blocks: u8,
    block_size: u8,
    max_num_seqs: u8,
    max_num_batched_tokens: u8,
    max_model_len: u8,
    prefix_caching: bool,
    aging_steps: Option<u8>,
    long_prefill_token_threshold: u8,
    /// End-of-sequence tokens: none, one or several (maybe repeated).
    eos: [Option<u8>; 3],
    lookahead: Option<u8>,
    /// The KV cache groups: `kept`, then each of `more_kept` present (one to three groups).
    kept: Kept,
    more_kept: [Option<Kept>; 2],
}

/// What a KV cache group keeps of a sequence (input bytes that run out give `Full`).
#[derive(Debug, Clone, Copy, Arbitrary)]
enum Kept {
    Full,
    /// A window of `1 + w % MAX_WINDOW` tokens.
    Sliding(u8),
}

impl Kept {
    fn kind(self) -> AttentionKind {
        match self {
            Kept::Full => AttentionKind::Full,
            Kept::Sliding(w) => AttentionKind::Sliding {
                window: 1 + usize::from(w % MAX_WINDOW),
            },
        }
    }
}

#[derive(Debug, Arbitrary)]
struct Input {
    config: Config,
    ops: Vec<Op>,
}

#[derive(Debug, Arbitrary)]
struct Add {
    id: u8,
    /// The prompt: a prefix (`keep` tokens) of a remembered prompt or live sequence (`base`),
    /// then `tail`.
    base: u8,
    keep: u8,
    tail: Vec<u8>,
    max_tokens: u8,
    n: u8,
    /// Small priorities, and both extremes of i64 (`priority()`).
    priority: i8,
    /// Small arrival times, then NaN and the infinities (`arrival_time()`).
    arrival: u8,
    salt: u8,
    ignore_eos: bool,
    stop: Vec<u8>,
}

impl Add {
    fn priority(&self) -> i64 {
        match self.priority {
            i8::MIN => i64::MIN,
            i8::MAX => i64::MAX,
            p => i64::from(p),
        }
    }

    fn arrival_time(&self) -> f64 {
        match self.arrival {
            255 => f64::NAN,
            254 => f64::INFINITY,
            253 => f64::NEG_INFINITY,
            t => f64::from(t) / 4.0,
        }
    }
}

#[derive(Debug, Arbitrary)]
enum Op {
    Add(Add),
    Abort(u8),
    /// `update` while no step is pending: refused.
    WrongStep(WrongStep),
    /// One schedule/update round; `between` runs after `schedule`, before `update`. `misuse`
    /// bits: 1 = `schedule` twice, 2 = `update` with the wrong number of tokens first. The
    /// samples get `tokens` in turn.
    Step {
        between: Vec<Between>,
        misuse: u8,
        tokens: [u8; 4],
    },
}

#[derive(Debug, Arbitrary)]
enum Between {
    Add(Add),
    Abort(u8),
    /// `update` of the pending step under another step's id: refused.
    WrongStep(WrongStep),
}

/// A step id that is not the one awaiting `update`.
#[derive(Debug, Arbitrary)]
enum WrongStep {
    /// The id of the last step this scheduler updated (another scheduler's if there is none).
    Stale,
    /// The id of another scheduler's step with the number the pending (or next) step has.
    Foreign,
}

/// One sample of a live request, as the model sees it.
#[derive(Debug, Clone, Default)]
struct ModelSample {
    /// Created: sample 0 at `add_request`, the others when the prompt forks.
    exists: bool,
    finished: bool,
    outputs: Vec<u32>,
}

#[derive(Debug, Clone)]
struct ModelRequest {
    /// Distinguishes requests that reuse an id.
    serial: u64,
    prompt: Vec<u32>,
    params: SamplingParams,
    salt: usize,
    samples: Vec<ModelSample>,
}

impl ModelRequest {
    fn tokens(&self, index: u32) -> Vec<u32> {
        let mut tokens = self.prompt.clone();
        tokens.extend(&self.samples[index as usize].outputs);
        tokens
    }
}

/// Hash of the K/V at a position: depends on the salt and every token up to it.
fn kv_content(parent: u64, token: u32) -> u64 {
    let mut z = parent ^ u64::from(token).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The K/V of each prefix of `tokens` under `salt` in KV cache group `group` (a group's layers
/// have their own K/V: group 0's contents are the prefix hashes themselves).
fn prefix_contents(salt: usize, tokens: &[u32], group: usize) -> Vec<u64> {
    let mut h = kv_content(0x5a17, salt as u32);
    tokens
        .iter()
        .map(|&t| {
            h = kv_content(h, t);
            match group {
                0 => h,
                g => kv_content(h ^ 0x6a09_e667_f3bc_c908, g as u32),
            }
        })
        .collect()
}

#[derive(Debug, PartialEq)]
enum Outcome {
    Ok,
    Unknown,
    Duplicate,
    Invalid,
    Shape,
}

fn outcome<T>(result: Result<T, Error>) -> Outcome {
    match result {
        Ok(_) => Outcome::Ok,
        Err(Error::UnknownSequence(_)) => Outcome::Unknown,
        Err(Error::DuplicateSequence(_)) => Outcome::Duplicate,
        Err(Error::InvalidArgument(_)) => Outcome::Invalid,
        Err(Error::Shape(_)) => Outcome::Shape,
        Err(other) => panic!("unexpected error class: {other:?}"),
    }
}

/// What a refused call must leave unchanged.
#[derive(Debug, PartialEq)]
struct Snapshot {
    stats: SchedulerStats,
    blocks: pagedkv::BlockStats,
    pending: Option<StepId>,
    live: Vec<bool>,
}

struct Harness {
    scheduler: Scheduler,
    /// An idle scheduler of the same configuration, whose step ids are foreign to `scheduler`.
    other: Scheduler,
    config: SchedulerConfig,
    /// What each KV cache group keeps.
    kept: Vec<GroupKeeping>,
    /// Steps `scheduler` has built, and the id of the last one it updated.
    steps: u64,
    last_step: Option<StepId>,
    /// Samples of the pending step (0 when none is).
    pending_samples: usize,
    live: BTreeMap<String, ModelRequest>,
    next_serial: u64,
    finished: u64,
    aborted: u64,
    history: Vec<Vec<u32>>,
    /// Simulated KV cache: the (prefix, group) hash last written to each slot. One vector for
    /// all groups: their tables hold different blocks of the one pool.
    kv: Vec<Option<u64>>,
    /// Tokens sampled in the final drain, which cycles through the alphabet.
    drained: u32,
}

fn request_id(id: u8) -> String {
    format!("r{}", id % IDS)
}

impl Harness {
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            stats: self.scheduler.stats(),
            blocks: self.scheduler.block_manager().stats(),
            pending: self.scheduler.pending_step(),
            live: (0..IDS)
                .map(|i| self.scheduler.contains(&request_id(i)))
                .collect(),
        }
    }

    /// Runs `call`; if it fails, asserts that it changed nothing.
    fn refusable<T>(&mut self, call: impl FnOnce(&mut Scheduler) -> Result<T, Error>) -> Outcome {
        let before = self.snapshot();
        let got = outcome(call(&mut self.scheduler));
        if got != Outcome::Ok {
            assert_eq!(
                self.snapshot(),
                before,
                "a refused call changed state: {got:?}"
            );
        }
        got
    }

    fn build_prompt(&mut self, add: &Add) -> Vec<u32> {
        let live = self.live.values().map(|r| r.tokens(0));
        let sources: Vec<Vec<u32>> = self.history.iter().cloned().chain(live).collect();
        let base: &[u32] = sources
            .get(add.base as usize % (sources.len() + 1))
            .map_or(&[], |s| s);
        let mut prompt = base[..add.keep as usize % (base.len() + 1)].to_vec();
        prompt.extend(add.tail.iter().map(|&t| u32::from(t % PROMPT_ALPHABET)));
        prompt.truncate(MAX_PROMPT);
        if self.history.len() == HISTORY {
            self.history.remove(0);
        }
        self.history.push(prompt.clone());
        prompt
    }

    fn add(&mut self, add: &Add) {
        let id = request_id(add.id);
        let prompt = self.build_prompt(add);
        let params = SamplingParams {
            max_tokens: usize::from(add.max_tokens % 24),
            stop_token_ids: add
                .stop
                .iter()
                .take(3)
                .map(|&t| u32::from(t % TOKEN_ALPHABET))
                .collect(),
            ignore_eos: add.ignore_eos,
            n: usize::from(add.n % 5),
        };
        let salt = add.salt as usize % SALTS.len();
        let options = RequestOptions {
            priority: add.priority(),
            arrival_time: add.arrival_time(),
            cache_salt: SALTS[salt].map(<[u8]>::to_vec),
        };
        let want = if self.live.contains_key(&id) {
            Outcome::Duplicate
        } else if prompt.is_empty()
            || params.max_tokens == 0
            || params.n == 0
            || params.n > self.config.max_num_seqs
            || prompt.len() >= self.config.max_model_len
            || add.arrival_time().is_nan()
        {
            Outcome::Invalid
        } else {
            Outcome::Ok
        };
        let got = self.refusable(|s| s.add_request(&id, prompt.clone(), params.clone(), options));
        assert_eq!(got, want, "add_request({id}, {prompt:?}, {params:?})");
        if got == Outcome::Ok {
            let mut samples = vec![ModelSample::default(); params.n];
            samples[0].exists = true;
            self.live.insert(
                id,
                ModelRequest {
                    serial: self.next_serial,
                    prompt,
                    params,
                    salt,
                    samples,
                },
            );
            self.next_serial += 1;
        }
    }

    fn abort(&mut self, id: u8) {
        let id = request_id(id);
        let want = if self.live.contains_key(&id) {
            Outcome::Ok
        } else {
            Outcome::Unknown
        };
        assert_eq!(self.refusable(|s| s.abort(&id)), want, "abort({id})");
        if want == Outcome::Ok {
            self.live.remove(&id);
            self.aborted += 1;
        }
    }

    fn between(&mut self, op: &Between) {
        match op {
            Between::Add(add) => self.add(add),
            Between::Abort(id) => self.abort(*id),
            Between::WrongStep(wrong) => self.wrong_step(wrong),
        }
    }

    /// An id of another scheduler's step numbered `number`, or later if it is past that.
    fn foreign_step(&mut self, number: u64) -> StepId {
        loop {
            let id = self.other.schedule().expect("idle scheduler").id;
            self.other.update(id, &[]).expect("its own step");
            if id.number() >= number {
                return id;
            }
        }
    }

    /// `update` under a step id other than the pending one (with the right token count) is
    /// refused with `InvalidArgument` and changes nothing.
    fn wrong_step(&mut self, wrong: &WrongStep) {
        let pending = self.scheduler.pending_step();
        let id = match (wrong, self.last_step) {
            (WrongStep::Stale, Some(last)) => last,
            _ => self.foreign_step(pending.map_or(self.steps, StepId::number)),
        };
        assert_ne!(Some(id), pending, "the harness built the pending id");
        let tokens = vec![0; self.pending_samples];
        assert_eq!(
            self.refusable(|s| s.update(id, &tokens).map(|_| ())),
            Outcome::Invalid,
            "update({id:?}) with {pending:?} pending"
        );
    }

    /// Checks a step's layout and simulates its K/V writes and reads, in every KV cache group.
    fn check_step(&mut self, out: &StepOutput) {
        // A page of `page` tokens; a group's blocks may carve it into smaller ones. The simulated
        // cache is indexed by (page, row of the group's block in it): a page is in one group's
        // tables at a time, so no two groups' slots meet.
        let page = self.config.block_size;
        let rows = out.num_seqs();
        let t = out.num_tokens();
        let groups = self.kept.len();
        let width = out.block_table_width;
        assert!(
            t <= self.config.max_num_batched_tokens,
            "over the token budget"
        );
        assert_eq!(t, out.stats.num_scheduled_tokens);
        assert_eq!(out.num_kv_groups, groups, "KV cache groups of the step");
        assert_eq!(
            (out.positions.len(), out.slot_mapping.len()),
            (t, groups * t)
        );
        assert_eq!(out.query_start_loc.len(), rows + 1);
        assert_eq!((out.request_ids.len(), out.seq_indices.len()), (rows, rows));
        assert_eq!(out.block_tables.len(), groups * rows * width);
        assert_eq!(out.query_start_loc[0], 0);
        assert_eq!(out.query_start_loc[rows] as usize, t);
        assert_eq!(out.copy_ops.len() % 2, 0);
        let capacity = self.config.num_blocks;
        for op in out.copy_ops.chunks(2) {
            let (src, dst) = (op[0] as usize, op[1] as usize);
            assert!(
                src < capacity && dst < capacity && src != dst,
                "copy op {op:?}"
            );
            for offset in 0..page {
                self.kv[dst * page + offset] = self.kv[src * page + offset];
            }
        }
        let mut row_of = HashMap::new();
        let mut written = HashSet::new();
        let mut reads = Vec::new();
        for i in 0..rows {
            let request = &self.live[&*out.request_ids[i]];
            let index = out.seq_indices[i];
            assert!(
                request
                    .samples
                    .get(index as usize)
                    .is_some_and(|s| s.exists && !s.finished),
                "row {i} runs a sample that does not exist"
            );
            assert!(
                row_of.insert((request.serial, index), i).is_none(),
                "a sample scheduled twice in one step"
            );
            let tokens = request.tokens(index);
            let (start, end) = (
                out.query_start_loc[i] as usize,
                out.query_start_loc[i + 1] as usize,
            );
            assert!(start < end, "row {i} schedules no token");
            let context = out.context_lens[i] as usize;
            assert!(context <= tokens.len() && context <= self.config.max_model_len);
            let first = context - (end - start);
            for (j, position) in (start..end).zip(first..context) {
                assert_eq!(out.positions[j], position as i64);
                assert_eq!(out.input_ids[j], i64::from(tokens[position]));
            }
            for (g, &kept) in self.kept.iter().enumerate() {
                let bs = kept.block_size;
                let held = context.div_ceil(bs);
                // The first position a query of this row reads in this group.
                let read_from = match kept.attention {
                    AttentionKind::Full => 0,
                    AttentionKind::Sliding { window } => (first + 1).saturating_sub(window),
                };
                let table = &out.block_tables[(g * rows + i) * width..][..width];
                assert!(
                    held <= width,
                    "row {i} group {g}: table narrower than its context"
                );
                // A window's released blocks: a prefix of -1 entries, each block wholly before
                // `read_from` (none in a full group).
                let released = table[..held].iter().take_while(|&&b| b == -1).count();
                assert!(
                    released * bs <= read_from,
                    "row {i} group {g} ({kept:?}): {released} leading blocks released, but \
                     position {read_from} (first {first}) is read"
                );
                assert!(
                    table[released..held]
                        .iter()
                        .all(|&b| (0..capacity as i32).contains(&b)),
                    "row {i} group {g}: a held entry is not a block: {table:?}"
                );
                assert!(
                    table[held..].iter().all(|&b| b == -1),
                    "row {i} group {g} is not padded with -1"
                );
                let distinct: HashSet<_> = table[released..held].iter().collect();
                assert_eq!(
                    distinct.len(),
                    held - released,
                    "row {i} group {g} holds a block twice"
                );
                let contents = prefix_contents(request.salt, &tokens[..context], g);
                for (j, position) in (start..end).zip(first..context) {
                    let slot = i64::from(table[position / bs]) * bs as i64 + (position % bs) as i64;
                    assert_eq!(
                        out.slot_mapping[g * t + j],
                        slot,
                        "slot of row {i} position {position} in group {g}"
                    );
                    let cell = table[position / bs] as usize * page + position % bs;
                    assert!(
                        written.insert(cell),
                        "slot {slot} of group {g} written twice in one step"
                    );
                    self.kv[cell] = Some(contents[position]);
                }
                for (position, &content) in contents.iter().enumerate().skip(read_from) {
                    let cell = table[position / bs] as usize * page + position % bs;
                    reads.push((i, g, position, cell, content));
                }
            }
        }
        for (i, g, position, slot, content) in reads {
            assert_eq!(
                self.kv[slot],
                Some(content),
                "row {i} reads position {position} of group {g} from slot {slot} holding other K/V"
            );
        }
        let samples = out.num_samples();
        assert_eq!(out.sample_request_ids.len(), samples);
        assert_eq!(out.sample_seq_indices.len(), samples);
        let mut sampled = HashSet::new();
        for k in 0..samples {
            let request = &self.live[&*out.sample_request_ids[k]];
            let index = out.sample_seq_indices[k];
            assert!(index < request.params.n as u32);
            assert!(
                sampled.insert((request.serial, index)),
                "a sample sampled twice"
            );
            let token = out.logits_indices[k];
            let row = (0..rows)
                .find(|&i| out.query_start_loc[i + 1] as i64 - 1 == token)
                .expect("a sample's logits row ends a row");
            assert_eq!(&*out.request_ids[row], &*out.sample_request_ids[k]);
            let sample = &request.samples[index as usize];
            // A fork samples from its parent's row, the prompt just computed.
            let length = if sample.exists {
                request.prompt.len() + sample.outputs.len()
            } else {
                request.prompt.len()
            };
            assert_eq!(
                out.context_lens[row] as usize, length,
                "sample {k} is not at its end"
            );
        }
        for (&(serial, index), &row) in &row_of {
            let request = self
                .live
                .values()
                .find(|r| r.serial == serial)
                .expect("live");
            if out.context_lens[row] as usize == request.tokens(index).len() {
                assert!(
                    sampled.contains(&(serial, index)),
                    "row {row} ends its tokens unsampled"
                );
            }
        }
        for k in 0..samples {
            let request = self
                .live
                .get_mut(&*out.sample_request_ids[k])
                .expect("live");
            request.samples[out.sample_seq_indices[k] as usize].exists = true;
        }
    }

    fn step(&mut self, between: &[Between], misuse: u8, tokens: Option<&[u8; 4]>) {
        let unfinished = self.scheduler.has_unfinished();
        let out = self.scheduler.schedule().expect("no step pending").clone();
        assert_eq!(self.scheduler.pending_step(), Some(out.id));
        assert_eq!(out.id.number(), self.steps, "step numbers count from 0");
        self.steps += 1;
        self.pending_samples = out.num_samples();
        if unfinished {
            assert!(
                out.stats.num_scheduled_tokens > 0 || out.stats.num_preempted > 0,
                "a step with unfinished requests did nothing"
            );
        }
        self.check_step(&out);
        if misuse & 1 != 0 {
            assert_eq!(
                self.refusable(|s| s.schedule().map(|_| ())),
                Outcome::Invalid
            );
        }
        // Which request each sample belongs to, as scheduled (ids may be reused in between).
        let serials: Vec<u64> = out
            .sample_request_ids
            .iter()
            .map(|id| self.live[&**id].serial)
            .collect();
        for op in between.iter().take(4) {
            self.between(op);
        }
        let sampled: Vec<u32> = (0..out.num_samples())
            .map(|k| match tokens {
                Some(tokens) => u32::from(tokens[k % tokens.len()] % TOKEN_ALPHABET),
                None => {
                    self.drained += 1;
                    self.drained % u32::from(TOKEN_ALPHABET)
                }
            })
            .collect();
        if misuse & 2 != 0 {
            let mut wrong = sampled.clone();
            wrong.push(0);
            assert_eq!(
                self.refusable(|s| s.update(out.id, &wrong).map(|_| ())),
                Outcome::Shape
            );
        }
        let update = self
            .scheduler
            .update(out.id, &sampled)
            .expect("one token per sample")
            .clone();
        assert_eq!(self.scheduler.pending_step(), None);
        self.last_step = Some(out.id);
        self.pending_samples = 0;
        self.scheduler
            .check_invariants()
            .expect("invariants after update");
        let mut produced = update.produced.iter();
        let mut ended = Vec::new();
        for k in 0..out.num_samples() {
            let id = &out.sample_request_ids[k];
            let Some(request) = self.live.get_mut(&**id).filter(|r| r.serial == serials[k]) else {
                continue; // aborted since it was scheduled: no token
            };
            let p = produced.next().expect("a token per live sample");
            let index = out.sample_seq_indices[k];
            assert_eq!(
                (&*p.request_id, p.seq_index, p.token),
                (&**id, index, sampled[k])
            );
            let sample = &mut request.samples[index as usize];
            sample.outputs.push(sampled[k]);
            let params = &request.params;
            let length = request.prompt.len() + sample.outputs.len();
            let want = if params.stop_token_ids.contains(&p.token)
                || (!params.ignore_eos && self.config.eos_token_ids.contains(&p.token))
            {
                Some(FinishReason::Stop)
            } else if sample.outputs.len() >= params.max_tokens {
                Some(FinishReason::Length)
            } else if length >= self.config.max_model_len {
                Some(FinishReason::MaxModelLen)
            } else {
                None
            };
            assert_eq!(
                p.finish, want,
                "finish of {id}/{index} after {:?}",
                sample.outputs
            );
            if want.is_some() {
                sample.finished = true;
                if request.samples.iter().all(|s| s.finished) {
                    ended.push(id.clone());
                }
            }
        }
        assert!(
            produced.next().is_none(),
            "a token for an aborted or unknown sample"
        );
        let reported: Vec<Arc<str>> = update.finished_requests.clone();
        assert_eq!(reported, ended, "finished requests");
        for id in &ended {
            self.live.remove(&**id);
            self.finished += 1;
        }
    }

    fn check_state(&self) {
        if let Err(broken) = self.scheduler.check_invariants() {
            panic!("check_invariants: {broken}");
        }
        let stats = self.scheduler.stats();
        assert_eq!(stats.num_unfinished_requests, self.live.len());
        assert_eq!(self.scheduler.has_unfinished(), !self.live.is_empty());
        assert_eq!(
            (stats.finished_requests, stats.aborted_requests),
            (self.finished, self.aborted)
        );
        for (id, request) in &self.live {
            assert!(self.scheduler.contains(id));
            for (index, sample) in request.samples.iter().enumerate() {
                let tokens = self.scheduler.sequence_tokens(id, index as u32);
                if sample.exists && !sample.finished {
                    assert_eq!(
                        tokens.expect("live sample"),
                        &request.tokens(index as u32)[..]
                    );
                } else {
                    assert!(matches!(tokens, Err(Error::UnknownSequence(_))));
                }
            }
        }
        let blocks = self.scheduler.block_manager().stats();
        assert_eq!(
            blocks.free_blocks + blocks.cached_blocks + blocks.used_blocks,
            blocks.num_blocks
        );
        if self.live.is_empty() {
            assert_eq!(blocks.used_blocks, 0, "blocks held with nothing unfinished");
            assert_eq!(self.scheduler.block_manager().num_sequences(), 0);
            assert_eq!((stats.num_running, stats.num_waiting), (0, 0));
        }
    }
}

/// The configuration and the KV cache groups it keeps. `max_model_len` is within what the groups
/// hold (`capacity_tokens`); when that is under 2 tokens, the pool grows until it is not.
fn config(c: &Config) -> (SchedulerConfig, Vec<GroupKeeping>) {
    let page = 1 + usize::from(c.block_size % 8);
    // Each group's blocks: a divisor of the page's tokens (a group carving its pages), picked by
    // the block-size byte's high bits (the low three give the page), the page itself first.
    let divisors: Vec<usize> = (1..=page).rev().filter(|d| page % d == 0).collect();
    let kept: Vec<GroupKeeping> = std::iter::once(c.kept)
        .chain(c.more_kept.iter().flatten().copied())
        .enumerate()
        .map(|(g, kept)| GroupKeeping {
            attention: kept.kind(),
            block_size: divisors[usize::from(c.block_size >> (3 + 2 * g)) % 4 % divisors.len()],
        })
        .collect();
    let mut config = SchedulerConfig::new(2 + usize::from(c.num_blocks % 31), page);
    config.max_num_seqs = 1 + usize::from(c.max_num_seqs % 8);
    config.max_num_batched_tokens = 1 + usize::from(c.max_num_batched_tokens % 64);
    config.enable_prefix_caching = c.prefix_caching;
    if let Some(aging) = c.aging_steps {
        config.policy = Policy::Priority {
            aging_steps: 1 + u64::from(aging % 4),
        };
    }
    config.long_prefill_token_threshold = usize::from(c.long_prefill_token_threshold % 17);
    // The longest prefill chunk, as the scheduler caps it.
    let chunk = match config.long_prefill_token_threshold {
        0 => config.max_num_batched_tokens,
        cap => cap.min(config.max_num_batched_tokens),
    };
    let capacity = loop {
        let capacity = capacity_tokens(&kept, config.num_blocks, chunk);
        if capacity >= 2 {
            break capacity;
        }
        config.num_blocks += 1;
    };
    // With one full group: 2..=num_blocks * block_size, as before groups existed.
    config.max_model_len = 2 + usize::from(c.max_model_len) % (capacity - 1);
    config.eos_token_ids = c
        .eos
        .iter()
        .flatten()
        .map(|&t| u32::from(t % TOKEN_ALPHABET))
        .collect();
    config.admission_lookahead_tokens = c.lookahead.map(|l| usize::from(l % 48));
    (config, kept)
}

fuzz_target!(|input: Input| {
    let (config, kept) = config(&input.config);
    let mut h = Harness {
        scheduler: Scheduler::keeping(config.clone(), kept.clone()).expect("a valid configuration"),
        other: Scheduler::keeping(config.clone(), kept.clone()).expect("a valid configuration"),
        kept,
        steps: 0,
        last_step: None,
        pending_samples: 0,
        kv: vec![None; config.num_blocks * config.block_size],
        config,
        live: BTreeMap::new(),
        next_serial: 0,
        finished: 0,
        aborted: 0,
        history: Vec::new(),
        drained: 0,
    };
    for op in &input.ops {
        match op {
            Op::Add(add) => h.add(add),
            Op::Abort(id) => h.abort(*id),
            Op::WrongStep(wrong) => h.wrong_step(wrong),
            Op::Step {
                between,
                misuse,
                tokens,
            } => h.step(between, *misuse, Some(tokens)),
        }
        h.check_state();
    }
    // Drain: every request must end.
    let mut steps = 0;
    while h.scheduler.has_unfinished() {
        assert!(
            steps < DRAIN_STEPS,
            "not finished after {DRAIN_STEPS} steps"
        );
        h.step(&[], 0, None);
        h.check_state();
        steps += 1;
    }
    assert!(
        h.live.is_empty(),
        "the model has requests the scheduler ended silently"
    );
});
