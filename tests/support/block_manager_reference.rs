//! The reference model of the `BlockManager`, run by its fuzz target
//! (`fuzz/fuzz_targets/block_manager.rs`, inputs from libFuzzer) and its property test
//! (`tests/block_manager_model.rs`, inputs from proptest): one model, one driver ([`run`]).
//!
//! An [`Input`] (sizes and an operation sequence, decoded by `arbitrary` from bytes) drives a
//! `BlockManager` and the model side by side. The model does not guess which clean block the free
//! list hands out (that order is not part of the contract): it binds every block the manager takes
//! to its real id, and asserts the id was takeable — clean while any block is clean, else the
//! least recently released cached block. All else it predicts: ref counts, the prefix cache as a
//! map from (salt, whole token prefix) to block, hit lengths, which operations are refused and
//! with which error (`can_allocate` included), every `stats` counter.
//!
//! Checked after every operation: `check_invariants`; free + cached + used == num_blocks, each as
//! the model says; every table (blocks and tokens) equals the model's, so a refused operation
//! changed nothing; the prefix cache answers every registered prefix as the model does. Slot
//! mappings and batched block tables are checked against the model's tables. At the end every
//! sequence is freed and no block may stay in use.

use std::collections::{BTreeMap, HashMap, VecDeque};

use arbitrary::Arbitrary;
use pagedkv::{BlockId, BlockManager, CopyOp, Error, PrefixMatch, SeqId, RELEASED};

/// Sequence ids drawn from `0..SEQ_IDS`, so operations often hit live (and missing) sequences.
const SEQ_IDS: u8 = 8;
/// Tokens drawn from `0..ALPHABET`: few symbols, so prompts share prefixes and hits are common.
const ALPHABET: u8 = 3;
const MAX_PROMPT: usize = 48;
const MAX_APPEND: usize = 16;
/// Prompts remembered for building later prompts from their prefixes.
const HISTORY: usize = 16;
const SALTS: [Option<&[u8]>; 4] = [None, Some(b""), Some(b"a"), Some(b"b")];

#[derive(Debug, Arbitrary)]
pub struct Input {
    num_blocks: u8,
    block_size: u8,
    prefix_caching: bool,
    ops: Vec<Op>,
}

/// A prompt: a prefix of a remembered prompt or live sequence (`base`, `keep`), then `tail`.
#[derive(Debug, Arbitrary)]
struct Prompt {
    base: u8,
    keep: u8,
    tail: Vec<u8>,
    salt: u8,
}

#[derive(Debug, Arbitrary)]
enum Op {
    Allocate {
        seq: u8,
        prompt: Prompt,
    },
    /// `match_prefix` now, or reuse the match of the last `Lookup` (maybe stale), then `admit`
    /// the first `chunk` tokens (maybe none, or fewer than the cached ones).
    Admit {
        seq: u8,
        prompt: Prompt,
        chunk: u8,
        reuse_lookup: bool,
    },
    Append {
        seq: u8,
        tokens: Vec<u8>,
    },
    Fork {
        parent: u8,
        child: u8,
    },
    Free {
        seq: u8,
    },
    /// A sliding window releases the blocks wholly before token `first_needed`.
    ReleaseBefore {
        seq: u8,
        first_needed: u8,
    },
    Lookup {
        prompt: Prompt,
    },
    /// `slot_mapping(seqs, counts)`: lengths may differ, a sequence be missing, a count exceed
    /// its sequence's tokens by one.
    SlotMapping {
        seqs: Vec<u8>,
        counts: Vec<u8>,
    },
    Tables {
        seqs: Vec<u8>,
        min_width: u8,
    },
}

/// A prefix-cache key: salt index and the whole token prefix up to a block boundary.
type Key = (usize, Vec<u32>);

#[derive(Debug, Clone, Default)]
struct ModelBlock {
    refs: u32,
    key: Option<Key>,
}

#[derive(Debug, Clone)]
struct ModelSeq {
    salt: usize,
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
}

