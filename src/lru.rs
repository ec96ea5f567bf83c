//! An intrusive least-recently-used list over block ids, for the cached (evictable) blocks.
//!
//! Invariants: each id is in the list at most once; `prev`/`next` of an id are meaningful only while
//! it is in the list; the front is the least recently used id. Push, removal of any id, and pop of
//! the front are O(1) with no allocation after construction.

use crate::alloc::{try_vec_with, try_zeroed_vec};
use crate::error::Result;

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

#[cfg(test)]
mod tests {
    use super::*;

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
