//! Differential property test: random allocate / append / fork / free / lookup sequences run on the
//! real `BlockManager` and on a plain reference model (vectors, full token prefixes as keys, no
//! hashing, O(n) LRU), comparing every result and occupancy figure after each operation, and
//! checking the manager's own invariants. 300 cases × 20–60 operations ≈ 12k operations a run.

use std::collections::{BTreeMap, HashMap};

use pagedkv::{BlockManager, Error};
use proptest::prelude::*;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

const NUM_BLOCKS: usize = 12;
const BLOCK_SIZE: usize = 4;
const SEQ_IDS: u64 = 6;

/// What an operation returned, reduced to what both implementations must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    None,
    Cached(usize),
    Copied(bool),
    OutOfBlocks,
    Unknown,
    Duplicate,
    Invalid,
}

#[derive(Debug, Clone)]
enum Op {
    Allocate {
        seq: u64,
        tokens: Vec<u32>,
        salted: bool,
    },
    Append {
        seq: u64,
        tokens: Vec<u32>,
    },
    Fork {
        parent: u64,
        child: u64,
    },
    Free {
        seq: u64,
    },
    Lookup {
        tokens: Vec<u32>,
    },
}

#[derive(Debug, Clone)]
struct RefBlock {
    refs: u32,
    /// Salt flag + every token up to the end of this block, when the block is full and registered.
    key: Option<(bool, Vec<u32>)>,
}

#[derive(Debug, Clone)]
struct RefSeq {
    blocks: Vec<usize>,
    tokens: Vec<u32>,
    salted: bool,
}

#[derive(Debug, Clone)]
struct Model {
    blocks: Vec<RefBlock>,
    lru: Vec<usize>,
    index: HashMap<(bool, Vec<u32>), usize>,
    seqs: BTreeMap<u64, RefSeq>,
    evictions: u64,
    cow_copies: u64,
    last: Outcome,
}

impl Model {
    fn new() -> Self {
        Model {
            blocks: vec![RefBlock { refs: 0, key: None }; NUM_BLOCKS],
            lru: Vec::new(),
            index: HashMap::new(),
            seqs: BTreeMap::new(),
            evictions: 0,
            cow_copies: 0,
            last: Outcome::None,
        }
    }

    fn clean(&self) -> usize {
        self.blocks
            .iter()
            .filter(|b| b.refs == 0 && b.key.is_none())
            .count()
    }

    fn available(&self) -> usize {
        self.clean() + self.lru.len()
    }

    fn take_block(&mut self) -> usize {
        let clean =
            (0..NUM_BLOCKS).find(|&b| self.blocks[b].refs == 0 && self.blocks[b].key.is_none());
        let block = clean.unwrap_or_else(|| {
            let victim = self.lru.remove(0);
            let key = self.blocks[victim].key.take().unwrap();
            self.index.remove(&key);
            self.evictions += 1;
            victim
        });
        self.blocks[block].refs = 1;
        block
    }

    fn retain(&mut self, block: usize) {
        if self.blocks[block].refs == 0 {
            self.lru.retain(|&b| b != block);
        }
        self.blocks[block].refs += 1;
    }

    fn release(&mut self, block: usize) {
        self.blocks[block].refs -= 1;
        if self.blocks[block].refs == 0 && self.blocks[block].key.is_some() {
            self.lru.push(block);
        }
    }

    fn cached_blocks(&self, tokens: &[u32], salted: bool) -> Vec<usize> {
        let cacheable = (tokens.len().saturating_sub(1)) / BLOCK_SIZE;
        (1..=cacheable)
            .map_while(|n| {
                self.index
                    .get(&(salted, tokens[..n * BLOCK_SIZE].to_vec()))
                    .copied()
            })
            .collect()
    }