/// A lookup kept for a later `Admit`: the manager's answer and the keys the model expects.
#[derive(Clone)]
struct SavedLookup {
    prompt: Vec<u32>,
    salt: usize,
    found: PrefixMatch,
    keys: Vec<Key>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Counters {
    allocations: u64,
    evictions: u64,
    cow_copies: u64,
    queried: u64,
    hits: u64,
}

struct Model {
    block_size: usize,
    caching: bool,
    blocks: Vec<ModelBlock>,
    /// Cached unreferenced blocks, least recently released first.
    lru: VecDeque<BlockId>,
    index: HashMap<Key, BlockId>,
    seqs: BTreeMap<SeqId, ModelSeq>,
    counters: Counters,
    history: Vec<Vec<u32>>,
    saved: Option<SavedLookup>,
}

/// What an operation returned, reduced to what the model can predict.
#[derive(Debug, PartialEq)]
enum Outcome {
    Done,
    Cached(usize),
    Copy(Option<CopyOp>),
    Released(usize),
    Slots(Vec<i64>),
    OutOfBlocks { needed: usize, available: usize },
    Unknown,
    Duplicate,
    Invalid,
    Shape,
}

fn outcome<T>(result: Result<T, Error>, ok: impl FnOnce(T) -> Outcome) -> Outcome {
    match result {
        Ok(value) => ok(value),
        Err(Error::OutOfBlocks { needed, available }) => Outcome::OutOfBlocks { needed, available },
        Err(Error::UnknownSequence(_)) => Outcome::Unknown,
        Err(Error::DuplicateSequence(_)) => Outcome::Duplicate,
        Err(Error::InvalidArgument(_)) => Outcome::Invalid,
        Err(Error::Shape(_)) => Outcome::Shape,
        Err(other) => panic!("unexpected error class: {other:?}"),
    }
}

fn tokens(raw: &[u8], cap: usize) -> impl Iterator<Item = u32> + '_ {
    raw.iter().take(cap).map(|&t| u32::from(t % ALPHABET))
}

impl Model {
    fn new(num_blocks: usize, block_size: usize, caching: bool) -> Self {
        Model {
            block_size,
            caching,
            blocks: vec![ModelBlock::default(); num_blocks],
            lru: VecDeque::new(),
            index: HashMap::new(),
            seqs: BTreeMap::new(),
            counters: Counters::default(),
            history: Vec::new(),
            saved: None,
        }
    }

    fn is_clean(&self, block: BlockId) -> bool {
        let b = &self.blocks[block as usize];
        b.refs == 0 && b.key.is_none()
    }

    fn num_clean(&self) -> usize {
        (0..self.blocks.len() as BlockId)
            .filter(|&b| self.is_clean(b))
            .count()
    }

    fn num_used(&self) -> usize {
        self.blocks.iter().filter(|b| b.refs > 0).count()
    }

    fn available(&self) -> usize {
        self.num_clean() + self.lru.len()
    }

    fn build_prompt(&mut self, prompt: &Prompt) -> (Vec<u32>, usize) {
        let sources = self.history.len() + self.seqs.len() + 1;
        let pick = prompt.base as usize % sources;
        let base: &[u32] = if pick < self.history.len() {
            &self.history[pick]
        } else {
            self.seqs
                .values()
                .nth(pick - self.history.len())
                .map_or(&[], |s| &s.tokens)
        };
        let mut tokens_out = base[..prompt.keep as usize % (base.len() + 1)].to_vec();
        tokens_out.extend(tokens(&prompt.tail, MAX_PROMPT));
        tokens_out.truncate(MAX_PROMPT);
        if self.history.len() == HISTORY {
            self.history.remove(0);
        }
        self.history.push(tokens_out.clone());
        (tokens_out, prompt.salt as usize % SALTS.len())
    }

