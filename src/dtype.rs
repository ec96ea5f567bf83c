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