    fn push_tokens(&mut self, seq: &mut RefSeq, tokens: &[u32]) {
        for &token in tokens {
            if seq.tokens.len().is_multiple_of(BLOCK_SIZE) {
                let block = self.take_block();
                seq.blocks.push(block);
            }
            seq.tokens.push(token);
            if seq.tokens.len().is_multiple_of(BLOCK_SIZE) {
                let key = (seq.salted, seq.tokens.clone());
                let block = *seq.blocks.last().unwrap();
                if !self.index.contains_key(&key) && self.blocks[block].key.is_none() {
                    self.index.insert(key.clone(), block);
                    self.blocks[block].key = Some(key);
                }
            }
        }
    }

    fn apply(&mut self, op: &Op) -> Outcome {
        match op {
            Op::Allocate {
                seq,
                tokens,
                salted,
            } => {
                if self.seqs.contains_key(seq) {
                    return Outcome::Duplicate;
                }
                let hits = self.cached_blocks(tokens, *salted);
                let revived = hits.iter().filter(|&&b| self.blocks[b].refs == 0).count();
                let needed = tokens.len().div_ceil(BLOCK_SIZE) - hits.len() + revived;
                if needed > self.available() {
                    return Outcome::OutOfBlocks;
                }
                for &b in &hits {
                    self.retain(b);
                }
                let cached = hits.len() * BLOCK_SIZE;
                let mut state = RefSeq {
                    blocks: hits,
                    tokens: tokens[..cached].to_vec(),
                    salted: *salted,
                };
                self.push_tokens(&mut state, &tokens[cached..]);
                self.seqs.insert(*seq, state);
                Outcome::Cached(cached)
            }
            Op::Append { seq, tokens } => {
                let Some(mut state) = self.seqs.get(seq).cloned() else {
                    return Outcome::Unknown;
                };
                let partial = state.tokens.len() % BLOCK_SIZE != 0;
                let shared = partial && self.blocks[*state.blocks.last().unwrap()].refs > 1;
                let needed = (state.tokens.len() + tokens.len()).div_ceil(BLOCK_SIZE)
                    - state.blocks.len()
                    + usize::from(shared);
                if needed > self.available() {
                    return Outcome::OutOfBlocks;
                }
                if shared {
                    let dst = self.take_block();
                    let src = std::mem::replace(state.blocks.last_mut().unwrap(), dst);
                    self.release(src);
                    self.cow_copies += 1;
                }
                self.push_tokens(&mut state, tokens);
                self.seqs.insert(*seq, state);
                Outcome::Copied(shared)
            }
            Op::Fork { parent, child } => {
                if self.seqs.contains_key(child) {
                    return Outcome::Duplicate;
                }
                let Some(state) = self.seqs.get(parent).cloned() else {
                    return Outcome::Unknown;
                };
                for &b in &state.blocks {
                    self.retain(b);
                }
                self.seqs.insert(*child, state);
                Outcome::None
            }
            Op::Free { seq } => {
                let Some(state) = self.seqs.remove(seq) else {
                    return Outcome::Unknown;
                };
                for &b in state.blocks.iter().rev() {
                    self.release(b);
                }
                Outcome::None
            }
            Op::Lookup { tokens } => {
                Outcome::Cached(self.cached_blocks(tokens, false).len() * BLOCK_SIZE)
            }
        }
    }
}

fn tokens() -> impl Strategy<Value = Vec<u32>> {
    // Prefixes of a few shared "documents" plus a random tail, so prefix hits are common.
    let documents: [Vec<u32>; 3] = [
        (0..24).collect(),
        (100..124).collect(),
        (0..8).chain(200..216).collect(),
    ];
    (0..3usize, 0..24usize, prop::collection::vec(0u32..3, 0..6)).prop_map(
        move |(doc, len, tail)| {
            let mut tokens = documents[doc][..len].to_vec();
            tokens.extend(tail);
            if tokens.is_empty() {
                tokens.push(7);
            }
            tokens
        },
    )
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::new()).boxed()
    }

    fn transitions(_: &Model) -> BoxedStrategy<Op> {
        let seq = 0..SEQ_IDS;
        prop_oneof![
            3 => (seq.clone(), tokens(), prop::bool::weighted(0.15))
                .prop_map(|(seq, tokens, salted)| Op::Allocate { seq, tokens, salted }),
            3 => (seq.clone(), prop::collection::vec(0u32..3, 1..7)).prop_map(|(seq, tokens)| Op::Append { seq, tokens }),
            1 => (seq.clone(), seq.clone()).prop_map(|(parent, child)| Op::Fork { parent, child }),
            2 => seq.prop_map(|seq| Op::Free { seq }),
            1 => tokens().prop_map(|tokens| Op::Lookup { tokens }),
        ]
        .boxed()
    }

    fn apply(mut state: Model, op: &Op) -> Model {
        state.last = state.apply(op);
        state
    }
}

