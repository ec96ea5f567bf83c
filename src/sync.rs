//! Synchronisation the rest of the core is written against.
//!
//! - The atomics of the lock-free parts: `std` normally, `loom` under `--cfg loom`, so the same
//!   code is model-checked by loom and run for real everywhere else.
//! - `run_locked` / `run_guarded`, how an outside caller (the Python binding) runs an operation:
//!   a panic is caught and returned as `Failure::Panicked`, never unwound into the caller, and it
//!   leaves the mutex poisoned, so every later `run_locked` on it is `Failure::Poisoned` instead of
//!   an operation on state the panic may have left half-changed. (`AssertUnwindSafe` is sound for
//!   that reason: the only state a panic can break is behind a mutex it poisons.)

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

#[cfg(feature = "python")]
pub(crate) use guarded::{run_guarded, run_locked, Failure};

#[cfg(any(feature = "python", test))]
mod guarded {
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::Mutex;

    /// Why an operation did not run to completion.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) enum Failure {
        /// It panicked, with this message.
        Panicked(String),
        /// An earlier operation on the same state panicked.
        Poisoned,
    }

    /// Runs `f`, returning a panic as `Failure::Panicked`.
    pub(crate) fn run_guarded<T>(f: impl FnOnce() -> T) -> Result<T, Failure> {
        catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Failure::Panicked(message)
        })
    }

    /// Locks `mutex` and runs `operation` on its state. The guard is dropped while unwinding, which
    /// poisons the mutex, before the panic is caught.
    pub(crate) fn run_locked<S, T>(
        mutex: &Mutex<S>,
        operation: impl FnOnce(&mut S) -> T,
    ) -> Result<T, Failure> {
        run_guarded(|| {
            let mut state = mutex.lock().map_err(|_| Failure::Poisoned)?;
            Ok(operation(&mut state))
        })?
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn a_panic_is_returned_and_its_half_changed_state_is_never_used_again() {
            let state = Mutex::new(vec![1]);
            let panicked = run_locked(&state, |v| {
                v.push(2); // half of an update...
                panic!("midway");
            });
            assert_eq!(panicked, Err::<(), _>(Failure::Panicked("midway".into())));
            // ...which no later call sees (`into_inner` would have handed it out).
            assert_eq!(run_locked(&state, |v| v.len()), Err(Failure::Poisoned));
            assert_eq!(run_locked(&Mutex::new(3), |x| *x + 1), Ok(4));
            let message = run_guarded(|| -> () { panic!("{}", String::from("owned")) });
            assert_eq!(message, Err(Failure::Panicked("owned".into())));
        }
    }
}