    /// Keys of the cached leading blocks of `prompt`, always leaving its last token uncached.
    fn hits(&self, salt: usize, prompt: &[u32]) -> (Vec<BlockId>, Vec<Key>) {
        let (mut blocks, mut keys) = (Vec::new(), Vec::new());
        if !self.caching || prompt.is_empty() {
            return (blocks, keys);
        }
        for n in 1..=(prompt.len() - 1) / self.block_size {
            let key = (salt, prompt[..n * self.block_size].to_vec());
            match self.index.get(&key) {
                Some(&b) => {
                    blocks.push(b);
                    keys.push(key);
                }
                None => break,
            }
        }
        (blocks, keys)
    }

    /// The manager took `block`: it must have been takeable, and evicting it drops its key.
    fn take(&mut self, block: BlockId) {
        assert_eq!(
            self.blocks[block as usize].refs, 0,
            "took in-use block {block}"
        );
        if self.num_clean() > 0 {
            assert!(
                self.is_clean(block),
                "took cached block {block} while a clean block was free"
            );
        } else {
            assert_eq!(
                self.lru.front(),
                Some(&block),
                "evicted a block other than the LRU head"
            );
            self.lru.pop_front();
            let key = self.blocks[block as usize].key.take().expect("cached");
            self.index.remove(&key);
            self.counters.evictions += 1;
        }
        self.blocks[block as usize].refs = 1;
        self.counters.allocations += 1;
    }

    fn retain(&mut self, block: BlockId) {
        if self.blocks[block as usize].refs == 0 {
            let at = self
                .lru
                .iter()
                .position(|&b| b == block)
                .expect("revived block is cached");
            self.lru.remove(at);
        }
        self.blocks[block as usize].refs += 1;
    }

    fn release(&mut self, block: BlockId) {
        let b = &mut self.blocks[block as usize];
        assert!(b.refs > 0, "model released unreferenced block {block}");
        b.refs -= 1;
        if b.refs == 0 && b.key.is_some() {
            self.lru.push_back(block);
        }
    }

    /// Appends `new` to `seq`, binding each block it takes to the next of `real` (the manager's
    /// table after the operation).
    fn grow(&mut self, seq: &mut ModelSeq, new: &[u32], real: &[BlockId]) {
        let bs = self.block_size;
        for &token in new {
            if seq.tokens.len().is_multiple_of(bs) {
                let block = *real.get(seq.blocks.len()).expect("manager table too short");
                self.take(block);
                seq.blocks.push(block);
            }
            seq.tokens.push(token);
            if self.caching && seq.tokens.len().is_multiple_of(bs) {
                let key = (seq.salt, seq.tokens.clone());
                let block = *seq.blocks.last().expect("a block per token");
                if self.blocks[block as usize].key.is_none() && !self.index.contains_key(&key) {
                    self.index.insert(key.clone(), block);
                    self.blocks[block as usize].key = Some(key);
                }
            }
        }
    }

    /// Available blocks admitting `num_tokens` tokens over the (current) cached `found` uses up:
    /// the new blocks and the unreferenced hits it revives.
    fn blocks_to_admit(&self, found: &[BlockId], num_tokens: usize) -> usize {
        let revived = found
            .iter()
            .filter(|&&b| self.blocks[b as usize].refs == 0)
            .count();
        num_tokens.div_ceil(self.block_size) - found.len() + revived
    }

    /// Predicts `slot_mapping(seqs, counts)`: the slots of each sequence's last `count` tokens.
    fn slot_mapping(&self, seqs: &[SeqId], counts: &[usize]) -> Outcome {
        if seqs.len() != counts.len() {
            return Outcome::Shape;
        }
        let bs = self.block_size;
        let mut slots = Vec::new();
        for (seq, &count) in seqs.iter().zip(counts) {
            let Some(state) = self.seqs.get(seq) else {
                return Outcome::Unknown;
            };
            let end = state.tokens.len();
            let Some(start) = end.checked_sub(count) else {
                return Outcome::Invalid;
            };
            if (start..end).any(|p| state.blocks[p / bs] == RELEASED) {
                return Outcome::Invalid; // a window released that block: it has no slots
            }
            slots.extend(
                (start..end).map(|p| i64::from(state.blocks[p / bs]) * bs as i64 + (p % bs) as i64),
            );
        }
        Outcome::Slots(slots)
    }

