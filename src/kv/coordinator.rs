//! [`KvCoordinator`]: the block tables of each sequence in every KV cache group, over one
//! [`BlockManager`] (one pool, one prefix cache, one free list): what a hybrid model (Gemma 3's
//! full and sliding-window layers) needs so that its sliding layers keep only their window while
//! the memory they free serves any group.
//!
//! Every page has one size in bytes (`crate::kv::spec`: a group's blocks may hold fewer tokens of
//! more layers), so a page moves between groups by going back to the pool: no group has a fixed
//! share. A table counts tokens in its group's blocks; a prefix, an admission and a window are
//! in tokens, common to all groups.
//! A sequence of the scheduler (`seq`) owns one table per group, table `seq * G + g` of the
//! block manager (`member`); with one group that is `seq` itself, so a one-group coordinator
//! behaves exactly as the block manager it wraps.
//!
//! Invariants (`check_invariants`, besides the block manager's):
//! - a sequence has a table in every group or in none, all holding the same tokens — but while
//!   it loads from a tier: a group whose loads ended with a drop is cut back at once, the others
//!   when their loads end (`poll_tier`);
//! - group `g`'s tables chain their block hashes from the request's root mixed with `g`
//!   (`group_root`; group 0's is the root itself): a block is found only by its own group's
//!   prefix lookups, and one prefix map serves all groups;
//! - a sliding group's tables hold no block wholly before the window of the next token to
//!   compute (`release_behind`, called before every step's appends), so a sequence holds at most
//!   [`sliding_peak_blocks`] blocks there however long it grows; a prefix hit needs in a sliding
//!   group only the blocks of that window (`match_prefix`), the others are admitted released;
//! - an operation over several groups checks capacity for all of them first: it changes every
//!   group's tables or none;
//! - with a disk tier, a prefix hit may load blocks in several groups; the sequence is loading
//!   until every group's loads ended, and then holds in every group the prefix all of them
//!   loaded (`poll_tier`).

use crate::error::{ensure, Error, Result};
use crate::ids::{CopyOp, SeqId, TokenId};
use crate::kv::spec::{AttentionKind, GroupKeeping};
use crate::memory::block_manager::{BlockManager, LoadsEnded, PrefixMatch};
use crate::memory::block_table::{BlockTable, RELEASED};
use crate::memory::prefix_cache::{chain_hash, extend_block_hashes, BlockHash};
use crate::tier::KvTier;

/// Most blocks a sequence holds in a group keeping `window` tokens while it computes chunks of
/// up to `chunk` tokens: the blocks over the first chunk token's window and the chunk, plus one
/// for a window not aligned to blocks.
pub fn sliding_peak_blocks(window: usize, chunk: usize, block_size: usize) -> usize {
    (window - 1).saturating_add(chunk).div_ceil(block_size) + 1
}

/// Blocks a sequence of `num_tokens` tokens holds at most in a group keeping `kept`, computing
/// chunks of up to `chunk` tokens.
pub fn group_blocks(kept: GroupKeeping, num_tokens: usize, chunk: usize) -> usize {
    let bs = kept.block_size;
    let all = num_tokens.div_ceil(bs);
    match kept.attention {
        AttentionKind::Full => all,
        AttentionKind::Sliding { window } => all.min(sliding_peak_blocks(window, chunk, bs)),
    }
}

