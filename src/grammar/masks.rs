//! The allowed-token masks of a step's constrained rows, computed on the worker pool while the
//! caller goes on (the forward pass): [`PendingMasks::start`], then [`PendingMasks::wait`].
//!
//! Invariants:
//! - One job per batch is spawned on the shared pool (`compute::cpu::pool`); its rows run in
//!   parallel there. The pool's threads take it up whenever a kernel of the forward pass leaves
//!   them idle, so the masks cost the step little wall time; `wait` blocks only for what is left.
//! - Every row ends with a mask or its own error: a grammar that fails, or panics, fails that row
//!   alone (its mask all zero, its error set). `wait` fails as a whole only if the job could not
//!   run at all.
//! - Each matcher is locked while its mask is computed; the caller advances it only after `wait`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rayon::prelude::*;

use super::Matcher;
use crate::compute::cpu::pool::pool;
use crate::error::{Error, Result};

/// A matcher shared between its sequence and the mask jobs of its steps.
pub type SharedMatcher = Arc<Mutex<Matcher>>;

/// The masks of a batch of rows: `words` u32 per row, row after row, and each row's error.
pub struct Masks {
    /// Words per row (`⌈vocabulary / 32⌉`).
    pub words: usize,
    /// `rows × words` bits: bit `t % 32` of word `t / 32` of a row set when token `t` may come.
    pub bits: Vec<u32>,
    /// `Some(why)` for a row whose grammar failed (its mask is all zero).
    pub errors: Vec<Option<String>>,
    /// Seconds spent computing the rows' masks, summed over rows (their cost in CPU time). Not the
    /// job's span: its rows interleave on the pool with the forward pass's work, and the span at
    /// batch 16 measured 25-38 ms for ~1 ms of masks.
    pub seconds: f64,
}

/// Masks being computed on the pool.
pub struct PendingMasks {
    receiver: Receiver<Masks>,
}

impl PendingMasks {
    /// Starts computing each matcher's mask. The matchers must share one vocabulary size.
    pub fn start(matchers: Vec<SharedMatcher>) -> Result<Self> {
        let sizes: Vec<usize> = matchers.iter().map(|m| lock(m).len()).collect();
        let size = sizes.first().copied().unwrap_or(0);
        if sizes.iter().any(|&s| s != size) {
            return Err(Error::Shape(format!(
                "matchers of one batch must share a vocabulary, got sizes {sizes:?}"
            )));
        }
        let words = size.div_ceil(32);
        let (sender, receiver) = channel();
        pool()?.spawn(move || {
            let rows: Vec<(Vec<u32>, Option<String>, f64)> = matchers
                .par_iter()
                .map(|matcher| row_mask(matcher, words))
                .collect();
            let mut masks = Masks {
                words,
                bits: Vec::with_capacity(rows.len() * words),
                errors: Vec::with_capacity(rows.len()),
                seconds: 0.0,
            };
            for (bits, error, seconds) in rows {
                masks.bits.extend_from_slice(&bits);
                masks.errors.push(error);
                masks.seconds += seconds;
            }
            let _ = sender.send(masks); // the caller may have stopped waiting: nothing to do then
        });
        Ok(PendingMasks { receiver })
    }

    /// Blocks until every row's mask is ready.
    pub fn wait(self) -> Result<Masks> {
        self.receiver
            .recv()
            .map_err(|_| Error::Internal("the grammar mask job ended without its masks".into()))
    }
}

/// One row's mask, or an all-zero mask and why, and the seconds it took. A panic inside the
/// grammar is caught here: unwinding out of a job spawned on the pool would abort the process.
fn row_mask(matcher: &SharedMatcher, words: usize) -> (Vec<u32>, Option<String>, f64) {
    let started = Instant::now();
    let mut bits = vec![0u32; words];
    let outcome = catch_unwind(AssertUnwindSafe(|| lock(matcher).allowed(&mut bits)));
    let error = match outcome {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some("the grammar panicked computing its mask".into()),
    };
    if error.is_some() {
        bits.fill(0);
    }
    (bits, error, started.elapsed().as_secs_f64())
}

/// A matcher's lock; one a panic poisoned is still a whole matcher (a panic leaves a row failed,
/// and its request is ended by the caller).
fn lock(matcher: &SharedMatcher) -> std::sync::MutexGuard<'_, Matcher> {
    matcher.lock().unwrap_or_else(|e| e.into_inner())
}
