//! A generational slab: dense storage for requests and sequences, indexed by handles that go stale
//! when their entry is removed.
//!
//! Invariants: a handle returned by `insert` resolves (`get`/`get_mut`) exactly until `remove` of
//! that handle; a slot reused later carries a higher generation, so an old handle never resolves to
//! a new entry. Freed slots are reused, so memory follows the number of live entries, not history.

/// A reference to one slab entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Handle {
    index: u32,
    generation: u32,
}

impl Handle {
    /// Position of the entry in the slab (stable while the entry lives).
    pub fn index(self) -> usize {
        self.index as usize
    }
}

struct Slot<T> {
    generation: u32,
    value: Option<T>,
}

/// Entries of type `T` addressed by generational handles.
pub struct Slab<T> {
    slots: Vec<Slot<T>>,
    vacant: Vec<u32>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            slots: Vec::new(),
            vacant: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    /// Number of live entries.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slab holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Stores `value`, reusing a vacant slot if there is one.
    pub fn insert(&mut self, value: T) -> Handle {
        self.len += 1;
        match self.vacant.pop() {
            Some(index) => {
                let slot = &mut self.slots[index as usize];
                slot.value = Some(value);
                Handle {
                    index,
                    generation: slot.generation,
                }
            }
            None => {
                let index = u32::try_from(self.slots.len()).expect("fewer than 2^32 live entries");
                self.slots.push(Slot {
                    generation: 0,
                    value: Some(value),
                });
                Handle {
                    index,
                    generation: 0,
                }
            }
        }
    }

    /// The entry of `handle`, unless it was removed.
    pub fn get(&self, handle: Handle) -> Option<&T> {
        let slot = self.slots.get(handle.index())?;
        if slot.generation == handle.generation {
            slot.value.as_ref()
        } else {
            None
        }
    }

    /// The entry of `handle` for update, unless it was removed.
    pub fn get_mut(&mut self, handle: Handle) -> Option<&mut T> {
        let slot = self.slots.get_mut(handle.index())?;
        if slot.generation == handle.generation {
            slot.value.as_mut()
        } else {
            None
        }
    }

    /// Takes the entry of `handle` out; the handle (and every copy of it) goes stale.
    pub fn remove(&mut self, handle: Handle) -> Option<T> {
        let slot = self.slots.get_mut(handle.index())?;
        if slot.generation != handle.generation {
            return None;
        }
        let value = slot.value.take()?;
        slot.generation = slot.generation.wrapping_add(1);
        self.vacant.push(handle.index);
        self.len -= 1;
        Some(value)
    }

    /// Live entries with their handles, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (Handle, &T)> {
        self.slots.iter().enumerate().filter_map(|(index, slot)| {
            slot.value.as_ref().map(|value| {
                (
                    Handle {
                        index: index as u32,
                        generation: slot.generation,
                    },
                    value,
                )
            })
        })
    }
}

impl<T> std::ops::Index<Handle> for Slab<T> {
    type Output = T;
    fn index(&self, handle: Handle) -> &T {
        self.get(handle).expect("live handle")
    }
}

impl<T> std::ops::IndexMut<Handle> for Slab<T> {
    fn index_mut(&mut self, handle: Handle) -> &mut T {
        self.get_mut(handle).expect("live handle")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_handles_go_stale_even_when_the_slot_is_reused() {
        let mut slab = Slab::default();
        let a = slab.insert("a");
        assert_eq!(slab.remove(a), Some("a"));
        let b = slab.insert("b");
        assert_eq!(a.index(), b.index(), "the slot is reused");
        assert_eq!(slab.get(a), None);
        assert_eq!(slab.remove(a), None);
        assert_eq!(slab[b], "b");
        assert_eq!(slab.len(), 1);
    }
}
