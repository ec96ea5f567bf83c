//! Storage element types of the KV cache and of linear weights. Values are stored as f32, f16 or
//! bf16; every computation converts to f32 on load ([`KvElement::to_f32`], or [`load8`] / [`load16`]
//! on the AVX2 / AVX-512 paths of the attention and linear kernels) and accumulates in f32.

use half::{bf16, f16};

use crate::error::{Error, Result};

/// Storage type of a KV cache; float32 unless asked (exact: the reference the others are
/// measured against).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    #[default]
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

/// Loads 8 elements at `p` as f32: f16 through F16C, bf16 by shifting into the high half
/// (exact: bf16 is the top half of an f32).
///
/// # Safety
/// The CPU has AVX2 and F16C; `p` points to 8 readable elements (no alignment needed).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn load8<T: KvElement>(p: *const T) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    match T::DTYPE {
        KvDtype::F32 => _mm256_loadu_ps(p.cast()),
        KvDtype::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
        KvDtype::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_loadu_si128(p.cast()),
        ))),
    }
}

/// Loads 16 elements at `p` as f32, as [`load8`] does 8.
///
/// # Safety
/// The CPU has AVX-512F; `p` points to 16 readable elements (no alignment needed).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn load16<T: KvElement>(p: *const T) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    match T::DTYPE {
        KvDtype::F32 => _mm512_loadu_ps(p.cast()),
        KvDtype::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
        KvDtype::Bf16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256(p.cast()),
        ))),
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

    /// The vector load converts every element as the scalar conversion does.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn load8_equals_the_scalar_conversion() {
        fn check<T: KvElement>() {
            let values: Vec<T> = (0..8)
                .map(|i| T::from_f32((i as f32 - 3.3) * 1.7e3))
                .collect();
            let mut out = [0.0f32; 8];
            // SAFETY: checked features; `values` holds 8 elements, `out` 8 floats.
            unsafe {
                std::arch::x86_64::_mm256_storeu_ps(out.as_mut_ptr(), load8(values.as_ptr()))
            };
            let expected: Vec<f32> = values.iter().map(|v| v.to_f32()).collect();
            assert_eq!(out.to_vec(), expected, "{:?}", T::DTYPE);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
            check::<f32>();
            check::<f16>();
            check::<bf16>();
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn load16_equals_the_scalar_conversion() {
        fn check<T: KvElement>() {
            let values: Vec<T> = (0..16)
                .map(|i| T::from_f32((i as f32 - 7.3) * 1.1e3))
                .collect();
            let mut out = [0.0f32; 16];
            // SAFETY: checked features; `values` holds 16 elements, `out` 16 floats.
            unsafe {
                std::arch::x86_64::_mm512_storeu_ps(out.as_mut_ptr(), load16(values.as_ptr()))
            };
            let expected: Vec<f32> = values.iter().map(|v| v.to_f32()).collect();
            assert_eq!(out.to_vec(), expected, "{:?}", T::DTYPE);
        }
        if is_x86_feature_detected!("avx512f") {
            check::<f32>();
            check::<f16>();
            check::<bf16>();
        }
    }
}