    /// Predicts `admit(seq, tokens, found)`; on success applies it, binding new blocks to `real`.
    fn admit(
        &mut self,
        seq: SeqId,
        salt: usize,
        tokens_in: &[u32],
        queried: usize,
        found: (&[BlockId], &[Key]),
        real: Option<&[BlockId]>,
    ) -> Outcome {
        if self.seqs.contains_key(&seq) {
            return Outcome::Duplicate;
        }
        let cached = found.0.len() * self.block_size;
        if tokens_in.len() <= cached {
            return Outcome::Invalid;
        }
        let stale = found
            .0
            .iter()
            .zip(found.1)
            .any(|(&b, key)| self.blocks[b as usize].key.as_ref() != Some(key));
        if stale {
            return Outcome::Invalid;
        }
        let needed = self.blocks_to_admit(found.0, tokens_in.len());
        let available = self.available();
        if needed > available {
            return Outcome::OutOfBlocks { needed, available };
        }
        let Some(real) = real else {
            return Outcome::Cached(cached); // prediction only
        };
        for &b in found.0 {
            self.retain(b);
        }
        let mut state = ModelSeq {
            salt,
            tokens: tokens_in[..cached].to_vec(),
            blocks: found.0.to_vec(),
        };
        self.grow(&mut state, &tokens_in[cached..], real);
        self.seqs.insert(seq, state);
        self.counters.queried += queried as u64;
        self.counters.hits += cached as u64;
        Outcome::Cached(cached)
    }

    fn fork(&mut self, parent: SeqId, child: SeqId) -> Outcome {
        if self.seqs.contains_key(&child) {
            return Outcome::Duplicate;
        }
        let Some(state) = self.seqs.get(&parent).cloned() else {
            return Outcome::Unknown;
        };
        for &b in state.blocks.iter().filter(|&&b| b != RELEASED) {
            self.retain(b);
        }
        self.seqs.insert(child, state);
        Outcome::Done
    }

    fn free(&mut self, seq: SeqId) -> Outcome {
        let Some(state) = self.seqs.remove(&seq) else {
            return Outcome::Unknown;
        };
        for &b in state.blocks.iter().rev().filter(|&&b| b != RELEASED) {
            self.release(b);
        }
        Outcome::Done
    }

    /// Predicts `release_before`: the held blocks wholly before `first_needed` go, last first.
    fn release_before(&mut self, seq: SeqId, first_needed: usize) -> Outcome {
        let Some(mut state) = self.seqs.remove(&seq) else {
            return Outcome::Unknown;
        };
        let upto = first_needed.min(state.tokens.len()) / self.block_size;
        let gone: Vec<BlockId> = state.blocks[..upto]
            .iter()
            .copied()
            .filter(|&b| b != RELEASED)
            .collect();
        for &b in gone.iter().rev() {
            self.release(b);
        }
        state.blocks[..upto].fill(RELEASED);
        self.seqs.insert(seq, state);
        Outcome::Released(gone.len())
    }

    /// Predicts `append`; applies it when `real` (the manager's table afterwards) is given.
    fn append(&mut self, seq: SeqId, new: &[u32], real: Option<&[BlockId]>) -> Outcome {
        let Some(mut state) = self.seqs.get(&seq).cloned() else {
            return Outcome::Unknown;
        };
        if new.is_empty() {
            return Outcome::Copy(None);
        }
        let bs = self.block_size;
        let tail = (state.tokens.len() % bs != 0).then(|| *state.blocks.last().expect("tail"));
        let shared = tail.filter(|&b| self.blocks[b as usize].refs > 1);
        let needed = (state.tokens.len() + new.len()).div_ceil(bs) - state.blocks.len()
            + usize::from(shared.is_some());
        let available = self.available();
        if needed > available {
            return Outcome::OutOfBlocks { needed, available };
        }
        let Some(real) = real else {
            return Outcome::Copy(None); // prediction only: success
        };
        let copy = shared.map(|src| {
            let dst = real[state.blocks.len() - 1];
            self.take(dst);
            self.release(src);
            *state.blocks.last_mut().expect("tail") = dst;
            self.counters.cow_copies += 1;
            CopyOp { src, dst }
        });
        self.grow(&mut state, new, real);
        self.seqs.insert(seq, state);
        Outcome::Copy(copy)
    }
}

