//! The model in the core: a decoder's weights and its whole forward pass over a step
//! ([`Decoder`]), the row operations between its matrix products ([`ops`]), and what the pass
//! touches of the K/V ([`StepKv`]: a runtime's step or a cache of one's own).

mod decoder;
mod kv;
pub mod ops;

pub use decoder::{Decoder, DecoderConfig, Embedding, LayerWeights, Output};
pub use kv::{CacheStepKv, RuntimeStepKv, StepKv};
pub use ops::Activation;
