//! A lock-free stack of free block ids (a Treiber stack over an index array).
//!
//! Invariants:
//! - every id in `0..capacity` is either on the stack exactly once or held by exactly one caller;
//! - `head` packs the top id (low 32 bits, `NIL` when empty) with a tag (high 32 bits) that grows on
//!   every successful push or pop, so a head that was popped and pushed back between a reader's load
//!   and its compare-exchange fails the exchange (no ABA);
//! - `next[id]` is meaningful only while `id` is on the stack.
//!
//! Pushing an id that is already free is a caller bug; `BlockPool` tracks states so it never does.

use crate::alloc::try_vec_with;
use crate::error::{ensure, Result};
use crate::sync::{AtomicU32, AtomicU64, Ordering};

const NIL: u32 = u32::MAX;

/// A lock-free LIFO of block ids, safe to push and pop from many threads at once.
pub struct FreeList {
    head: AtomicU64,
    next: Box<[AtomicU32]>,
}

fn pack(tag: u32, id: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(id)
}

fn unpack(word: u64) -> (u32, u32) {
    ((word >> 32) as u32, word as u32)
}

impl FreeList {
    /// A free list holding every id in `0..capacity`, with id 0 on top. Fails (allocating
    /// nothing) with `InvalidArgument` if `capacity` does not fit below `u32::MAX` (ids are
    /// 32-bit), or `OutOfMemory` if its index array cannot be allocated.
    pub fn full(capacity: usize) -> Result<Self> {
        ensure(capacity < NIL as usize, || {
            format!("free list capacity {capacity} exceeds u32 ids")
        })?;
        let next = try_vec_with(capacity, "the free list", |id| {
            let successor = if id + 1 < capacity {
                id as u32 + 1
            } else {
                NIL
            };
            AtomicU32::new(successor)
        })?;
        let top = if capacity == 0 { NIL } else { 0 };
        Ok(FreeList {
            head: AtomicU64::new(pack(0, top)),
            next: next.into_boxed_slice(),
        })
    }

    /// How many ids the list can hold.
    pub fn capacity(&self) -> usize {
        self.next.len()
    }

    /// Whether the list holds no id (a snapshot: other threads may push or pop right after).
    /// There is no `len`: keeping a shared count would double the atomic operations per call, so
    /// owners that need one (the block pool) count on their side.
    pub fn is_empty(&self) -> bool {
        unpack(self.head.load(Ordering::Acquire)).1 == NIL
    }

    /// Takes an id off the list, or `None` if it is empty.
    pub fn pop(&self) -> Option<u32> {
        let mut current = self.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(current);
            if top == NIL {
                return None;
            }
            // Reading `next[top]` may race with a push that has since reused `top`; the tag makes
            // the exchange below fail in that case, so a stale successor is never installed.
            let successor = self.next[top as usize].load(Ordering::Relaxed);
            match self.head.compare_exchange_weak(
                current,
                pack(tag.wrapping_add(1), successor),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(top),
                Err(actual) => current = actual,
            }
        }
    }

    /// Puts `id` back on the list. The caller must hold `id` (it must not be on the list already).
    pub fn push(&self, id: u32) {
        debug_assert!(
            (id as usize) < self.capacity(),
            "block id {id} out of range"
        );
        let mut current = self.head.load(Ordering::Relaxed);
        loop {
            let (tag, top) = unpack(current);
            self.next[id as usize].store(top, Ordering::Relaxed);
            match self.head.compare_exchange_weak(
                current,
                pack(tag.wrapping_add(1), id),
                Ordering::Release,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(actual) => current = actual,
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn pops_every_id_once_then_runs_dry() {
        let list = FreeList::full(5).unwrap();
        let ids: Vec<u32> = std::iter::from_fn(|| list.pop()).collect();
        assert_eq!(ids, vec![0, 1, 2, 3, 4]);
        assert!(list.is_empty());
        assert_eq!(list.pop(), None);
    }

    #[test]
    fn push_is_last_in_first_out() {
        let list = FreeList::full(3).unwrap();
        let a = list.pop().unwrap();
        let b = list.pop().unwrap();
        list.push(a);
        list.push(b);
        assert_eq!(list.pop(), Some(b));
        assert_eq!(list.pop(), Some(a));
    }

    #[test]
    fn empty_list_is_empty() {
        let list = FreeList::full(0).unwrap();
        assert_eq!(list.pop(), None);
        assert_eq!(list.capacity(), 0);
    }

    /// Every thread pops and pushes back in a tight loop; afterwards every id is on the list exactly
    /// once, and no id was ever held by two threads at the same time.
    #[test]
    fn stress_many_threads_no_loss_no_double_handout() {
        const CAPACITY: usize = 64;
        const THREADS: usize = 4;
        const ROUNDS: usize = 150_000; // 4 threads x 150k x (pop + push) = 1.2M operations
        let list = FreeList::full(CAPACITY).unwrap();
        let held: Vec<std::sync::atomic::AtomicBool> = (0..CAPACITY)
            .map(|_| std::sync::atomic::AtomicBool::new(false))
            .collect();
        std::thread::scope(|scope| {
            for thread in 0..THREADS {
                let (list, held) = (&list, &held);
                scope.spawn(move || {
                    let mut mine = Vec::new();
                    for round in 0..ROUNDS {
                        // Hold a varying number of ids to vary the interleavings.
                        if mine.len() < 1 + (round + thread) % 4 {
                            if let Some(id) = list.pop() {
                                let was_held = held[id as usize]
                                    .swap(true, std::sync::atomic::Ordering::SeqCst);
                                assert!(!was_held, "id {id} handed out twice");
                                mine.push(id);
                            }
                        } else {
                            let id = mine.pop().unwrap();
                            held[id as usize].store(false, std::sync::atomic::Ordering::SeqCst);
                            list.push(id);
                        }
                    }
                    for id in mine {
                        held[id as usize].store(false, std::sync::atomic::Ordering::SeqCst);
                        list.push(id);
                    }
                });
            }
        });
        let ids: Vec<u32> = std::iter::from_fn(|| list.pop()).collect();
        assert_eq!(ids.len(), CAPACITY);
        let ids: HashSet<u32> = ids.into_iter().collect();
        assert_eq!(ids.len(), CAPACITY, "an id is on the list twice");
        assert!(ids.iter().all(|&id| (id as usize) < CAPACITY));
    }
}