fn is_success(outcome: &Outcome) -> bool {
    matches!(
        outcome,
        Outcome::Done | Outcome::Cached(_) | Outcome::Copy(_) | Outcome::Slots(_)
    )
}

struct Harness {
    manager: BlockManager,
    model: Model,
}

impl Harness {
    fn real_blocks(&self, seq: SeqId) -> Vec<BlockId> {
        self.manager
            .table(seq)
            .map(|t| t.blocks().to_vec())
            .unwrap_or_default()
    }

    fn run(&mut self, op: &Op) {
        let seq_id = |s: u8| SeqId::from(s % SEQ_IDS);
        match op {
            Op::Allocate { seq, prompt } => {
                let seq = seq_id(*seq);
                let (prompt, salt) = self.model.build_prompt(prompt);
                let (blocks, keys) = self.model.hits(salt, &prompt);
                let fits = !prompt.is_empty()
                    && self.model.blocks_to_admit(&blocks, prompt.len()) <= self.model.available();
                assert_eq!(
                    self.manager.can_allocate(&prompt, SALTS[salt]),
                    fits,
                    "can_allocate({prompt:?}, salt {salt})"
                );
                let got = outcome(
                    self.manager.allocate(seq, &prompt, SALTS[salt]),
                    Outcome::Cached,
                );
                let want = if prompt.is_empty() {
                    Outcome::Invalid
                } else {
                    let real = is_success(&got).then(|| self.real_blocks(seq));
                    self.model.admit(
                        seq,
                        salt,
                        &prompt,
                        prompt.len(),
                        (&blocks, &keys),
                        real.as_deref(),
                    )
                };
                assert_eq!(got, want, "allocate({seq}, {prompt:?}, salt {salt})");
            }
            Op::Admit {
                seq,
                prompt,
                chunk,
                reuse_lookup,
            } => {
                let seq = seq_id(*seq);
                let lookup = match (&self.model.saved, reuse_lookup) {
                    (Some(saved), true) => saved.clone(),
                    _ => self.lookup(prompt),
                };
                let chunk = lookup.prompt[..*chunk as usize % (lookup.prompt.len() + 1)].to_vec();
                let (salt, queried, found, keys) =
                    (lookup.salt, lookup.prompt.len(), lookup.found, lookup.keys);
                let got = outcome(
                    self.manager.admit(seq, &chunk, found.clone()),
                    Outcome::Cached,
                );
                let real = is_success(&got).then(|| self.real_blocks(seq));
                let want = self.model.admit(
                    seq,
                    salt,
                    &chunk,
                    queried,
                    (&found.blocks, &keys),
                    real.as_deref(),
                );
                assert_eq!(got, want, "admit({seq}, {chunk:?}, {found:?})");
            }
            Op::Append { seq, tokens: raw } => {
                let seq = seq_id(*seq);
                let new: Vec<u32> = tokens(raw, MAX_APPEND).collect();
                let got = outcome(self.manager.append(seq, &new), Outcome::Copy);
                let real = is_success(&got).then(|| self.real_blocks(seq));
                let want = self.model.append(seq, &new, real.as_deref());
                assert_eq!(got, want, "append({seq}, {new:?})");
            }
            Op::Fork { parent, child } => {
                let (parent, child) = (seq_id(*parent), seq_id(*child));
                let got = outcome(self.manager.fork(parent, child), |()| Outcome::Done);
                assert_eq!(
                    got,
                    self.model.fork(parent, child),
                    "fork({parent}, {child})"
                );
            }
            Op::Free { seq } => {
                let seq = seq_id(*seq);
                let got = outcome(self.manager.free(seq), |()| Outcome::Done);
                assert_eq!(got, self.model.free(seq), "free({seq})");
            }
            Op::ReleaseBefore { seq, first_needed } => {
                let (seq, first) = (seq_id(*seq), usize::from(*first_needed));
                let got = outcome(self.manager.release_before(seq, first), Outcome::Released);
                assert_eq!(
                    got,
                    self.model.release_before(seq, first),
                    "release_before({seq}, {first})"
                );
            }
            Op::Lookup { prompt } => {
                let lookup = self.lookup(prompt);
                self.model.saved = Some(lookup);
            }
            Op::SlotMapping { seqs, counts } => {
                let seqs: Vec<SeqId> = seqs.iter().take(8).map(|&s| seq_id(s)).collect();
                // Each count at most one past its live sequence's tokens.
                let counts: Vec<usize> = counts
                    .iter()
                    .take(8)
                    .enumerate()
                    .map(|(i, &c)| {
                        let live = seqs.get(i).and_then(|s| self.model.seqs.get(s));
                        usize::from(c) % (live.map_or(254, |s| s.tokens.len()) + 2)
                    })
                    .collect();
                let got = outcome(self.manager.slot_mapping(&seqs, &counts), Outcome::Slots);
                assert_eq!(
                    got,
                    self.model.slot_mapping(&seqs, &counts),
                    "slot_mapping({seqs:?}, {counts:?})"
                );
            }
            Op::Tables { seqs, min_width } => {
                let seqs: Vec<SeqId> = seqs.iter().take(12).map(|&s| seq_id(s)).collect();
                self.check_tables(&seqs, usize::from(*min_width % 8));
            }
        }
    }

