//! A router's index of which replicas hold which cached blocks, in which medium, and the longest
//! cached prefix of a prompt on each replica.
//!
//! Replicas are small integer ids chosen by the caller. The index is fed only by the replicas'
//! KV events (`apply_stored`, `apply_removed`, `clear`) and by `remove_replica`.
//!
//! Invariants:
//! - `holders[h]` lists, sorted by replica id and without repeats, every replica holding block
//!   hash `h` in at least one medium, with the media it holds it in (never none); a hash no
//!   replica holds has no entry.
//! - `held[r][m]` is exactly the set of hashes replica `r` holds in medium `m`: the two views
//!   always agree, so a replica's blocks are listed (and cleared) without scanning the whole map.
//! - `longest_prefixes` hashes the prompt with the block manager's own chain
//!   ([`crate::memory::prefix_cache`]), over the blocks a hit can reuse: never the block holding the last
//!   prompt token (the model needs its logits), so `(len - 1) / block_size` blocks. It hashes them
//!   all (~25 ns a block), then walks them in order, once, looking blocks up `LOOKAHEAD` at a
//!   time: a replica's run starts at block 0 and stops at its first block held in neither medium,
//!   its RAM run at its first block not in RAM; the walk stops once no replica's run is still
//!   going.

use rustc_hash::{FxHashMap, FxHashSet};
use smallvec::SmallVec;

use crate::error::{ensure, Result};
use crate::ids::TokenId;
use crate::memory::events::Medium;
use crate::memory::prefix_cache::{block_hashes, root_hash, BlockHash};

/// A replica of the cluster, as the caller numbers them.
pub type ReplicaId = u32;

/// The media bit of `medium` in [`Holder::media`].
fn bit(medium: Medium) -> u8 {
    match medium {
        Medium::Ram => 1,
        Medium::Disk => 2,
    }
}

fn slot(medium: Medium) -> usize {
    match medium {
        Medium::Ram => 0,
        Medium::Disk => 1,
    }
}

/// One replica holding a block: in RAM (bit 1), on disk (bit 2) or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    replica: ReplicaId,
    media: u8,
}

/// The holders of one hash. A shared block is typically held by a handful of replicas (a
/// tenant's system prompt on the replicas it is routed to); two fit inline, so the common lookup
/// is one probe of the map with no second pointer to chase (smallvec, already a dependency of our
/// dependencies, rather than a hand-made inline vector).
type Holders = SmallVec<[Holder; 2]>;

/// Blocks looked up together along a prompt. Measured at R = 256 over a 504k-block index (loaded
/// machine), a walk hashing and looking up one block at a time cost ~0.4 µs a block, nearly all
/// of it one cache miss after another; independent lookups let the misses overlap.
const LOOKAHEAD: usize = 16;

/// How much of a prompt one replica holds, in blocks: its leading `ram_blocks` all in RAM, then
/// `disk_blocks` more each held in some medium (the first of them not in RAM).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixRun {
    pub replica: ReplicaId,
    pub ram_blocks: usize,
    pub disk_blocks: usize,
}

/// Block hash → replicas holding it, in which media; see the module doc.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    /// Keys are uniform 128-bit hashes: a cheap multiplicative hash is enough.
    holders: FxHashMap<BlockHash, Holders>,
    /// Replica → the hashes it holds, per medium (RAM, disk).
    held: FxHashMap<ReplicaId, [FxHashSet<BlockHash>; 2]>,
}

