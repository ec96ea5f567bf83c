//! The eviction order of the cached (evictable) blocks: an intrusive least-recently-used list over
//! block ids, and the policy ([`Evictable`]) built from two of them.
//!
//! Invariants of [`Lru`]: each id is in the list at most once; `prev`/`next` of an id are meaningful
//! only while it is in the list; the front is the least recently used id. Push, removal of any id,
//! and pop of the front are O(1) with no allocation after construction.
//!
//! Invariants of [`Evictable`]: an id is in at most one segment; under `Lru` the protected segment
//! is empty; under `Slru` an id is in the protected segment only if it was hit since it was last
//! evicted, and after every call the protected segment holds at most `protected_share` of the
//! evictable ids.

use crate::alloc::{try_vec_with, try_zeroed_vec};
use crate::error::{Error, Result};

const NIL: u32 = u32::MAX;

/// Doubly linked list of block ids stored in two index arrays.
#[derive(Debug, Clone)]
pub struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    front: u32,
    back: u32,
    len: usize,
}

impl Lru {
    /// An empty list able to hold ids `0..capacity` (`OutOfMemory` if its arrays cannot be
    /// allocated).
    pub fn new(capacity: usize) -> Result<Self> {
        Ok(Lru {
            prev: try_vec_with(capacity, "the LRU links", |_| NIL)?,
            next: try_vec_with(capacity, "the LRU links", |_| NIL)?,
            linked: try_zeroed_vec(capacity, "the LRU flags")?,
            front: NIL,
            back: NIL,
            len: 0,
        })
    }

    /// Number of ids in the list.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `id` is in the list.
    pub fn contains(&self, id: u32) -> bool {
        self.linked[id as usize]
    }

    /// Appends `id` as the most recently used. `id` must not be in the list.
    pub fn push_back(&mut self, id: u32) {
        debug_assert!(!self.contains(id));
        let i = id as usize;
        self.prev[i] = self.back;
        self.next[i] = NIL;
        if self.back == NIL {
            self.front = id;
        } else {
            self.next[self.back as usize] = id;
        }
        self.back = id;
        self.linked[i] = true;
        self.len += 1;
    }

    /// Unlinks `id`; returns whether it was in the list.
    pub fn remove(&mut self, id: u32) -> bool {
        let i = id as usize;
        if !self.linked[i] {
            return false;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.front = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.back = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.linked[i] = false;
        self.len -= 1;
        true
    }

    /// Removes and returns the least recently used id.
    pub fn pop_front(&mut self) -> Option<u32> {
        let id = self.front;
        (id != NIL).then(|| {
            self.remove(id);
            id
        })
    }

    /// Ids from least to most recently used.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors((self.front != NIL).then_some(self.front), move |&id| {
            let n = self.next[id as usize];
            (n != NIL).then_some(n)
        })
    }
}

/// Which cached block an allocation evicts when no block is clean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// The least recently released cached block.
    Lru,
    /// Segmented LRU: blocks never hit since they were cached are evicted (least recently released
    /// first) before any block that was hit at least once.
    Slru,
}

impl EvictionPolicy {
    /// The name `from_name` reads.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Slru => "slru",
        }
    }

    /// The policy named `name` (`"lru"` or `"slru"`); `InvalidArgument` otherwise.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "lru" => Ok(EvictionPolicy::Lru),
            "slru" => Ok(EvictionPolicy::Slru),
            other => Err(Error::InvalidArgument(format!(
                "eviction_policy must be 'lru' or 'slru', got {other:?}"
            ))),
        }
    }
}

/// Most of the evictable set the protected segment may hold, in percent. 80% is the split Caffeine's
/// W-TinyLFU and the SLRU literature default to: the probation segment keeps a fifth of the set, so a
/// block cached once still has room to earn its first hit before it goes.
const PROTECTED_PERCENT: usize = 80;