/// The longest sequence whose blocks in all of `groups` fit `num_blocks` blocks (pages),
/// computing chunks of up to `chunk` tokens (with one full group: `num_blocks * block_size`).
pub fn capacity_tokens(groups: &[GroupKeeping], num_blocks: usize, chunk: usize) -> usize {
    let fits = |len: usize| {
        groups
            .iter()
            .map(|&g| group_blocks(g, len, chunk))
            .fold(0, usize::saturating_add)
            <= num_blocks
    };
    // Blocks needed grow with the length: bisect over 0..=num_blocks * the largest block.
    let largest = groups.iter().map(|g| g.block_size).max().unwrap_or(0);
    let (mut low, mut high) = (0usize, num_blocks.saturating_mul(largest));
    while low < high {
        let mid = low + (high - low).div_ceil(2);
        if fits(mid) {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    low
}

/// Least common multiple (of block sizes, all positive).
fn lcm(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

/// The chain root of group `group`'s tables for a request whose root is `root` (module
/// invariants): the root itself for group 0, else the hash of a pseudo-block naming the group.
pub fn group_root(root: BlockHash, group: usize) -> BlockHash {
    match group {
        0 => root,
        g => chain_hash(root, &[TokenId::MAX, g as TokenId]),
    }
}

/// The tables of every sequence in every group over one block manager (module doc).
pub struct KvCoordinator {
    manager: BlockManager,
    /// What each group keeps of a sequence, in blocks of how many tokens.
    groups: Vec<GroupKeeping>,
}

impl KvCoordinator {
    /// Groups keeping `groups[g]` over `manager`, which must hold no sequence yet.
    /// `InvalidArgument` without groups, with a zero window, or with a group's blocks larger
    /// than the manager's (its pages) or not dividing them.
    pub fn new(manager: BlockManager, groups: Vec<GroupKeeping>) -> Result<Self> {
        ensure(!groups.is_empty(), || "a KV cache needs a group".into())?;
        ensure(
            groups
                .iter()
                .all(|g| g.attention != AttentionKind::Sliding { window: 0 }),
            || "a sliding window must hold at least one token".into(),
        )?;
        let page = manager.block_size();
        ensure(
            groups
                .iter()
                .all(|g| g.block_size > 0 && page.is_multiple_of(g.block_size)),
            || format!("a group's blocks must divide the pages' {page} tokens"),
        )?;
        ensure(manager.num_sequences() == 0, || {
            "a coordinator starts over an empty block manager".into()
        })?;
        Ok(KvCoordinator { manager, groups })
    }

    /// The block manager (read-only; `manager_mut` for the calls that pass through unchanged:
    /// every change to tables goes through the coordinator).
    pub fn manager(&self) -> &BlockManager {
        &self.manager
    }

    /// What each group keeps of a sequence.
    pub fn groups(&self) -> &[GroupKeeping] {
        &self.groups
    }

    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// The block manager's id of `seq`'s table in group `group`.
    pub fn member(&self, seq: SeqId, group: usize) -> SeqId {
        seq * self.groups.len() as SeqId + group as SeqId
    }

    /// Sequences with tables.
    pub fn num_sequences(&self) -> usize {
        self.manager.num_sequences() / self.groups.len()
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.manager.contains(self.member(seq, 0))
    }

    /// Whether a load of any of `seq`'s tables is in flight.
    pub fn is_loading(&self, seq: SeqId) -> bool {
        (0..self.groups.len()).any(|g| self.manager.is_loading(self.member(seq, g)))
    }

    /// `seq`'s table in group `group`.
    pub fn table(&self, seq: SeqId, group: usize) -> Result<&BlockTable> {
        self.manager.table(self.member(seq, group))
    }

    /// Blocks each group's tables hold now (a block shared by tables of one group counted once;
    /// no block is in two groups: their hashes differ and forks stay in their group).
    pub fn blocks_in_use(&self) -> Vec<usize> {
        let g = self.groups.len() as SeqId;
        let mut seen = vec![false; self.manager.num_blocks()];
        let mut in_use = vec![0; self.groups.len()];
        for seq in self.manager.sequences() {
            let table = self.manager.table(seq).expect("listed");
            for &block in table.held() {
                if !std::mem::replace(&mut seen[block as usize], true) {
                    in_use[(seq % g) as usize] += 1;
                }
            }
        }
        in_use
    }

    /// Extends each group's block hashes of a prompt (`hashes[g]`, chained from
    /// `group_root(root, g)`) over its full blocks in `tokens`.
    pub fn extend_hashes(
        &self,
        root: BlockHash,
        hashes: &mut Vec<Vec<BlockHash>>,
        tokens: &[TokenId],
    ) {
        hashes.resize_with(self.groups.len(), Vec::new);
        for (g, group_hashes) in hashes.iter_mut().enumerate() {
            let bs = self.groups[g].block_size;
            extend_block_hashes(group_root(root, g), group_hashes, tokens, bs);
        }
    }

    /// The longest prefix of a prompt of `num_tokens` tokens every group can serve from the cache,
    /// one match per group (`hashes` as from `extend_hashes`). Changes nothing.
    ///
    /// A full group serves a prefix when it holds all its blocks; a sliding group when it holds
    /// the blocks its next query reads (the window before the prefix's end): its match opens with
    /// [`RELEASED`] entries for the others, which may have been evicted. With one group, this is
    /// the block manager's match (tier hits included).
    pub fn match_prefix(
        &self,
        root: BlockHash,
        hashes: &[Vec<BlockHash>],
        num_tokens: usize,
    ) -> Vec<PrefixMatch> {
        let hashes_of = |g: usize| hashes.get(g).map_or(&[][..], Vec::as_slice);
        if self.is_plain() {
            return vec![self
                .manager
                .match_prefix_hashes(root, hashes_of(0), num_tokens)];
        }
        // A prefix ends on a block boundary of every group: in steps of `unit` tokens.
        let unit = self.unit();
        let cacheable = if self.manager.prefix_caching_enabled() && num_tokens > 0 {
            (num_tokens - 1) / unit * unit
        } else {
            0
        };
        // The longest prefix every group serves from RAM, then (with a tier) from RAM and the
        // tier together: the latter is taken when it is longer by enough loads to be worth them.
        let from_ram = self.longest_served(hashes, cacheable, unit, false);
        let mut tokens = from_ram;
        let mut loads = false;
        if self.manager.has_tier() {
            let with_tier = self.longest_served(hashes, cacheable, unit, true);
            let tier_blocks = (0..self.groups.len())
                .map(|g| {
                    self.serve(g, hashes_of(g), with_tier, true)
                        .map_or(0, |s| s.1)
                })
                .sum::<usize>();
            if with_tier > from_ram && tier_blocks >= self.manager.tier_policy().min_load_blocks {
                (tokens, loads) = (with_tier, true);
            }
        }
        (0..self.groups.len())
            .map(|g| {
                let bs = self.groups[g].block_size;
                let first = self.first_needed_block(g, tokens);
                let group_hashes = &hashes_of(g)[..tokens / bs];
                let (ram, _) = self.serve(g, group_hashes, tokens, loads).expect("checked");
                PrefixMatch {
                    root: group_root(root, g),
                    hashes: group_hashes[..first + ram].to_vec(),
                    blocks: (0..first + ram)
                        .map(|i| match i < first {
                            true => RELEASED,
                            false => self.manager.cached_block(group_hashes[i]).expect("checked"),
                        })
                        .collect(),
                    tier_hashes: group_hashes[first + ram..].to_vec(),
                    num_queried_tokens: num_tokens,
                    block_size: bs,
                    group: g as u32,
                }
            })
            .collect()
    }

    /// The longest prefix, in steps of `unit` tokens up to `limit`, whose blocks every group
    /// serves (`serve`) from RAM, or with `tier` from RAM and the tier.
    fn longest_served(
        &self,
        hashes: &[Vec<BlockHash>],
        limit: usize,
        unit: usize,
        tier: bool,
    ) -> usize {
        let hashes_of = |g: usize| hashes.get(g).map_or(&[][..], Vec::as_slice);
        let mut longest = limit;
        for (g, kept) in self.groups.iter().enumerate() {
            let bs = kept.block_size;
            longest = longest.min(hashes_of(g).len() * bs);
            // A full group's run of served blocks from the start bounds the prefix.
            if kept.attention == AttentionKind::Full {
                let group_hashes = &hashes_of(g)[..(longest / bs).min(hashes_of(g).len())];
                let in_ram = group_hashes
                    .iter()
                    .take_while(|&&h| self.manager.cached_block(h).is_some())
                    .count();
                let on_tier = match tier {
                    true => group_hashes[in_ram..]
                        .iter()
                        .take_while(|&&h| self.manager.tier_holds(h))
                        .count(),
                    false => 0,
                };
                longest = longest.min((in_ram + on_tier) * bs);
            }
        }
        let mut tokens = longest / unit * unit;
        while tokens > 0
            && (0..self.groups.len()).any(|g| self.serve(g, hashes_of(g), tokens, tier).is_none())
        {
            tokens -= unit;
        }
        tokens
    }

    /// How group `group` serves a prefix of `tokens` tokens of a prompt whose block hashes (at
    /// least `tokens` worth) are `hashes`: the blocks its next query reads (all of them for full
    /// attention, the window's for a sliding group), a run in RAM then, with `tier`, a run on the
    /// tier. `(blocks in RAM, blocks on the tier)`, or None if some block is in neither.
    fn serve(
        &self,
        group: usize,
        hashes: &[BlockHash],
        tokens: usize,
        tier: bool,
    ) -> Option<(usize, usize)> {
        let needed =
            &hashes[self.first_needed_block(group, tokens)..tokens / self.groups[group].block_size];
        let in_ram = needed
            .iter()
            .take_while(|&&h| self.manager.cached_block(h).is_some())
            .count();
        let rest = &needed[in_ram..];
        match rest.is_empty() || (tier && rest.iter().all(|&h| self.manager.tier_holds(h))) {
            true => Some((in_ram, rest.len())),
            false => None,
        }
    }

    /// The tokens a prefix is a multiple of: a block of every group (their sizes' LCM).
    fn unit(&self) -> usize {
        self.groups.iter().fold(1, |l, g| lcm(l, g.block_size))
    }

    /// One full group in blocks of the pages' size: the block manager's own case (its prefix
    /// match, tier hits included, and its appends).
    fn is_plain(&self) -> bool {
        matches!(self.groups[..], [g] if g == GroupKeeping::full(self.manager.block_size()))
    }

    /// The first block group `group`'s next query reads after a prefix of `tokens` tokens (0
    /// for a full group).
    fn first_needed_block(&self, group: usize, tokens: usize) -> usize {
        let bs = self.groups[group].block_size;
        match self.groups[group].attention {
            AttentionKind::Full => 0,
            AttentionKind::Sliding { window } => {
                ((tokens + 1).saturating_sub(window) / bs).min(tokens / bs)
            }
        }
    }

    /// Available blocks that admitting `num_tokens` tokens over `found` would use up, in all
    /// groups together.
    pub fn blocks_to_admit(&self, found: &[PrefixMatch], num_tokens: usize) -> usize {
        found
            .iter()
            .map(|f| self.manager.blocks_to_admit(f, num_tokens))
            .sum()
    }

    /// Creates `seq`'s tables holding `tokens` over `found` (from `match_prefix`), in every group
    /// or none (`BlockManager::admit_tables`). Returns the tokens served from the cache.
    pub fn admit(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        found: Vec<PrefixMatch>,
    ) -> Result<usize> {
        let members: Vec<SeqId> = (0..self.groups.len())
            .map(|g| self.member(seq, g))
            .collect();
        self.manager.admit_tables(&members, tokens, found)
    }

    /// Releases, in every sliding group, `seq`'s blocks wholly before the window of a query at
    /// position `next` (the first token it computes next). Returns how many were released.
    pub fn release_behind(&mut self, seq: SeqId, next: usize) -> Result<usize> {
        if self.groups.len() == 1 && self.groups[0].attention == AttentionKind::Full {
            return Ok(0); // nothing to release, and called for every running sequence each step
        }
        let mut released = 0;
        for g in 0..self.groups.len() {
            if let AttentionKind::Sliding { window } = self.groups[g].attention {
                let member = self.member(seq, g);
                released += self
                    .manager
                    .release_before(member, (next + 1).saturating_sub(window))?;
            }
        }
        Ok(released)
    }

    /// Gives `tokens` slots at the end of `seq` in every group (or, `OutOfBlocks`, in none),
    /// pushing each copy-on-write copy to `copies`.
    pub fn append(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        copies: &mut Vec<CopyOp>,
    ) -> Result<()> {
        if let [_] = self.groups[..] {
            // One table: the block manager's append is all or none by itself (and a step's
            // appends are the scheduler's hot path: `bench scheduler` measured the second
            // lookup of a two-phase check at +5% per step).
            copies.extend(self.manager.append(self.member(seq, 0), tokens)?);
            return Ok(());
        }
        let mut needed = 0;
        for g in 0..self.groups.len() {
            needed += self
                .manager
                .blocks_needed_to_append(self.member(seq, g), tokens.len())?;
        }
        let available = self.manager.num_available_blocks();
        if needed > available {
            return Err(Error::OutOfBlocks { needed, available });
        }
        for g in 0..self.groups.len() {
            let copy = self
                .manager
                .append(self.member(seq, g), tokens)
                .expect("capacity checked for every group");
            copies.extend(copy);
        }
        Ok(())
    }

    /// Makes `child` share every table of `parent`.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        ensure(!self.contains(child), || {
            format!("sequence {child} has tables already")
        })?;
        for g in 0..self.groups.len() {
            self.manager
                .fork(self.member(parent, g), self.member(child, g))?;
        }
        Ok(())
    }

    /// Drops `seq`'s tables in every group.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        if !self.contains(seq) {
            return Err(Error::UnknownSequence(seq.to_string()));
        }
        for g in 0..self.groups.len() {
            self.manager.free(self.member(seq, g))?;
        }
        Ok(())
    }

    /// Attaches a disk tier (`BlockManager::attach_tier`): it keeps the pages of every group,
    /// each record naming its group.
    pub fn attach_tier(&mut self, tier: Box<dyn KvTier>) -> Result<()> {
        self.manager.attach_tier(tier)
    }

    /// The block manager's, for the calls that pass through unchanged (the tier, events, stats).
    pub fn manager_mut(&mut self) -> &mut BlockManager {
        &mut self.manager
    }

    /// The sequences whose loads have all ended, in every group (`BlockManager::poll_tier`), and
    /// the tokens each now holds in all of them: tables whose loads ended unequally (one was
    /// dropped) are cut back to the longest prefix all serve, or to nothing when a sliding
    /// group's window at that length reaches into entries it was admitted without (module
    /// invariants: every table holds the same tokens).
    pub fn poll_tier(&mut self) -> Vec<LoadsEnded> {
        let ended = self.manager.poll_tier();
        if self.is_plain() {
            return ended; // the tables are the sequences' own
        }
        let g = self.groups.len() as SeqId;
        let mut owners: Vec<SeqId> = ended.iter().map(|e| e.seq / g).collect();
        owners.sort_unstable();
        owners.dedup();
        owners.retain(|&seq| self.manager.contains(self.member(seq, 0)) && !self.is_loading(seq));
        owners
            .into_iter()
            .map(|seq| LoadsEnded {
                seq,
                num_tokens: self.settle(seq),
            })
            .collect()
    }

    /// Cuts every table of `seq` (none loading) back to the tokens all of them serve (see
    /// `poll_tier`); returns that length.
    fn settle(&mut self, seq: SeqId) -> usize {
        let held: Vec<usize> = (0..self.groups.len())
            .map(|g| self.table(seq, g).expect("a live sequence").num_tokens())
            .collect();
        let longest = *held.iter().min().expect("a group");
        if held.iter().all(|&n| n == longest) {
            return longest;
        }
        let unit = self.unit();
        let mut tokens = longest / unit * unit;
        let windows_held = (0..self.groups.len()).all(|g| {
            let table = self.table(seq, g).expect("a live sequence");
            let first = self.first_needed_block(g, tokens);
            table.num_released() <= first
        });
        if !windows_held {
            tokens = 0;
        }
        for g in 0..self.groups.len() {
            let member = self.member(seq, g);
            (self.manager.truncate(member, tokens)).expect("not loading; a block boundary");
        }
        tokens
    }

    /// The module invariants, then the block manager's.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.manager.check_invariants()?;
        let g = self.groups.len() as SeqId;
        for seq in self.manager.sequences() {
            let owner = seq / g;
            let first = self.manager.table(owner * g).map_err(|_| {
                format!("table {seq} belongs to sequence {owner}, which has no group-0 table")
            })?;
            let table = self.manager.table(seq).expect("listed");
            let same = match self.is_loading(owner) {
                true => {
                    table.tokens().starts_with(first.tokens())
                        || first.tokens().starts_with(table.tokens())
                }
                false => table.tokens() == first.tokens(),
            };
            if !same {
                return Err(format!(
                    "sequence {owner}: its groups hold different tokens"
                ));
            }
            let kept = self.groups[(seq % g) as usize];
            if table.block_size() != kept.block_size {
                return Err(format!(
                    "sequence {owner}: group {}'s table counts {} tokens a block, the group {}",
                    seq % g,
                    table.block_size(),
                    kept.block_size
                ));
            }
            if let AttentionKind::Sliding { window } = kept.attention {
                // The next token to compute is at position num_tokens: its window must be held.
                let first_needed = (table.num_tokens() + 1).saturating_sub(window);
                if table.num_released() * kept.block_size > first_needed {
                    return Err(format!(
                        "sequence {owner}: group {} released a block inside its window",
                        seq % g
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::block_manager::TierPolicy;

    const FULL: GroupKeeping = GroupKeeping {
        attention: AttentionKind::Full,
        block_size: 4,
    };
    const LOCAL: GroupKeeping = GroupKeeping {
        attention: AttentionKind::Sliding { window: 6 },
        block_size: 4,
    };

    fn coordinator(num_blocks: usize, groups: Vec<GroupKeeping>) -> KvCoordinator {
        KvCoordinator::new(BlockManager::new(num_blocks, 4, true).unwrap(), groups).unwrap()
    }

    fn admit(c: &mut KvCoordinator, seq: SeqId, tokens: &[TokenId]) -> usize {
        let mut hashes = Vec::new();
        c.extend_hashes(0, &mut hashes, &tokens[..tokens.len() - 1]);
        let found = c.match_prefix(0, &hashes, tokens.len());
        c.admit(seq, tokens, found).unwrap()
    }

    #[test]
    fn capacity_counts_every_group_and_a_window_caps_its_own() {
        // One full group: the whole pool.
        assert_eq!(capacity_tokens(&[FULL], 16, 8), 64);
        // Two full groups share it.
        assert_eq!(capacity_tokens(&[FULL, FULL], 16, 8), 32);
        // A window of 6 with chunks of 8: at most ceil(13 / 4) + 1 = 5 blocks, the rest for the
        // full group.
        assert_eq!(sliding_peak_blocks(6, 8, 4), 5);
        assert_eq!(capacity_tokens(&[FULL, LOCAL], 16, 8), 11 * 4);
        // Windows alone hold any length; the config still bounds it by the pool's tokens.
        assert_eq!(capacity_tokens(&[LOCAL, LOCAL], 16, 8), 16 * 4);
        // Blocks of 2 in the sliding group: ceil(13 / 2) + 1 = 8 of them, 8 left for the full.
        let carved = GroupKeeping {
            block_size: 2,
            ..LOCAL
        };
        assert_eq!(capacity_tokens(&[FULL, carved], 16, 8), 8 * 4);
        assert_eq!(group_root(7, 0), 7);
        assert_ne!(group_root(7, 1), group_root(7, 2));
    }

    #[test]
    fn groups_hold_their_own_blocks_hit_their_own_prefixes_and_release_only_behind_the_window() {
        let mut c = coordinator(32, vec![FULL, LOCAL]);
        let prompt: Vec<TokenId> = (0..17).collect();
        assert_eq!(admit(&mut c, 1, &prompt), 0);
        let (full, local) = (c.table(1, 0).unwrap(), c.table(1, 1).unwrap());
        assert_eq!((full.num_tokens(), local.num_tokens()), (17, 17));
        assert!(full.blocks().iter().all(|b| !local.blocks().contains(b)));
        // The next token (17) reads 12..=17: blocks 0..3 of the sliding group go.
        assert_eq!(c.blocks_in_use(), [5, 5]);
        assert_eq!(c.release_behind(1, 17).unwrap(), 3);
        assert_eq!(c.blocks_in_use(), [5, 2]);
        assert_eq!(c.table(1, 1).unwrap().num_released(), 3);
        assert_eq!(c.table(1, 0).unwrap().num_released(), 0);
        c.check_invariants().unwrap();
        // The same prompt hits all four full blocks in both groups (released ones stay cached).
        assert_eq!(admit(&mut c, 2, &prompt), 16);
        c.fork(2, 3).unwrap();
        c.free(1).unwrap();
        c.free(2).unwrap();
        c.free(3).unwrap();
        c.check_invariants().unwrap();
        assert_eq!(c.manager().stats().used_blocks, 0);
        assert!(matches!(c.free(3), Err(Error::UnknownSequence(_))));
    }

    #[test]
    fn a_sliding_group_serves_a_prefix_from_its_window_alone() {
        const WINDOW_4: GroupKeeping = GroupKeeping {
            attention: AttentionKind::Sliding { window: 4 },
            block_size: 4,
        };
        // A holds 5 full blocks and, once its window moved, 2 sliding ones: 7 of 17.
        let mut c = coordinator(17, vec![FULL, WINDOW_4]);
        let prompt: Vec<TokenId> = (0..17).collect();
        admit(&mut c, 1, &prompt);
        assert_eq!(c.release_behind(1, 17).unwrap(), 3);
        // B takes the 7 free blocks and evicts the 3 the window released, then leaves.
        admit(&mut c, 2, &(100..120).collect::<Vec<_>>());
        assert_eq!(c.manager().stats().free_blocks, 0);
        c.free(2).unwrap();
        // The prompt's next query (position 16) reads 13..=16: sliding block 3 only, which A holds.
        let mut hashes = Vec::new();
        c.extend_hashes(0, &mut hashes, &prompt[..16]);
        // Its sliding blocks 0..3 are gone: a rule asking every group for every block finds 0.
        assert!(hashes[1][..3]
            .iter()
            .all(|&h| c.manager().cached_block(h).is_none()));
        let found = c.match_prefix(0, &hashes, 17);
        assert_eq!(found[0].blocks, c.table(1, 0).unwrap().blocks()[..4]);
        assert_eq!(found[1].blocks[..3], [RELEASED; 3]);
        assert_eq!(found[1].blocks[3], c.table(1, 1).unwrap().blocks()[3]);
        assert_eq!(c.admit(3, &prompt, found).unwrap(), 16);
        assert_eq!(c.table(3, 1).unwrap().num_released(), 3);
        c.check_invariants().unwrap();
        c.free(1).unwrap();
        c.free(3).unwrap();
        c.check_invariants().unwrap();
    }

    #[test]
    fn groups_of_different_block_sizes_share_prefixes_on_their_common_boundaries() {
        // Pages of 4 tokens; the sliding group carves them into blocks of 2 (window 3).
        let carved = GroupKeeping {
            attention: AttentionKind::Sliding { window: 3 },
            block_size: 2,
        };
        let mut c = coordinator(32, vec![FULL, carved]);
        let prompt: Vec<TokenId> = (0..11).collect();
        admit(&mut c, 1, &prompt);
        let (full, local) = (c.table(1, 0).unwrap(), c.table(1, 1).unwrap());
        assert_eq!((full.blocks().len(), local.blocks().len()), (3, 6));
        assert_eq!((full.block_size(), local.block_size()), (4, 2));
        // Slots count each group's own blocks.
        assert_eq!(local.slot(5), i64::from(local.blocks()[2]) * 2 + 1);
        // The next query (position 11) reads 9..=11: the sliding group keeps blocks 4 and 5.
        assert_eq!(c.release_behind(1, 11).unwrap(), 4);
        assert_eq!(c.blocks_in_use(), [3, 2]);
        c.check_invariants().unwrap();
        // A prompt of 11 tokens: its 10 cacheable tokens end on a block of 2 but not of 4, so
        // the hit is 8 tokens, 2 full blocks and 4 sliding ones, of which the query at 8 reads
        // 6..=8: block 3 (blocks 0..3 admitted released, though evicted or not).
        let mut hashes = Vec::new();
        c.extend_hashes(0, &mut hashes, &prompt[..10]);
        assert_eq!((hashes[0].len(), hashes[1].len()), (2, 5));
        let found = c.match_prefix(0, &hashes, 11);
        assert_eq!((found[0].blocks.len(), found[1].blocks.len()), (2, 4));
        assert_eq!(found[1].blocks[..3], [RELEASED; 3]);
        assert_eq!((found[0].block_size, found[1].block_size), (4, 2));
        // Block 3 of the sliding group (tokens 6..8) was released to the cache: a hit.
        assert_eq!(
            found[1].blocks[3],
            c.manager().cached_block(hashes[1][3]).unwrap()
        );
        assert_eq!(c.admit(2, &prompt, found).unwrap(), 8);
        assert_eq!(c.table(2, 1).unwrap().num_released(), 3);
        c.check_invariants().unwrap();
        for seq in [1, 2] {
            c.free(seq).unwrap();
        }
        assert_eq!(c.manager().stats().used_blocks, 0);
        // A group's blocks must divide the pages.
        let odd = GroupKeeping {
            block_size: 3,
            ..carved
        };
        let manager = BlockManager::new(8, 4, true).unwrap();
        assert!(matches!(
            KvCoordinator::new(manager, vec![FULL, odd]),
            Err(Error::InvalidArgument(m)) if m.contains("divide")
        ));
    }

    #[test]
    fn an_append_short_of_blocks_in_any_group_changes_no_group() {
        let mut c = coordinator(4, vec![FULL, FULL]);
        admit(&mut c, 1, &[1, 2, 3, 4, 5]); // 2 blocks in each group: the pool is full
        let before: Vec<Vec<_>> = (0..2)
            .map(|g| c.table(1, g).unwrap().blocks().to_vec())
            .collect();
        let mut copies = Vec::new();
        let refused = c.append(1, &[6, 7, 8, 9], &mut copies);
        assert!(matches!(
            refused,
            Err(Error::OutOfBlocks {
                needed: 2,
                available: 0
            })
        ));
        for (g, blocks) in before.iter().enumerate() {
            assert_eq!(c.table(1, g).unwrap().blocks(), &blocks[..]);
            assert_eq!(c.table(1, g).unwrap().num_tokens(), 5);
        }
        assert!(copies.is_empty());
        c.check_invariants().unwrap();
    }

    /// A tier in memory: an offload is held at once (its block returned to the pool); a load
    /// ends at the next `completed_loads`, `Dropped` if its hash is in `drop`.
    struct MemoryTier {
        link: crate::tier::TierLink,
        held: std::collections::HashMap<BlockHash, u32>,
        drop: std::sync::Arc<std::sync::Mutex<Vec<BlockHash>>>,
        loads: Vec<crate::tier::LoadJob>,
    }

    impl KvTier for MemoryTier {
        fn contains(&self, hash: BlockHash) -> bool {
            self.held.contains_key(&hash)
        }
        fn offload(&mut self, job: crate::tier::OffloadJob) {
            self.held.insert(job.key.hash, job.group);
            self.link.free.push(job.block);
            (self.link.returned).fetch_add(1, crate::sync::Ordering::Release);
        }
        fn load(&mut self, job: crate::tier::LoadJob) {
            self.loads.push(job);
        }
        fn completed_loads(&mut self) -> Vec<crate::tier::LoadDone> {
            let loads = std::mem::take(&mut self.loads);
            loads
                .into_iter()
                .map(|job| {
                    let held = self.held.get(&job.key.hash) == Some(&job.group);
                    let dropped = self.drop.lock().unwrap().contains(&job.key.hash);
                    crate::tier::LoadDone {
                        block: job.block,
                        outcome: match held && !dropped {
                            true => crate::tier::LoadOutcome::Loaded,
                            false => crate::tier::LoadOutcome::Dropped,
                        },
                    }
                })
                .collect()
        }
        fn flush(&mut self) {}
        fn counters(&self) -> crate::tier::TierCounters {
            crate::tier::TierCounters::default()
        }
        fn stored_blocks(&self) -> Vec<(BlockHash, u32)> {
            self.held.iter().map(|(&h, &g)| (h, g)).collect()
        }
        fn drain_events(&mut self, _: &mut Vec<crate::memory::events::KvEvent>) {}
    }

    #[test]
    fn a_prefix_on_the_tier_loads_in_every_group_and_a_dropped_load_cuts_all_back() {
        // Pages of 4 tokens; the sliding group (window 3) in blocks of 2.
        let carved = GroupKeeping {
            attention: AttentionKind::Sliding { window: 3 },
            block_size: 2,
        };
        let mut manager = BlockManager::new(24, 4, true).unwrap();
        let link = manager.tier_link();
        // Every cached block goes to the tier at the next poll.
        (manager.set_tier_policy(TierPolicy {
            min_load_blocks: 1,
            offload_watermark: 24,
        }))
        .unwrap();
        let mut c = KvCoordinator::new(manager, vec![FULL, carved]).unwrap();
        let drop = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let tier = MemoryTier {
            link,
            held: Default::default(),
            drop: drop.clone(),
            loads: Vec::new(),
        };
        c.attach_tier(Box::new(tier)).unwrap();
        let prompt: Vec<TokenId> = (0..11).collect();
        admit(&mut c, 1, &prompt);
        c.release_behind(1, 11).unwrap();
        c.free(1).unwrap();
        assert!(c.poll_tier().is_empty());
        assert_eq!(c.manager().stats().cached_blocks, 0, "all offloaded");
        let mut hashes = Vec::new();
        c.extend_hashes(0, &mut hashes, &prompt[..10]);
        // 8 tokens: the full group's blocks 0 and 1 and the sliding group's block 3 (tokens
        // 6..8, the window of the query at 8) are loaded; sliding blocks 0..3 are not read.
        let found = c.match_prefix(0, &hashes, 11);
        let loads: Vec<usize> = found.iter().map(|f| f.tier_hashes.len()).collect();
        assert_eq!(loads, [2, 1]);
        assert_eq!(found[1].blocks, [RELEASED; 3]);
        assert_eq!(c.admit(2, &prompt[..8], found).unwrap(), 0);
        assert!(c.is_loading(2));
        c.check_invariants().unwrap();
        let ended = c.poll_tier();
        assert_eq!((ended[0].seq, ended[0].num_tokens), (2, 8));
        assert!(!c.is_loading(2));
        assert_eq!(c.table(2, 1).unwrap().num_released(), 3);
        c.check_invariants().unwrap();
        c.free(2).unwrap();
        // Offload again; then the full group's block 1 fails to load: the full table keeps 4
        // tokens, whose window the sliding table (admitted from block 3) does not hold: both are
        // cut to nothing, the prompt recomputed.
        assert!(c.poll_tier().is_empty());
        let found = c.match_prefix(0, &hashes, 11);
        drop.lock().unwrap().push(found[0].tier_hashes[1]);
        c.admit(3, &prompt[..8], found).unwrap();
        let ended = c.poll_tier();
        assert_eq!((ended[0].seq, ended[0].num_tokens), (3, 0));
        for g in 0..2 {
            assert_eq!(c.table(3, g).unwrap().num_tokens(), 0);
        }
        c.check_invariants().unwrap();
        c.free(3).unwrap();
        assert_eq!(c.manager().stats().used_blocks, 0);
    }
}