impl PrefixIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// Replica `replica` now holds `hash` in `medium`. Returns whether that is new.
    pub fn apply_stored(&mut self, replica: ReplicaId, hash: BlockHash, medium: Medium) -> bool {
        if !self.held.entry(replica).or_default()[slot(medium)].insert(hash) {
            return false;
        }
        let holders = self.holders.entry(hash).or_default();
        match holders.binary_search_by_key(&replica, |h| h.replica) {
            Ok(i) => holders[i].media |= bit(medium),
            Err(i) => holders.insert(
                i,
                Holder {
                    replica,
                    media: bit(medium),
                },
            ),
        }
        true
    }

    /// Replica `replica` no longer holds `hash` in `medium`. Returns whether it did.
    pub fn apply_removed(&mut self, replica: ReplicaId, hash: BlockHash, medium: Medium) -> bool {
        let removed = self
            .held
            .get_mut(&replica)
            .is_some_and(|sets| sets[slot(medium)].remove(&hash));
        if removed {
            self.unset(replica, hash, medium);
        }
        removed
    }

    /// Replica `replica` holds nothing in `medium` any more.
    pub fn clear(&mut self, replica: ReplicaId, medium: Medium) {
        let Some(sets) = self.held.get_mut(&replica) else {
            return;
        };
        for hash in std::mem::take(&mut sets[slot(medium)]) {
            self.unset(replica, hash, medium);
        }
    }

    /// Forgets replica `replica` and everything it holds.
    pub fn remove_replica(&mut self, replica: ReplicaId) {
        self.clear(replica, Medium::Ram);
        self.clear(replica, Medium::Disk);
        self.held.remove(&replica);
    }

    /// Every `(hash, medium)` replica `replica` holds, in no order.
    pub fn blocks_of(&self, replica: ReplicaId) -> Vec<(BlockHash, Medium)> {
        let Some([ram, disk]) = self.held.get(&replica) else {
            return Vec::new();
        };
        let ram = ram.iter().map(|&h| (h, Medium::Ram));
        ram.chain(disk.iter().map(|&h| (h, Medium::Disk))).collect()
    }

    /// How many `(hash, medium)` pairs replica `replica` holds.
    pub fn num_blocks_of(&self, replica: ReplicaId) -> usize {
        self.held
            .get(&replica)
            .map_or(0, |[ram, disk]| ram.len() + disk.len())
    }

    /// The run of the prompt `tokens` (hashed under cache salt `salt`) each replica holds, for
    /// every replica holding its first reusable block, sorted by replica id (see the module
    /// doc). Fails with `InvalidArgument` unless `block_size` is positive.
    pub fn longest_prefixes(
        &self,
        tokens: &[TokenId],
        block_size: usize,
        salt: Option<&[u8]>,
    ) -> Result<Vec<PrefixRun>> {
        ensure(block_size > 0, || "block_size must be positive".into())?;
        let reusable = tokens.len().saturating_sub(1) / block_size;
        let hashes = block_hashes(
            root_hash(salt),
            &tokens[..reusable * block_size],
            block_size,
        );
        let Some(holders) = hashes.first().and_then(|h| self.holders.get(h)) else {
            return Ok(Vec::new());
        };
        let mut runs: Vec<Run> = holders.iter().map(|h| Run::new(h.media)).collect();
        let replicas: SmallVec<[ReplicaId; 8]> = holders.iter().map(|h| h.replica).collect();
        let mut going = runs.len();
        let mut found: SmallVec<[Option<&Holders>; LOOKAHEAD]> = SmallVec::new();
        'walk: for chunk in hashes[1..].chunks(LOOKAHEAD) {
            // The lookups of a chunk are independent loads, so their cache misses overlap.
            found.clear();
            found.extend(chunk.iter().map(|h| self.holders.get(h)));
            for holders in &found {
                let Some(holders) = holders else {
                    break 'walk;
                };
                // Both lists are sorted by replica: one merge.
                let mut next = holders.iter().peekable();
                for (run, &replica) in runs.iter_mut().zip(&replicas) {
                    if !run.going {
                        continue;
                    }
                    while next.next_if(|h| h.replica < replica).is_some() {}
                    match next.next_if(|h| h.replica == replica) {
                        Some(h) => run.extend(h.media),
                        None => {
                            run.going = false;
                            going -= 1;
                        }
                    }
                }
                if going == 0 {
                    break 'walk;
                }
            }
        }
        Ok(runs
            .iter()
            .zip(replicas)
            .map(|(run, replica)| PrefixRun {
                replica,
                ram_blocks: run.ram,
                disk_blocks: run.held - run.ram,
            })
            .collect())
    }

    /// Takes `medium` off `replica`'s entry for `hash` (which `held` no longer lists).
    fn unset(&mut self, replica: ReplicaId, hash: BlockHash, medium: Medium) {
        let std::collections::hash_map::Entry::Occupied(mut entry) = self.holders.entry(hash)
        else {
            unreachable!("held and holders disagree on {hash:#x}");
        };
        let holders = entry.get_mut();
        let i = holders
            .binary_search_by_key(&replica, |h| h.replica)
            .expect("held and holders agree");
        holders[i].media &= !bit(medium);
        if holders[i].media == 0 {
            holders.remove(i);
            if holders.is_empty() {
                entry.remove();
            }
        }
    }
}

/// One replica's run along the prompt walked so far.
struct Run {
    held: usize,
    ram: usize,
    /// Every block so far was in RAM.
    all_ram: bool,
    /// Every block so far was held.
    going: bool,
}

impl Run {
    fn new(media: u8) -> Self {
        let in_ram = media & bit(Medium::Ram) != 0;
        Run {
            held: 1,
            ram: usize::from(in_ram),
            all_ram: in_ram,
            going: true,
        }
    }

