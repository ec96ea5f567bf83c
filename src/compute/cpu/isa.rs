//! The instruction sets the compute kernels are written for, detected once for every kernel
//! family (attention, linear): one type, one environment override.
//!
//! Invariants:
//! - A kernel runs on an [`Isa`] only when [`Isa::available`] says this CPU has its features:
//!   that is the safety contract of every `#[target_feature]` function behind it.
//! - A family implements a subset of the sets (attention: AVX-512, AVX2 and portable; dense linear: AVX-512,
//!   AVX2 and portable; quantized linear: AVX-512 VNNI, AVX2 and portable);
//!   its default is the best set it implements that the CPU has, at most [`ceiling`].
//! - [`ceiling`] is `PAGEDKV_ISA` (a name below) when set, valid and available, else the best set
//!   this CPU has; read once. Tests and benchmarks use it to force every family down a path;
//!   a kernel given an explicit set by its caller ignores it.

use std::sync::OnceLock;

use crate::error::{Error, Result};

/// Environment variable capping the instruction set every kernel family uses by default.
pub const ISA_ENV: &str = "PAGEDKV_ISA";

/// An instruction set a kernel may be written for, ordered by capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust the compiler vectorises for the baseline target; runs everywhere.
    Portable,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512F (with AVX2 + FMA + F16C).
    Avx512,
    /// x86-64 AVX-512F, BW and VL with VNNI (`vpdpbusd`, an 8-bit dot product into 32-bit sums)
    /// (Ice Lake, Zen 4 and later): what the quantized-weight kernels need beyond AVX-512F.
    Avx512Vnni,
    /// [`Isa::Avx512Vnni`] with AVX512-BF16 (`vdpbf16ps`, a dot product of bf16 pairs into f32
    /// sums) (Cooper Lake, Sapphire Rapids, Zen 4 and later): the dense linear tiles of prompts.
    Avx512Bf16,
}

impl Isa {
    /// Every set, best first.
    pub const ALL: [Isa; 5] = [
        Isa::Avx512Bf16,
        Isa::Avx512Vnni,
        Isa::Avx512,
        Isa::Avx2,
        Isa::Portable,
    ];

    /// Whether this CPU has the set's features.
    pub fn available(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f") && Isa::Avx2.available(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx512.available()
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Bf16 => {
                Isa::Avx512Vnni.available() && is_x86_feature_detected!("avx512bf16")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The best set this CPU has.
    pub fn best() -> Isa {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.available())
            .unwrap_or(Isa::Portable)
    }

    /// Lower-case name: "avx512bf16", "avx512vnni", "avx512", "avx2" or "portable".
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Avx512Vnni => "avx512vnni",
            Isa::Avx512Bf16 => "avx512bf16",
        }
    }

    /// The sets of `implemented` this CPU has, best first.
    pub fn available_of(implemented: &[Isa]) -> Vec<Isa> {
        let mut out: Vec<Isa> = implemented
            .iter()
            .copied()
            .filter(|i| i.available())
            .collect();
        out.sort_by(|a, b| b.cmp(a));
        out
    }

    /// The default of a family implementing `implemented` (which holds `Portable`): its best set
    /// this CPU has, at most [`ceiling`].
    pub fn default_of(implemented: &[Isa]) -> Isa {
        // Every kernel call asks: no allocation (`available_of` would make a Vec).
        implemented
            .iter()
            .copied()
            .filter(|&isa| isa <= ceiling() && isa.available())
            .max()
            .unwrap_or(Isa::Portable)
    }

    /// `Ok` when a family implementing `implemented` can run on `self` on this CPU, else
    /// `InvalidArgument` naming `family`.
    pub fn check_for(self, family: &str, implemented: &[Isa]) -> Result<()> {
        if !implemented.contains(&self) {
            return Err(Error::InvalidArgument(format!(
                "{family} has no {} kernel (it has {})",
                self.name(),
                implemented
                    .iter()
                    .map(|i| i.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        if !self.available() {
            return Err(Error::InvalidArgument(format!(
                "the {} {family} kernel needs CPU features this machine lacks",
                self.name()
            )));
        }
        Ok(())
    }
}

impl std::str::FromStr for Isa {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self> {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name() == name)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown instruction set {name:?}; expected avx512bf16, avx512vnni, avx512, avx2 or portable"
                ))
            })
    }
}

/// The most capable set kernels use by default: `PAGEDKV_ISA` if set, valid and available, else
/// the best this CPU has (read once).
pub fn ceiling() -> Isa {
    static CEILING: OnceLock<Isa> = OnceLock::new();
    *CEILING.get_or_init(|| {
        std::env::var(ISA_ENV)
            .ok()
            .and_then(|name| name.parse::<Isa>().ok())
            .filter(|isa| isa.available())
            .unwrap_or_else(Isa::best)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_the_order_is_by_capability() {
        for isa in Isa::ALL {
            assert_eq!(isa.name().parse::<Isa>().unwrap(), isa);
        }
        assert!("sse".parse::<Isa>().is_err());
        assert!(
            Isa::Portable < Isa::Avx2
                && Isa::Avx2 < Isa::Avx512
                && Isa::Avx512 < Isa::Avx512Vnni
                && Isa::Avx512Vnni < Isa::Avx512Bf16
        );
        assert!(Isa::Portable.available() && Isa::best().available());
    }

    #[test]
    fn a_family_defaults_to_its_best_set_under_the_ceiling() {
        let only_portable = [Isa::Portable];
        assert_eq!(Isa::default_of(&only_portable), Isa::Portable);
        let attention = [Isa::Avx2, Isa::Portable]; // a family without AVX-512
        let expected = Isa::available_of(&attention)
            .into_iter()
            .find(|&i| i <= ceiling())
            .unwrap();
        assert_eq!(Isa::default_of(&attention), expected);
        assert!(Isa::default_of(&Isa::ALL) <= ceiling());
        assert!(Isa::Avx512.check_for("attention", &attention).is_err());
        assert!(Isa::Portable.check_for("attention", &attention).is_ok());
        assert_eq!(Isa::available_of(&attention).last(), Some(&Isa::Portable));
    }
}
