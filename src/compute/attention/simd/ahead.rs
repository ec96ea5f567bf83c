//! Software prefetch of the next tile, paced through the arithmetic of the current one (shared by
//! the x86 kernels; a prefetch never faults, so any address range is safe to request).

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};

/// The tile a step ahead, pulled into L2 while the kernels compute on the current one.
///
/// Pacing matters more than distance here (measured on Zen 3, decode from memory): a burst of
/// 128+ prefetches per tile fills the miss buffers and stalls the core with the arithmetic
/// it could have overlapped (0.33–0.36 of the read bandwidth); one line requested per 8 FMAs,
/// about one line per line of f32 K/V consumed, reached 0.57–0.74.
pub(super) struct Ahead {
    start: *const i8,
    next: *const i8,
    end: *const i8,
}

impl Ahead {
    pub(super) fn new<T>(tile: &[T]) -> Self {
        let range = tile.as_ptr_range();
        Ahead {
            start: range.start.cast(),
            next: range.start.cast(),
            end: range.end.cast(),
        }
    }

    /// Requests the next 64-byte line of the tile, if any is left.
    #[inline(always)]
    pub(super) fn line(&mut self) {
        if self.next < self.end {
            // SAFETY: `next` lies inside the tile; a prefetch never faults or writes.
            unsafe {
                _mm_prefetch::<_MM_HINT_T1>(self.next);
                self.next = self.next.add(64);
            }
        }
    }

    /// One line per inner-loop iteration that reads `bytes` of the current tile: one per
    /// 64 bytes of f32, one per other iteration for 16-bit K/V (AVX2's pacing).
    #[inline(always)]
    pub(super) fn pace(&mut self, bytes: usize, iteration: usize) {
        if bytes >= 64 || iteration.is_multiple_of(2) {
            self.line();
        }
    }

    /// One line per 64 bytes an inner-loop iteration reads (AVX-512's pacing: its iterations
    /// read 64-256 bytes).
    #[inline(always)]
    pub(super) fn lines(&mut self, bytes: usize) {
        for _ in 0..bytes.div_ceil(64) {
            self.line();
        }
    }

    /// Catches up to fraction `done / total` of the tile (where iterations read more than a
    /// line each), or requests the rest when `done == total`.
    #[inline(always)]
    pub(super) fn until(&mut self, done: usize, total: usize) {
        let len = self.end as usize - self.start as usize;
        let target = self.start.wrapping_add(len * done / total);
        while self.next < target {
            self.line();
        }
    }
}
