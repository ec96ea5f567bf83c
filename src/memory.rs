//! Allocation of the large buffers the attention loop streams through (K/V, the bandwidth probe).
//!
//! Invariants: buffers are zero-filled by the allocator (untouched pages stay unbacked until
//! written), and on Linux their 2 MiB-aligned interior is marked for transparent huge pages before
//! any page is touched. A shuffled block table jumps between 4 KiB pages on every tile; with huge
//! pages those jumps stop costing a page walk each (a nested one inside a VM). The advice is a
//! hint: where the kernel refuses it, buffers simply stay on small pages.

use bytemuck::Zeroable;

const HUGE_PAGE: usize = 2 << 20;

/// A zero-filled vector of `len` elements, on huge pages where the system allows.
pub(crate) fn zeroed_vec<T: Zeroable + Clone>(len: usize) -> Vec<T> {
    let buffer = bytemuck::zeroed_vec::<T>(len);
    advise_huge_pages(&buffer);
    buffer
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
