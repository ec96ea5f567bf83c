//! Arithmetic over the cache and the weights: [`attention`] (paged attention, its thread pool and
//! machine probes), [`linear`] (packed-panel matrix products on that pool), [`sampling`].

pub mod attention;
pub mod linear;
pub mod sampling;