    /// `match_prefix` of a prompt built from `prompt`, checked against the model.
    fn lookup(&mut self, prompt: &Prompt) -> SavedLookup {
        let (prompt, salt) = self.model.build_prompt(prompt);
        let found = self.manager.match_prefix(&prompt, SALTS[salt]);
        let (blocks, keys) = self.model.hits(salt, &prompt);
        assert_eq!(
            found.blocks, blocks,
            "match_prefix({prompt:?}, salt {salt})"
        );
        assert_eq!(found.hashes.len(), blocks.len());
        assert_eq!(found.num_queried_tokens, prompt.len());
        SavedLookup {
            prompt,
            salt,
            found,
            keys,
        }
    }

    fn check_tables(&self, seqs: &[SeqId], min_width: usize) {
        let mut out = vec![-7; 3];
        let result = self.manager.batch_block_tables(seqs, min_width, &mut out);
        if seqs.iter().any(|s| !self.model.seqs.contains_key(s)) {
            assert!(matches!(result, Err(Error::UnknownSequence(_))));
            assert_eq!(
                out,
                vec![-7; 3],
                "a refused batch_block_tables changed its output"
            );
            return;
        }
        let width = result.expect("all sequences live");
        let longest = seqs
            .iter()
            .map(|s| self.model.seqs[s].blocks.len())
            .max()
            .unwrap_or(0);
        assert_eq!(width, longest.max(min_width));
        assert_eq!(out.len(), seqs.len() * width);
        for (i, s) in seqs.iter().enumerate() {
            let blocks = &self.model.seqs[s].blocks;
            let row = &out[i * width..(i + 1) * width];
            for (j, &cell) in row.iter().enumerate() {
                let want = blocks.get(j).map_or(-1, |&b| b as i32);
                assert_eq!(cell, want, "block table row {i} column {j}");
            }
        }
    }

