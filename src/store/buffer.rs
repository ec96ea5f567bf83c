//! Allocation of the large buffers the attention loop streams through (K/V, the bandwidth probe).
//!
//! Invariants:
//! - Every allocation is fallible ([`crate::alloc`]): a size the allocator cannot supply is
//!   `Error::OutOfMemory`, never an abort or a panic, so a too-large cache asked for from Python
//!   raises `MemoryError` and leaves the process as it was.
//! - Buffers are zero-filled by the allocator (untouched pages stay unbacked until written), and on
//!   Linux their 2 MiB-aligned interior is marked for transparent huge pages before any page is
//!   touched. A shuffled block table jumps between 4 KiB pages on every tile; with huge pages
//!   those jumps stop costing a page walk each (a nested one inside a VM). The advice is a hint:
//!   where the kernel refuses it, buffers simply stay on small pages.
//! - Random buffers hold values in [-1, 1) in every element, so every page is backed by memory of
//!   its own: benchmarks then read memory, not the shared zero page.

use bytemuck::Zeroable;

use crate::alloc::try_zeroed_vec;
use crate::error::Result;
use crate::store::dtype::KvElement;

const HUGE_PAGE: usize = 2 << 20;

/// A zero-filled vector of `len` elements, on huge pages where the system allows; `what` names it
/// in the error when it cannot be had.
pub(crate) fn zeroed_vec<T: Zeroable + Clone>(len: usize, what: &str) -> Result<Vec<T>> {
    let buffer = try_zeroed_vec(len, what)?;
    advise_huge_pages(&buffer);
    Ok(buffer)
}

/// `len` pseudo-random values in [-1, 1) from `seed`, on huge pages where the system allows.
pub(crate) fn random_vec<T: KvElement>(len: usize, seed: u64, what: &str) -> Result<Vec<T>> {
    let mut values = zeroed_vec(len, what)?;
    fill_random(&mut values, seed);
    Ok(values)
}

/// Overwrites `values` with pseudo-random values in [-1, 1) from `seed` (splitmix64).
pub(crate) fn fill_random<T: KvElement>(values: &mut [T], seed: u64) {
    let mut state = seed;
    for value in values {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        *value = T::from_f32((z >> 40) as f32 / (1u64 << 23) as f32 - 1.0);
    }
}

#[cfg(target_os = "linux")]
fn advise_huge_pages<T>(buffer: &[T]) {
    let start = (buffer.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
    let end = (buffer.as_ptr() as usize + std::mem::size_of_val(buffer)) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: the range lies inside `buffer`'s allocation; MADV_HUGEPAGE changes no contents.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages<T>(_buffer: &[T]) {}