    fn extend(&mut self, media: u8) {
        self.held += 1;
        self.all_ram &= media & bit(Medium::Ram) != 0;
        self.ram += usize::from(self.all_ram);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    const BS: usize = 2;

    /// Prompts of a small universe: every variant shares its first three blocks (six tokens),
    /// then differs, so chains branch; random events on them leave holes in chains too.
    fn prompt(variant: u32, len: usize) -> Vec<TokenId> {
        (0..len as u32)
            .map(|t| if t < 6 { t } else { t + 1000 * variant })
            .collect()
    }

    /// The reference: a plain set of (replica, hash, medium), and the runs found block by block.
    #[derive(Default)]
    struct Model(BTreeSet<(ReplicaId, BlockHash, u8)>);

    impl Model {
        fn runs(&self, tokens: &[TokenId]) -> Vec<PrefixRun> {
            let reusable = tokens.len().saturating_sub(1) / BS;
            let hashes = block_hashes(root_hash(None), &tokens[..reusable * BS], BS);
            let replicas: BTreeSet<ReplicaId> = self.0.iter().map(|&(r, _, _)| r).collect();
            let holds = |r, h, m| self.0.contains(&(r, h, m));
            let mut out = Vec::new();
            for r in replicas {
                let held = hashes
                    .iter()
                    .take_while(|&&h| holds(r, h, 1) || holds(r, h, 2))
                    .count();
                let ram = hashes.iter().take_while(|&&h| holds(r, h, 1)).count();
                if held > 0 {
                    out.push(PrefixRun {
                        replica: r,
                        ram_blocks: ram,
                        disk_blocks: held - ram,
                    });
                }
            }
            out
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Stored(ReplicaId, u32, usize, bool),
        Removed(ReplicaId, u32, usize, bool),
        Cleared(ReplicaId, bool),
        RemoveReplica(ReplicaId),
    }

    fn op() -> impl Strategy<Value = Op> {
        let event = (0..5u32, 0..3u32, 0..8usize, any::<bool>());
        prop_oneof![
            12 => event.clone().prop_map(|(r, p, b, d)| Op::Stored(r, p, b, d)),
            6 => event.prop_map(|(r, p, b, d)| Op::Removed(r, p, b, d)),
            1 => (0..5u32, any::<bool>()).prop_map(|(r, d)| Op::Cleared(r, d)),
            1 => (0..5u32).prop_map(Op::RemoveReplica),
        ]
    }

    fn medium(disk: bool) -> Medium {
        if disk {
            Medium::Disk
        } else {
            Medium::Ram
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn the_index_matches_a_plain_set(ops in proptest::collection::vec(op(), 0..120)) {
            let mut index = PrefixIndex::new();
            let mut model = Model::default();
            let hash_of = |p: u32, b: usize| block_hashes(root_hash(None), &prompt(p, 16), BS)[b];
            for op in ops {
                match op {
                    Op::Stored(r, p, b, d) => {
                        let key = (r, hash_of(p, b), bit(medium(d)));
                        prop_assert_eq!(index.apply_stored(r, key.1, medium(d)), model.0.insert(key));
                    }
                    Op::Removed(r, p, b, d) => {
                        let key = (r, hash_of(p, b), bit(medium(d)));
                        prop_assert_eq!(index.apply_removed(r, key.1, medium(d)), model.0.remove(&key));
                    }
                    Op::Cleared(r, d) => {
                        index.clear(r, medium(d));
                        model.0.retain(|&(rr, _, m)| rr != r || m != bit(medium(d)));
                    }
                    Op::RemoveReplica(r) => {
                        index.remove_replica(r);
                        model.0.retain(|&(rr, _, _)| rr != r);
                    }
                }
                for p in 0..3 {
                    for len in [0, 1, 2, 3, 9, 16, 17] {
                        let tokens = prompt(p, len);
                        prop_assert_eq!(index.longest_prefixes(&tokens, BS, None)?, model.runs(&tokens));
                    }
                }
            }
            for r in 0..5 {
                let listed: BTreeSet<_> = index.blocks_of(r).into_iter().map(|(h, m)| (r, h, bit(m))).collect();
                let expected: BTreeSet<_> = model.0.iter().copied().filter(|&(rr, _, _)| rr == r).collect();
                prop_assert_eq!(index.num_blocks_of(r), expected.len());
                prop_assert_eq!(listed, expected);
            }
            // No entry outlives its last holder.
            let hashes: BTreeSet<BlockHash> = model.0.iter().map(|&(_, h, _)| h).collect();
            prop_assert_eq!(index.holders.len(), hashes.len());
        }
    }

    #[test]
    fn runs_stop_at_the_first_missing_block_and_the_salt_and_last_token_count() {
        let tokens: Vec<TokenId> = (0..9).collect(); // four reusable blocks of 2, then one token
        let hashes = block_hashes(root_hash(None), &tokens, BS);
        let mut index = PrefixIndex::new();
        for &h in &hashes {
            index.apply_stored(3, h, Medium::Ram);
        }
        index.apply_stored(1, hashes[0], Medium::Ram);
        index.apply_stored(1, hashes[1], Medium::Disk);
        index.apply_stored(1, hashes[3], Medium::Ram); // after a hole: not part of the run
        let runs = index.longest_prefixes(&tokens, BS, None).unwrap();
        let run = |replica, ram_blocks, disk_blocks| PrefixRun {
            replica,
            ram_blocks,
            disk_blocks,
        };
        assert_eq!(runs, vec![run(1, 1, 1), run(3, 4, 0)]);
        // Eight tokens: the fourth block holds the last token, so three can be reused.
        let runs = index.longest_prefixes(&tokens[..8], BS, None).unwrap();
        assert_eq!(runs, vec![run(1, 1, 1), run(3, 3, 0)]);
        assert!(index
            .longest_prefixes(&tokens, BS, Some(b"tenant"))
            .unwrap()
            .is_empty());
        assert!(index.longest_prefixes(&tokens, 0, None).is_err());
    }
}