    /// Everything observable equals the model.
    fn check_state(&self) {
        let (manager, model) = (&self.manager, &self.model);
        if let Err(broken) = manager.check_invariants() {
            panic!("check_invariants: {broken}");
        }
        let stats = manager.stats();
        let num_blocks = model.blocks.len();
        assert_eq!(stats.num_blocks, num_blocks);
        assert_eq!(
            stats.free_blocks + stats.cached_blocks + stats.used_blocks,
            num_blocks
        );
        assert_eq!(
            (stats.free_blocks, stats.cached_blocks, stats.used_blocks),
            (model.num_clean(), model.lru.len(), model.num_used()),
            "free / cached / used blocks"
        );
        assert_eq!(stats.usage, model.num_used() as f64 / num_blocks as f64);
        let counters = Counters {
            allocations: stats.allocations,
            evictions: stats.evictions,
            cow_copies: stats.cow_copies,
            queried: stats.prefix_queried_tokens,
            hits: stats.prefix_hit_tokens,
        };
        assert_eq!(counters, model.counters, "stats counters");
        assert_eq!(manager.num_available_blocks(), model.available());
        assert_eq!(manager.num_sequences(), model.seqs.len());
        let mut holders = vec![0u32; num_blocks];
        for s in 0..SeqId::from(SEQ_IDS) {
            let Some(state) = model.seqs.get(&s) else {
                assert!(!manager.contains(s), "sequence {s} should not exist");
                continue;
            };
            let table = manager.table(s).expect("live sequence");
            assert_eq!(table.blocks(), &state.blocks[..], "blocks of sequence {s}");
            assert_eq!(table.tokens(), &state.tokens[..], "tokens of sequence {s}");
            for &b in state.blocks.iter().filter(|&&b| b != RELEASED) {
                holders[b as usize] += 1;
            }
        }
        for (b, block) in model.blocks.iter().enumerate() {
            assert_eq!(block.refs, holders[b], "model ref count of block {b}");
        }
        // The prefix cache answers every registered prefix (one token past it) like the model.
        for (salt, prefix) in model.index.keys() {
            let mut prompt = prefix.clone();
            prompt.push(0);
            let found = manager.match_prefix(&prompt, SALTS[*salt]);
            assert_eq!(
                found.blocks,
                model.hits(*salt, &prompt).0,
                "cache lookup of {prefix:?}"
            );
        }
    }
}

impl Input {
    /// An input of one operation per chunk of `chunks`, each decoded alone (from random bytes, a
    /// long prompt decoded as one field takes most of what follows: about 2 operations from 600
    /// bytes): how the property test builds its inputs.
    pub fn from_chunks(
        num_blocks: u8,
        block_size: u8,
        prefix_caching: bool,
        chunks: &[Vec<u8>],
    ) -> Input {
        let ops = chunks
            .iter()
            .map(|chunk| Op::arbitrary_take_rest(arbitrary::Unstructured::new(chunk)))
            .collect::<arbitrary::Result<Vec<Op>>>()
            .expect("any bytes decode into an operation");
        Input {
            num_blocks,
            block_size,
            prefix_caching,
            ops,
        }
    }
}

/// Runs `input` on a `BlockManager` and the model, checking everything after every operation
/// (see the module doc); panics on the first disagreement.
pub fn run(input: &Input) {
    let num_blocks = 1 + usize::from(input.num_blocks % 24);
    let block_size = 1 + usize::from(input.block_size % 6);
    let mut harness = Harness {
        manager: BlockManager::new(num_blocks, block_size, input.prefix_caching)
            .expect("valid sizes"),
        model: Model::new(num_blocks, block_size, input.prefix_caching),
    };
    for op in &input.ops {
        harness.run(op);
        harness.check_state();
    }
    let live: Vec<SeqId> = harness.model.seqs.keys().copied().collect();
    for seq in live {
        harness.manager.free(seq).expect("live sequence");
        harness.model.free(seq);
    }
    harness.check_state();
    assert_eq!(harness.manager.stats().used_blocks, 0, "a block leaked");
}
