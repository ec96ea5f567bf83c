//! What the compute kernels know of the CPU, each fact once: the instruction sets ([`isa`]:
//! detected once, one environment override for every kernel family), the worker pool attention,
//! linear and sampling share ([`pool`]), vector math ([`vmath`]: the one `exp`) and the machine's
//! measured limits ([`probes`]).

pub mod isa;
pub mod pool;
pub mod probes;
pub mod vmath;

pub use isa::{ceiling, Isa, ISA_ENV};
pub(crate) use pool::pool;
pub use pool::{num_threads, set_num_threads, MAX_THREADS, NUM_THREADS_ENV};
pub use probes::{measure_fma_peak, measure_read_bandwidth, ReadProbe, MIN_PROBE_BYTES};