/// Most protected ids in an evictable set of `len`: `PROTECTED_PERCENT`% rounded up, so a set of a
/// few hit blocks is not demoted wholesale (one hit block alone stays protected).
fn protected_share(len: usize) -> usize {
    (len * PROTECTED_PERCENT).div_ceil(100)
}

/// The evictable blocks in eviction order, under an [`EvictionPolicy`].
///
/// Segmented LRU rather than S3-FIFO or ARC: the cached set here changes only by a block's release
/// (push), its reuse (remove) and eviction (pop), and "hit at least once" is exactly the signal that
/// separates a shared system prompt or an earlier turn of a conversation (hit again and again) from a
/// one-off prompt's blocks (never hit). SLRU needs no ghost lists (ARC, S3-FIFO both keep one sized
/// like the cache), is O(1) on two of the intrusive lists this module already has, and keeps the
/// order a sequence's release gives (tail first) within each segment. Prefix hits are contiguous from
/// a chain's root, so a hit child implies a hit parent: a sequence's tail never sits in a segment
/// evicted after its head's.
#[derive(Debug, Clone)]
pub struct Evictable {
    policy: EvictionPolicy,
    /// Never hit since cached; evicted first. Under `Lru`, every evictable id.
    probation: Lru,
    /// Hit at least once; demoted to probation's back when the segment exceeds its share.
    protected: Lru,
    hit: Vec<bool>,
}

impl Evictable {
    /// An empty set able to hold ids `0..capacity` (`OutOfMemory` if its arrays cannot be allocated).
    pub fn new(capacity: usize, policy: EvictionPolicy) -> Result<Self> {
        Ok(Evictable {
            policy,
            probation: Lru::new(capacity)?,
            protected: Lru::new(capacity)?,
            hit: try_zeroed_vec(capacity, "the eviction hit flags")?,
        })
    }

    /// The policy in force.
    pub fn policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// Number of evictable ids.
    pub fn len(&self) -> usize {
        self.probation.len() + self.protected.len()
    }

    /// Whether no id is evictable.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `id` is evictable.
    pub fn contains(&self, id: u32) -> bool {
        self.probation.contains(id) || self.protected.contains(id)
    }

    /// Records a prefix hit on `id` (evictable or not): when next released it is protected.
    pub fn mark_hit(&mut self, id: u32) {
        self.hit[id as usize] = true;
    }

    /// Makes `id` evictable, most recently used in its segment. `id` must not be evictable.
    pub fn push(&mut self, id: u32) {
        if self.policy == EvictionPolicy::Slru && self.hit[id as usize] {
            self.protected.push_back(id);
        } else {
            self.probation.push_back(id);
        }
        self.rebalance();
    }

    /// Takes `id` out of the evictable set (it is in use again); returns whether it was in it.
    pub fn remove(&mut self, id: u32) -> bool {
        let removed = self.probation.remove(id) || self.protected.remove(id);
        self.rebalance();
        removed
    }

    /// Removes and returns the id to evict, forgetting its hits.
    pub fn pop(&mut self) -> Option<u32> {
        let id = self
            .probation
            .pop_front()
            .or_else(|| self.protected.pop_front())?;
        self.hit[id as usize] = false;
        self.rebalance();
        Some(id)
    }

