//! GGUF's block formats as the quantized kernels read them: each block of a row decodes into
//! sub-blocks of 32 quants, each with a scale and a min per half.
//!
//! Invariants:
//! - A block holds [`Format::ELEMS`] weights (32, or 256 for the K-quants) in [`Format::BYTES`]
//!   bytes, laid out exactly as ggml writes them; rows are whole blocks and are never repacked.
//! - Sub-block `j` of a block is its weights `32j .. 32j + 32` in order. Weight `i` of it is
//!   `scale[h] · (q[i] − ZERO) + min[h]` with `h = i / 16` (`q` read as `i8` when `SIGNED`). Every
//!   format but Q6_K has one scale per sub-block (both halves equal); every format without a min
//!   has `min = 0` and its weight is `scale · (q − ZERO)`, computed so.
//! - [`dequantize`] is bit-exact with ggml's `dequantize_row_*` (and `gguf.quants`): each value is
//!   the same f32 operations in the same order on the same operands.
//! - The `avx2` quants of a sub-block equal the portable ones byte for byte (tested).

/// A GGUF quantization format whose rows the kernels read as shipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// 32 weights: an f16 scale and 32 signed bytes.
    Q8_0,
    /// 32 weights: an f16 scale and 32 nibbles, minus 8.
    Q4_0,
    /// 32 weights: an f16 scale, an f16 min and 32 nibbles.
    Q4_1,
    /// 32 weights: an f16 scale and 32 five-bit quants (nibbles and a word of high bits), minus 16.
    Q5_0,
    /// 256 weights: f16 super-scale and super-min, eight 6-bit scales and mins, 256 nibbles.
    Q4K,
    /// 256 weights: 256 six-bit quants (nibbles and 2-bit pairs) minus 32, sixteen i8 scales, an
    /// f16 super-scale.
    Q6K,
}

impl QuantFormat {
    /// Every format.
    pub const ALL: [QuantFormat; 6] = [
        QuantFormat::Q8_0,
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q5_0,
        QuantFormat::Q4K,
        QuantFormat::Q6K,
    ];

    /// GGUF's name in lower case: "q8_0", "q4_0", "q4_1", "q5_0", "q4_k" or "q6_k".
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::Q4_0 => "q4_0",
            QuantFormat::Q4_1 => "q4_1",
            QuantFormat::Q5_0 => "q5_0",
            QuantFormat::Q4K => "q4_k",
            QuantFormat::Q6K => "q6_k",
        }
    }

    /// Weights per block.
    pub fn block_elems(self) -> usize {
        match self {
            QuantFormat::Q4K | QuantFormat::Q6K => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q8_0 => Q8_0::BYTES,
            QuantFormat::Q4_0 => Q4_0::BYTES,
            QuantFormat::Q4_1 => Q4_1::BYTES,
            QuantFormat::Q5_0 => Q5_0::BYTES,
            QuantFormat::Q4K => Q4K::BYTES,
            QuantFormat::Q6K => Q6K::BYTES,
        }
    }
}

impl std::str::FromStr for QuantFormat {
    type Err = crate::error::Error;

    fn from_str(name: &str) -> crate::error::Result<Self> {
        let lower = name.to_ascii_lowercase();
        QuantFormat::ALL
            .into_iter()
            .find(|f| f.name() == lower)
            .ok_or_else(|| {
                crate::error::Error::InvalidArgument(format!(
                    "unknown quantized format {name:?}; expected one of q8_0, q4_0, q4_1, q5_0, q4_k, q6_k"
                ))
            })
    }
}

/// The scales and mins of one sub-block's two halves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Scales {
    pub(crate) scale: [f32; 2],
    pub(crate) min: [f32; 2],
}

/// One format's block layout and decoding.
pub(crate) trait Format {
    /// Bytes per block.
    const BYTES: usize;
    /// Sub-blocks of 32 per block.
    const SUBS: usize = 1;
    /// Subtracted from every quant before scaling.
    const ZERO: i32 = 0;
    /// The quants are signed bytes (Q8_0).
    const SIGNED: bool = false;
    /// The format adds a min (Q4_1, Q4_K).
    const HAS_MIN: bool = false;
    /// The two halves of a sub-block have their own scale (Q6_K).
    const SPLIT: bool = false;
    /// What a block's header decodes to once for all its sub-blocks.
    type Header: Copy;

    /// The header of `block` (`BYTES` long).
    unsafe fn header<H: Half>(block: &[u8]) -> Self::Header;

    /// Sub-block `j`'s scales.
    fn scales(header: &Self::Header, j: usize) -> Scales;

