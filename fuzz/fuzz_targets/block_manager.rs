//! Fuzz target: a `BlockManager` driven by an operation sequence decoded from the input, checked
//! against the reference model after every operation — the model and its driver are shared with
//! the property test (`tests/support/block_manager_reference.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/support/block_manager_reference.rs"]
#[allow(dead_code)] // `Input::from_chunks` is the property test's
mod reference;

fuzz_target!(|input: reference::Input| reference::run(&input));
