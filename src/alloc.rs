//! Fallible allocation of the core's long-lived buffers (block pool arrays, KV storage): a size
//! the allocator refuses is `Error::OutOfMemory`, never an abort, so a caller asking for too much
//! gets an error it can handle and the process keeps running. Only construction allocates this
//! way; the per-step paths grow small vectors whose failure would mean the process is already lost.

use bytemuck::Zeroable;

use crate::error::{Error, Result};

fn refused<T>(len: usize, what: &str) -> Error {
    let bytes = len.saturating_mul(std::mem::size_of::<T>());
    Error::OutOfMemory(format!("{what} ({len} elements, {bytes} bytes)"))
}

/// `len` elements made by `element(i)`, or `OutOfMemory` naming `what`.
pub(crate) fn try_vec_with<T>(
    len: usize,
    what: &str,
    element: impl FnMut(usize) -> T,
) -> Result<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(len)
        .map_err(|_| refused::<T>(len, what))?;
    out.extend((0..len).map(element));
    Ok(out)
}

/// `len` zero elements from zeroed pages (untouched pages stay unbacked until written), or
/// `OutOfMemory` naming `what`.
pub(crate) fn try_zeroed_vec<T: Zeroable + Clone>(len: usize, what: &str) -> Result<Vec<T>> {
    bytemuck::try_zeroed_vec(len).map_err(|_| refused::<T>(len, what))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_the_allocator_refuses_is_an_error_not_an_abort() {
        let huge = usize::MAX / 8;
        assert!(matches!(
            try_zeroed_vec::<u64>(huge, "test"),
            Err(Error::OutOfMemory(_))
        ));
        assert!(matches!(
            try_vec_with(huge, "test", |i| i as u64),
            Err(Error::OutOfMemory(_))
        ));
        assert_eq!(try_vec_with(3, "test", |i| i * 2).unwrap(), vec![0, 2, 4]);
        assert_eq!(try_zeroed_vec::<u32>(2, "test").unwrap(), vec![0, 0]);
    }
}