    /// Sub-block `j`'s 32 quants, in weight order.
    fn quants(block: &[u8], j: usize) -> [u8; 32];

    /// [`Format::quants`] in one AVX2 register.
    ///
    /// # Safety
    /// The CPU has AVX2; `block` points at `BYTES` readable bytes.
    #[cfg(target_arch = "x86_64")]
    unsafe fn quants_avx2(block: *const u8, j: usize) -> std::arch::x86_64::__m256i;
}

/// How a path turns a block's f16 scales into f32 (exactly, both ways).
pub(crate) trait Half {
    /// `bits` as f32.
    ///
    /// # Safety
    /// The CPU has what the implementation uses.
    unsafe fn to_f32(bits: u16) -> f32;
}

/// The portable conversion, inlined and branch-free: `half`'s own is an outlined call that
/// detects F16C each time, and with it the Q4_1 header took a fifth of a decode product's time
/// (perf).
pub(crate) struct SoftHalf;

impl Half for SoftHalf {
    #[inline(always)]
    unsafe fn to_f32(bits: u16) -> f32 {
        let bits = u32::from(bits);
        // The exponent and mantissa moved into f32's places, then scaled by 2^112 (f32's bias
        // minus f16's): exact for normal and subnormal values alike, as a power of two.
        let magnitude = f32::from_bits((bits & 0x7FFF) << 13) * f32::from_bits(0x7780_0000);
        let magnitude = if bits & 0x7C00 == 0x7C00 {
            f32::from_bits(0x7F80_0000 | ((bits & 0x03FF) << 13)) // infinity or NaN
        } else {
            magnitude
        };
        f32::from_bits(magnitude.to_bits() | ((bits & 0x8000) << 16))
    }
}

/// F16C's conversion (`vcvtph2ps`): the software one was the largest scalar cost per block left
/// in the SIMD paths.
#[cfg(target_arch = "x86_64")]
pub(crate) struct F16c;

#[cfg(target_arch = "x86_64")]
impl Half for F16c {
    #[inline(always)]
    unsafe fn to_f32(bits: u16) -> f32 {
        // In assembly because every intrinsic form (`_mm_cvtsi32_si128`, `_mm_set1_epi16`)
        // became a `vpinsrw` into whatever register was at hand, which was the offsets'
        // accumulator: every block's conversion then waited for the previous block's sum
        // (perf: the decode product ran at a quarter of its speed). `vmovd` from a general
        // register zeroes the rest of the vector, so it depends on nothing.
        let value: f32;
        std::arch::asm!(
            "vmovd {v}, {bits:e}",
            "vcvtph2ps {v}, {v}",
            bits = in(reg) u32::from(bits),
            v = lateout(xmm_reg) value,
            options(pure, nomem, nostack, preserves_flags),
        );
        value
    }
}

/// The f16 at byte `at` of `block` as f32.
#[inline(always)]
unsafe fn f16_at<H: Half>(block: &[u8], at: usize) -> f32 {
    H::to_f32(u16::from_le_bytes([block[at], block[at + 1]]))
}

/// Low nibbles of 16 bytes then their high nibbles: the order of Q4_0, Q4_1 and Q5_0.
#[inline(always)]
fn nibbles16(qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for i in 0..16 {
        q[i] = qs[i] & 0x0F;
        q[i + 16] = qs[i] >> 4;
    }
    q
}

/// One scale for both halves, no min.
#[inline(always)]
fn plain(scale: f32) -> Scales {
    Scales {
        scale: [scale; 2],
        min: [0.0; 2],
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// The low nibbles of 16 bytes at `qs`, then their high nibbles.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn nibbles16(qs: *const u8) -> __m256i {
        let x = _mm_loadu_si128(qs.cast());
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(x, mask);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(x), mask);
        _mm256_set_m128i(hi, lo)
    }

    /// The low (`high == false`) or high nibbles of 32 bytes at `qs`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn nibbles32(qs: *const u8, high: bool) -> __m256i {
        let x = _mm256_loadu_si256(qs.cast());
        let x = if high { _mm256_srli_epi16::<4>(x) } else { x };
        _mm256_and_si256(x, _mm256_set1_epi8(0x0F))
    }

    /// Byte `i` is `value` where bit `i` of `bits` is set, else 0.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bits_to_bytes(bits: u32, value: i8) -> __m256i {
        let word = _mm256_set1_epi32(bits as i32);
        // Byte i takes byte i / 8 of the word (each 128-bit lane holds all four).
        let spread = _mm256_shuffle_epi8(
            word,
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(value))
    }
}

