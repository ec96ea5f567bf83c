//! Storage element types of the KV cache. K/V are stored as f32, f16 or bf16; every computation
//! converts to f32 on load and accumulates in f32.

use half::{bf16, f16};

use crate::error::{Error, Result};

/// Storage type of a KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    F16,
    Bf16,
}

impl KvDtype {
    /// Bytes per stored element.
    pub fn size_of(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    /// The largest finite magnitude this type stores (65504 for f16).
    pub fn max_finite(self) -> f32 {
        match self {
            KvDtype::F32 => f32::MAX,
            KvDtype::F16 => f16::MAX.to_f32(),
            KvDtype::Bf16 => bf16::MAX.to_f32(),
        }
    }

    /// The smallest magnitude this type stores as infinity: f32 inputs at or beyond it (and NaN)
    /// are not stored as finite numbers. f16 and bf16 round to nearest even, and their largest
    /// finite value has an odd mantissa, so the halfway point above it already rounds to infinity.
    pub fn overflow_threshold(self) -> f32 {
        match self {
            KvDtype::F32 => f32::INFINITY,
            KvDtype::F16 => 65520.0,
            KvDtype::Bf16 => f32::from_bits(0x7f7f_8000),
        }
    }

    /// The conventional lower-case name ("float32", "float16", "bfloat16").
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "float32",
            KvDtype::F16 => "float16",
            KvDtype::Bf16 => "bfloat16",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = Error;

    fn from_str(name: &str) -> Result<Self> {
        match name {
            "float32" | "f32" | "fp32" => Ok(KvDtype::F32),
            "float16" | "f16" | "fp16" | "half" => Ok(KvDtype::F16),
            "bfloat16" | "bf16" => Ok(KvDtype::Bf16),
            other => Err(Error::InvalidArgument(format!(
                "unknown dtype {other:?}; expected float32, float16 or bfloat16"
            ))),
        }
    }
}

/// An element type the KV cache can store.
pub trait KvElement: bytemuck::Pod + Default + Send + Sync + 'static {
    const DTYPE: KvDtype;
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl KvElement for f32 {
    const DTYPE: KvDtype = KvDtype::F32;
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvElement for f16 {
    const DTYPE: KvDtype = KvDtype::F16;
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl KvElement for bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The threshold is where the conversion itself starts giving infinity.
    #[test]
    fn overflow_threshold_is_the_first_value_converted_to_infinity() {
        fn check<T: KvElement>() {
            let threshold = T::DTYPE.overflow_threshold();
            let below = f32::from_bits(threshold.to_bits() - 1);
            assert!(
                T::from_f32(threshold).to_f32().is_infinite(),
                "{:?}",
                T::DTYPE
            );
            assert_eq!(
                T::from_f32(below).to_f32(),
                T::DTYPE.max_finite(),
                "{:?}",
                T::DTYPE
            );
        }
        check::<f16>();
        check::<bf16>();
        assert_eq!(KvDtype::F32.overflow_threshold(), f32::INFINITY);
    }
}
