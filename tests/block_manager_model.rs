//! Property test of the `BlockManager` against its reference model (the one the fuzz target runs:
//! `support/block_manager_reference.rs`): random pool and block sizes, prefix caching on or off,
//! and 20–60 operations each decoded from its own random bytes; every result, table, figure and
//! invariant compared after each operation, no block leaked at the end. 300 cases a run.

use proptest::collection::vec;
use proptest::prelude::*;

#[path = "support/block_manager_reference.rs"]
mod reference;

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn block_manager_matches_the_reference_model(
        num_blocks in any::<u8>(),
        block_size in any::<u8>(),
        prefix_caching in any::<bool>(),
        ops in vec(vec(any::<u8>(), 2..24), 20..60),
    ) {
        reference::run(&reference::Input::from_chunks(num_blocks, block_size, prefix_caching, &ops));
    }
}