/// The header of a format whose block starts with its one f16 scale and has no min (Q8_0,
/// Q4_0, Q5_0): that scale, for both halves of its one sub-block.
macro_rules! one_scale_first {
    () => {
        type Header = f32;

        #[inline(always)]
        unsafe fn header<H: Half>(block: &[u8]) -> f32 {
            f16_at::<H>(block, 0)
        }
        #[inline(always)]
        fn scales(d: &f32, _: usize) -> Scales {
            plain(*d)
        }
    };
}

/// Q8_0: `d` (f16), then `qs[32]` (i8). Weight `i` = `d · qs[i]`.
pub(crate) struct Q8_0;

impl Format for Q8_0 {
    const BYTES: usize = 34;
    const SIGNED: bool = true;
    one_scale_first!();
    fn quants(block: &[u8], _: usize) -> [u8; 32] {
        block[2..34]
            .try_into()
            .expect("a Q8_0 block holds 32 quants")
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quants_avx2(block: *const u8, _: usize) -> std::arch::x86_64::__m256i {
        std::arch::x86_64::_mm256_loadu_si256(block.add(2).cast())
    }
}

/// Q4_0: `d` (f16), then `qs[16]`. Weight `i < 16` = `d · (low nibble of qs[i] − 8)`, weight
/// `i + 16` the high nibble's.
pub(crate) struct Q4_0;

impl Format for Q4_0 {
    const BYTES: usize = 18;
    const ZERO: i32 = 8;
    one_scale_first!();
    fn quants(block: &[u8], _: usize) -> [u8; 32] {
        nibbles16(&block[2..18])
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quants_avx2(block: *const u8, _: usize) -> std::arch::x86_64::__m256i {
        avx2::nibbles16(block.add(2))
    }
}

/// Q4_1: `d`, `m` (f16), then `qs[16]`. Weight = `d · q + m`, `q` ordered as Q4_0's.
pub(crate) struct Q4_1;

impl Format for Q4_1 {
    const BYTES: usize = 20;
    const HAS_MIN: bool = true;
    type Header = Scales;

    #[inline(always)]
    unsafe fn header<H: Half>(block: &[u8]) -> Scales {
        Scales {
            scale: [f16_at::<H>(block, 0); 2],
            min: [f16_at::<H>(block, 2); 2],
        }
    }
    #[inline(always)]
    fn scales(header: &Scales, _: usize) -> Scales {
        *header
    }
    fn quants(block: &[u8], _: usize) -> [u8; 32] {
        nibbles16(&block[4..20])
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quants_avx2(block: *const u8, _: usize) -> std::arch::x86_64::__m256i {
        avx2::nibbles16(block.add(4))
    }
}

/// Q5_0: `d` (f16), `qh` (u32: bit `i` is weight `i`'s fifth bit), `qs[16]` (nibbles as Q4_0's).
/// Weight = `d · (q − 16)`.
pub(crate) struct Q5_0;

impl Format for Q5_0 {
    const BYTES: usize = 22;
    const ZERO: i32 = 16;
    one_scale_first!();
    fn quants(block: &[u8], _: usize) -> [u8; 32] {
        let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        let mut q = nibbles16(&block[6..22]);
        for (i, quant) in q.iter_mut().enumerate() {
            *quant |= (((qh >> i) & 1) as u8) << 4;
        }
        q
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quants_avx2(block: *const u8, _: usize) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::_mm256_or_si256;
        let qh = u32::from_le_bytes(block.add(2).cast::<[u8; 4]>().read_unaligned());
        _mm256_or_si256(avx2::nibbles16(block.add(6)), avx2::bits_to_bytes(qh, 0x10))
    }
}

/// Q4_K: `d`, `dmin` (f16), `scales[12]` (eight 6-bit scales and eight 6-bit mins), `qs[128]`.
/// Sub-block `j` reads the low (even `j`) or high (odd `j`) nibbles of `qs[32·(j/2) ..][..32]`;
/// its weight = `(d · sc_j) · q − dmin · m_j`.
pub(crate) struct Q4K;

impl Format for Q4K {
    const BYTES: usize = 144;
    const SUBS: usize = 8;
    const HAS_MIN: bool = true;
    type Header = [Scales; 8];

