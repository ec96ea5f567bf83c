//! The Python binding, `pagedkv._core`: thin `#[pyclass]` shells over core types. Each method
//! converts its arguments with `args` (every refusal a typed error), runs the work through
//! `sync` (GIL released, except for µs calls that keep it; lock taken, panics and poisoned locks surfaced as `InternalError`), and
//! maps core errors to the classes of `pagedkv.errors` (`errors`). No scheduling or memory logic
//! lives here.

mod args;
mod attention;
mod attention_call;
mod block_manager;
mod decoder;
mod errors;
mod events;
mod grammar;
mod hashing;
mod kv_cache;
mod kv_spec;
mod linear;
mod prefix_index;
mod sampling;
mod scheduler;
mod sync;
mod tier;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::check_classes(m.py())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<block_manager::PyBlockManager>()?;
    m.add_class::<grammar::PyVocabulary>()?;
    m.add_class::<grammar::PyGrammar>()?;
    m.add_class::<grammar::PyGrammarMatcher>()?;
    m.add_class::<grammar::PyPendingMasks>()?;
    m.add_function(wrap_pyfunction!(grammar::start_masks, m)?)?;
    m.add_function(wrap_pyfunction!(grammar::py_prepared_json_schema, m)?)?;
    m.add_class::<kv_cache::PyKVCache>()?;
    m.add_class::<prefix_index::PyPrefixIndex>()?;
    m.add_class::<kv_spec::PyGroupSpec>()?;
    m.add_class::<kv_spec::PyKvSpec>()?;
    m.add_class::<kv_spec::PyLayerSpec>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<scheduler::PySchedulerOutput>()?;
    m.add_class::<scheduler::PyUpdateOutput>()?;
    m.add("SCHEDULER_DEFAULTS", scheduler::defaults(m.py())?)?;
    attention::register(m)?;
    events::register(m)?;
    hashing::register(m)?;
    decoder::register(m)?;
    linear::register(m)?;
    sampling::register(m)?;
    Ok(())
}