struct RealManager;

fn outcome_of_error(error: Error) -> Outcome {
    match error {
        Error::OutOfBlocks { .. } => Outcome::OutOfBlocks,
        Error::UnknownSequence(_) => Outcome::Unknown,
        Error::DuplicateSequence(_) => Outcome::Duplicate,
        Error::Shape(_) | Error::InvalidArgument(_) => Outcome::Invalid,
        Error::OutOfMemory(what) | Error::Io(what) | Error::Internal(what) => {
            panic!("a model-sized manager without a disk tier cannot fail so: {what}")
        }
    }
}

impl StateMachineTest for RealManager {
    type SystemUnderTest = BlockManager;
    type Reference = Reference;

    fn init_test(_: &Model) -> BlockManager {
        BlockManager::new(NUM_BLOCKS, BLOCK_SIZE, true).unwrap()
    }

    fn apply(mut manager: BlockManager, model: &Model, op: Op) -> BlockManager {
        let salt = |salted: bool| salted.then_some(&b"salt"[..]);
        let outcome = match &op {
            Op::Allocate {
                seq,
                tokens,
                salted,
            } => manager
                .allocate(*seq, tokens, salt(*salted))
                .map(Outcome::Cached),
            Op::Append { seq, tokens } => manager
                .append(*seq, tokens)
                .map(|copy| Outcome::Copied(copy.is_some())),
            Op::Fork { parent, child } => manager.fork(*parent, *child).map(|_| Outcome::None),
            Op::Free { seq } => manager.free(*seq).map(|_| Outcome::None),
            Op::Lookup { tokens } => Ok(Outcome::Cached(
                manager
                    .match_prefix(tokens, None)
                    .num_cached_tokens(BLOCK_SIZE),
            )),
        }
        .unwrap_or_else(outcome_of_error);
        assert_eq!(outcome, model.last, "after {op:?}");
        manager
    }

    fn check_invariants(manager: &BlockManager, model: &Model) {
        manager.check_invariants().unwrap();
        let stats = manager.stats();
        let in_use = model.blocks.iter().filter(|b| b.refs > 0).count();
        assert_eq!(
            (stats.free_blocks, stats.cached_blocks, stats.used_blocks),
            (model.clean(), model.lru.len(), in_use)
        );
        assert_eq!(
            (stats.evictions, stats.cow_copies),
            (model.evictions, model.cow_copies)
        );
        assert_eq!(manager.num_sequences(), model.seqs.len());
        for (&seq, state) in &model.seqs {
            let table = manager.table(seq).unwrap();
            assert_eq!(table.tokens(), &state.tokens[..]);
            // Same sharing structure: two sequences share a logical block in one iff in the other.
            for (&other, other_state) in &model.seqs {
                let other_table = manager.table(other).unwrap();
                for (i, &b) in state.blocks.iter().enumerate() {
                    for (j, &c) in other_state.blocks.iter().enumerate() {
                        assert_eq!(b == c, table.blocks()[i] == other_table.blocks()[j]);
                    }
                }
            }
        }
    }

    fn teardown(mut manager: BlockManager, model: Model) {
        for seq in model.seqs.keys() {
            manager.free(*seq).unwrap();
        }
        assert_eq!(manager.stats().used_blocks, 0, "a block leaked");
        manager.check_invariants().unwrap();
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn block_manager_matches_reference_model(sequential 20..60 => RealManager);
}