    unsafe fn header<H: Half>(block: &[u8]) -> [Scales; 8] {
        let (d, dmin) = (f16_at::<H>(block, 0), f16_at::<H>(block, 2));
        let s = &block[4..16];
        std::array::from_fn(|j| {
            // ggml's get_scale_min_k4: the first four pairs are the low 6 bits of bytes 0..8,
            // the last four are nibbles of bytes 8..12 topped by the spare 2 bits of bytes 0..8.
            let (sc, m) = if j < 4 {
                (s[j] & 63, s[j + 4] & 63)
            } else {
                (
                    (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
                    (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                )
            };
            Scales {
                scale: [d * f32::from(sc); 2],
                min: [-(dmin * f32::from(m)); 2],
            }
        })
    }
    #[inline(always)]
    fn scales(header: &[Scales; 8], j: usize) -> Scales {
        header[j]
    }
    fn quants(block: &[u8], j: usize) -> [u8; 32] {
        let qs = &block[16 + 32 * (j / 2)..][..32];
        std::array::from_fn(|i| {
            if j.is_multiple_of(2) {
                qs[i] & 0x0F
            } else {
                qs[i] >> 4
            }
        })
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quants_avx2(block: *const u8, j: usize) -> std::arch::x86_64::__m256i {
        avx2::nibbles32(block.add(16 + 32 * (j / 2)), j % 2 == 1)
    }
}

/// Q6_K: `ql[128]` (low nibbles), `qh[64]` (2-bit pairs), `scales[16]` (i8, one per 16 weights),
/// `d` (f16). Sub-block `j = 4n + s` reads the low (`s < 2`) or high nibbles of
/// `ql[64n + 32·(s % 2) ..][..32]` and bits `2s, 2s + 1` of `qh[32n ..][..32]`; its halves' scales
/// are `d · scales[8n + 2s + h]`, and weight = `scale · (q − 32)`.
pub(crate) struct Q6K;

impl Format for Q6K {
    const BYTES: usize = 210;
    const SUBS: usize = 8;
    const ZERO: i32 = 32;
    const SPLIT: bool = true;
    type Header = [f32; 16];

    unsafe fn header<H: Half>(block: &[u8]) -> [f32; 16] {
        let d = f16_at::<H>(block, 208);
        std::array::from_fn(|i| d * f32::from(block[192 + i] as i8))
    }
    #[inline(always)]
    fn scales(header: &[f32; 16], j: usize) -> Scales {
        let (n, s) = (j / 4, j % 4);
        let at = 8 * n + 2 * s;
        Scales {
            scale: [header[at], header[at + 1]],
            min: [0.0; 2],
        }
    }
    fn quants(block: &[u8], j: usize) -> [u8; 32] {
        let (n, s) = (j / 4, j % 4);
        let ql = &block[64 * n + 32 * (s % 2)..][..32];
        let qh = &block[128 + 32 * n..][..32];
        std::array::from_fn(|i| {
            let low = if s < 2 { ql[i] & 0x0F } else { ql[i] >> 4 };
            low | (((qh[i] >> (2 * s)) & 3) << 4)
        })
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quants_avx2(block: *const u8, j: usize) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let (n, s) = (j / 4, j % 4);
        let low = avx2::nibbles32(block.add(64 * n + 32 * (s % 2)), s >= 2);
        let qh = _mm256_loadu_si256(block.add(128 + 32 * n).cast());
        // A 16-bit shift carries the next byte's bits into each byte's top; the mask keeps the
        // byte's own two bits, and moving them up by 4 stays inside the byte (≤ 0x30).
        let pair = _mm256_and_si256(
            _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * s as i32)),
            _mm256_set1_epi8(3),
        );
        _mm256_or_si256(low, _mm256_slli_epi16::<4>(pair))
    }
}

/// One weight from its quant and sub-block scales, as ggml computes it.
#[inline(always)]
pub(crate) fn weight<F: Format>(q: u8, scales: &Scales, half: usize) -> f32 {
    let q = if F::SIGNED {
        i32::from(q as i8)
    } else {
        i32::from(q)
    };
    if F::HAS_MIN {
        scales.scale[half] * q as f32 + scales.min[half]
    } else {
        scales.scale[half] * (q - F::ZERO) as f32
    }
}

/// Row `row` (whole blocks of `F`) as f32 into `out` (`blocks · ELEMS` long).
pub(crate) fn dequantize<F: Format>(row: &[u8], out: &mut [f32]) {
    for (block, out) in row
        .chunks_exact(F::BYTES)
        .zip(out.chunks_exact_mut(32 * F::SUBS))
    {
        // SAFETY: the software conversion runs everywhere.
        let header = unsafe { F::header::<SoftHalf>(block) };
        for (j, out) in out.chunks_exact_mut(32).enumerate() {
            let scales = F::scales(&header, j);
            for (i, (value, &q)) in out.iter_mut().zip(&F::quants(block, j)).enumerate() {
                *value = weight::<F>(q, &scales, i / 16);
            }
        }
    }
}