    /// Ids in eviction order (first evicted first).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.probation.iter().chain(self.protected.iter())
    }

    /// Demotes the least recently used protected ids until the segment is within its share. Each
    /// call changes the set by one id, so this moves at most one.
    fn rebalance(&mut self) {
        while self.protected.len() > protected_share(self.len()) {
            let id = self.protected.pop_front().expect("non-empty");
            self.probation.push_back(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The reference model of `Evictable`: two plain vectors, front first, and a set of hit ids.
    #[derive(Default)]
    struct Model {
        slru: bool,
        probation: Vec<u32>,
        protected: Vec<u32>,
        hit: std::collections::HashSet<u32>,
    }

    impl Model {
        fn len(&self) -> usize {
            self.probation.len() + self.protected.len()
        }
        fn rebalance(&mut self) {
            while self.protected.len() > protected_share(self.len()) {
                let id = self.protected.remove(0);
                self.probation.push(id);
            }
        }
        fn contains(&self, id: u32) -> bool {
            self.probation.contains(&id) || self.protected.contains(&id)
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(u32),
        Remove(u32),
        Hit(u32),
        Pop,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0..12u32).prop_map(Op::Push),
            1 => (0..12u32).prop_map(Op::Remove),
            2 => (0..12u32).prop_map(Op::Hit),
            2 => Just(Op::Pop),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        #[test]
        fn evictable_matches_the_reference_model(slru: bool, ops in prop::collection::vec(op(), 1..80)) {
            let policy = if slru { EvictionPolicy::Slru } else { EvictionPolicy::Lru };
            let mut real = Evictable::new(12, policy).unwrap();
            let mut model = Model { slru, ..Model::default() };
            for op in ops {
                match op {
                    Op::Push(id) if !model.contains(id) => {
                        real.push(id);
                        if model.slru && model.hit.contains(&id) {
                            model.protected.push(id);
                        } else {
                            model.probation.push(id);
                        }
                        model.rebalance();
                    }
                    Op::Push(_) => {}
                    Op::Remove(id) => {
                        let was = model.contains(id);
                        model.probation.retain(|&x| x != id);
                        model.protected.retain(|&x| x != id);
                        model.rebalance();
                        prop_assert_eq!(real.remove(id), was);
                    }
                    Op::Hit(id) => {
                        real.mark_hit(id);
                        model.hit.insert(id);
                    }
                    Op::Pop => {
                        let expected = if model.probation.is_empty() {
                            (!model.protected.is_empty()).then(|| model.protected.remove(0))
                        } else {
                            Some(model.probation.remove(0))
                        };
                        if let Some(id) = expected {
                            model.hit.remove(&id);
                        }
                        model.rebalance();
                        prop_assert_eq!(real.pop(), expected);
                    }
                }
                let order: Vec<u32> = model.probation.iter().chain(&model.protected).copied().collect();
                prop_assert_eq!(real.iter().collect::<Vec<_>>(), order);
                prop_assert_eq!(real.len(), model.len());
                prop_assert!(real.protected.len() <= protected_share(real.len()));
            }
        }
    }

    #[test]
    fn slru_evicts_never_hit_blocks_before_hit_ones() {
        let mut set = Evictable::new(6, EvictionPolicy::Slru).unwrap();
        set.mark_hit(0);
        for id in 0..5 {
            set.push(id);
        }
        assert_eq!(set.iter().collect::<Vec<_>>(), vec![1, 2, 3, 4, 0]);
        assert_eq!(set.pop(), Some(1), "the oldest never-hit block goes first");
        let mut lru = Evictable::new(6, EvictionPolicy::Lru).unwrap();
        lru.mark_hit(0);
        for id in 0..5 {
            lru.push(id);
        }
        assert_eq!(lru.pop(), Some(0), "plain LRU ignores hits");
        assert!(EvictionPolicy::from_name("arc").is_err());
    }

    #[test]
    fn evicts_in_insertion_order_and_removes_from_the_middle() {
        let mut lru = Lru::new(5).unwrap();
        for id in [3, 1, 4, 0] {
            lru.push_back(id);
        }
        assert!(lru.remove(1));
        assert!(!lru.remove(1));
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![3, 4, 0]);
        assert_eq!(lru.pop_front(), Some(3));
        lru.push_back(3);
        assert_eq!(lru.iter().collect::<Vec<_>>(), vec![4, 0, 3]);
        assert_eq!(lru.len(), 3);
        assert!(lru.remove(3) && lru.remove(4) && lru.remove(0));
        assert!(lru.is_empty());
        assert_eq!(lru.pop_front(), None);
    }
}
