//! Arithmetic over the cache and the weights: [`cpu`] (instruction sets, the worker pool, vector
//! math, machine probes), [`attention`] (paged attention), [`linear`] (packed-panel matrix
//! products), [`sampling`]; all on the one pool, each dispatching on [`cpu::Isa`].

pub mod attention;
pub mod cpu;
pub mod linear;
pub mod sampling;
