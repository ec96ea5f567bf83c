use half::f16;

use super::format::{self, Format};
use super::*;

/// A xorshift stream of bytes.
struct Bytes(u64);

impl Bytes {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn fill(&mut self, out: &mut [u8]) {
        for b in out {
            *b = (self.next() >> 32) as u8;
        }
    }

    /// A value in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Byte offsets of each format's f16 scales (random bytes there could be inf or NaN).
fn f16_fields(format: QuantFormat) -> &'static [usize] {
    match format {
        QuantFormat::Q8_0 | QuantFormat::Q4_0 | QuantFormat::Q5_0 => &[0],
        QuantFormat::Q4_1 | QuantFormat::Q4K => &[0, 2],
        QuantFormat::Q6K => &[208],
    }
}

/// `rows` random rows of `k` weights in `format`, with finite scales of about 1/64.
fn random_rows(format: QuantFormat, rows: usize, k: usize, seed: u64) -> Vec<u8> {
    let mut rng = Bytes(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let blocks = rows * k / format.block_elems();
    let mut bytes = vec![0u8; blocks * format.block_bytes()];
    rng.fill(&mut bytes);
    for block in bytes.chunks_exact_mut(format.block_bytes()) {
        for &at in f16_fields(format) {
            let value = f16::from_f32(rng.unit() / 64.0).to_le_bytes();
            block[at..at + 2].copy_from_slice(&value);
        }
    }
    bytes
}

fn dequantized(matrix: &QuantMatrix) -> Vec<f32> {
    let ids: Vec<usize> = (0..matrix.out_features()).collect();
    let mut w = vec![0.0; ids.len() * matrix.in_features()];
    matrix.dequantize_rows(&ids, &mut w).unwrap();
    w
}

#[test]
fn every_format_decodes_the_same_quants_with_avx2_as_portably() {
    if !Isa::Avx2.available() {
        return;
    }
    fn check<F: Format>(format: QuantFormat) {
        let bytes = random_rows(format, 8, format.block_elems(), 7);
        for block in bytes.chunks_exact(F::BYTES) {
            for j in 0..F::SUBS {
                let mut simd = [0u8; 32];
                // SAFETY: AVX2 is available (checked above); `block` holds BYTES bytes.
                unsafe {
                    let v = F::quants_avx2(block.as_ptr(), j);
                    std::arch::x86_64::_mm256_storeu_si256(simd.as_mut_ptr().cast(), v);
                }
                assert_eq!(simd, F::quants(block, j), "{format:?} sub-block {j}");
            }
        }
    }
    for format in QuantFormat::ALL {
        with_format!(format, F => check::<F>(format));
    }
}

#[test]
fn known_blocks_dequantize_as_ggml_defines_them() {
    // Q4_0: d = 0.5, byte i = i | (15 - i) << 4 → weight i = 0.5 (i − 8),
    // weight i + 16 = 0.5 (15 − i − 8).
    let mut block = f16::from_f32(0.5).to_le_bytes().to_vec();
    block.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
    let mut out = [0.0; 32];
    format::dequantize::<format::Q4_0>(&block, &mut out);
    for i in 0..16 {
        assert_eq!(out[i], 0.5 * (i as f32 - 8.0));
        assert_eq!(out[i + 16], 0.5 * (15.0 - i as f32 - 8.0));
    }
    // Q5_0: the same nibbles with every odd weight's fifth bit set.
    let mut block = f16::from_f32(0.25).to_le_bytes().to_vec();
    block.extend(0xAAAA_AAAAu32.to_le_bytes());
    block.extend((0..16u8).map(|i| i | ((15 - i) << 4)));
    format::dequantize::<format::Q5_0>(&block, &mut out);
    for (i, &value) in out.iter().enumerate() {
        let nibble = if i < 16 { i } else { 15 - (i - 16) } as f32;
        let high = if i % 2 == 1 { 16.0 } else { 0.0 };
        assert_eq!(value, 0.25 * (nibble + high - 16.0), "weight {i}");
    }
    // Q6_K: every quant 33 (low nibble 1, pair 2), scale i = i − 8, d = 2.
    let mut block = vec![0x11u8; 128];
    block.extend([0xAAu8; 64]);
    block.extend((0..16).map(|i| (i as i8 - 8) as u8));
    block.extend(f16::from_f32(2.0).to_le_bytes());
    let mut out = [0.0; 256];
    format::dequantize::<format::Q6K>(&block, &mut out);
    for (i, &value) in out.iter().enumerate() {
        // Weight 128n + 32s + l reads scale 8n + 2s + l/16.
        let (n, s, l) = (i / 128, i % 128 / 32, i % 32);
        let scale = (8 * n + 2 * s + l / 16) as f32 - 8.0;
        assert_eq!(value, 2.0 * scale, "weight {i}");
    }
}

/// `x · Wᵀ` in f64 over the dequantized weight, and the bound the activations' quantization
/// allows: `Σ_blocks (max |x_block| / 127) / 2 · Σ |w|`.
fn reference(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut y = vec![0.0f64; m * n];
    let mut bound = vec![0.0f64; m * n];
    for r in 0..m {
        for c in 0..n {
            for b in 0..k / 32 {
                let xs = &x[r * k + 32 * b..][..32];
                let ws = &w[c * k + 32 * b..][..32];
                let scale = xs.iter().fold(0.0f32, |a, v| a.max(v.abs())) / 127.0;
                for (a, b) in xs.iter().zip(ws) {
                    y[r * n + c] += f64::from(*a) * f64::from(*b);
                    bound[r * n + c] += f64::from(scale) / 2.0 * f64::from(b.abs());
                }
            }
        }
    }
    (y, bound)
}

#[test]
fn every_path_and_format_is_within_the_activation_rounding_of_the_f32_product() {
    let shapes = [
        (1, 1, 1),
        (1, 2, 37),
        (2, 1, 5),
        (3, 2, 9),
        (5, 1, 17),
        (8, 2, 3),
        (9, 1, 4),
        (17, 1, 6),
    ];
    for format in QuantFormat::ALL {
        for (case, &(m, blocks, n)) in shapes.iter().enumerate() {
            let k = blocks * format.block_elems();
            let seed = 11 + case as u64;
            let matrix =
                QuantMatrix::new(k, vec![(format, random_rows(format, n, k, seed))]).unwrap();
            let mut rng = Bytes(seed | 1);
            let x: Vec<f32> = (0..m * k).map(|_| rng.unit() * 3.0).collect();
            let (exact, bound) = reference(&x, &dequantized(&matrix), m, k, n);
            let mut portable = vec![f32::NAN; m * n];
            matrix
                .forward_with(Isa::Portable, &x, m, &mut portable)
                .unwrap();
            for isa in Isa::available_of(&ISAS) {
                let mut y = vec![f32::NAN; m * n];
                matrix.forward_with(isa, &x, m, &mut y).unwrap();
                for i in 0..m * n {
                    let error = (f64::from(y[i]) - exact[i]).abs();
                    // The f32 sums' own rounding: ~1e-6 of the terms' magnitude.
                    let slack = 1e-5 * (bound[i] * 254.0 / 3.0 + 1.0);
                    assert!(
                        error <= bound[i] + slack,
                        "{format:?} {isa:?} m={m} k={k} n={n} [{i}]: {} vs {} (bound {})",
                        y[i],
                        exact[i],
                        bound[i]
                    );
                    // The paths differ only in the order of the f32 additions.
                    let apart = (y[i] - portable[i]).abs();
                    assert!(
                        apart <= 1e-4 * (1.0 + portable[i].abs()),
                        "{format:?} {isa:?}: {} vs {}",
                        y[i],
                        portable[i]
                    );
                }
            }
        }
    }
}

#[test]
fn a_weight_of_several_formats_equals_its_segments_side_by_side() {
    let k = 256;
    let parts: Vec<(QuantFormat, Vec<u8>)> = [
        (QuantFormat::Q5_0, 5),
        (QuantFormat::Q8_0, 3),
        (QuantFormat::Q6K, 4),
    ]
    .iter()
    .enumerate()
    .map(|(i, &(format, rows))| (format, random_rows(format, rows, k, 40 + i as u64)))
    .collect();
    let fused = QuantMatrix::new(k, parts.clone()).unwrap();
    assert_eq!(fused.out_features(), 12);
    assert_eq!(
        fused.nbytes(),
        parts.iter().map(|p| p.1.len()).sum::<usize>()
    );
    let m = 3;
    let mut rng = Bytes(5);
    let x: Vec<f32> = (0..m * k).map(|_| rng.unit()).collect();
    let mut y = vec![0.0; m * 12];
    fused.forward(&x, m, &mut y).unwrap();
    let mut column = 0;
    for (format, bytes) in parts {
        let alone = QuantMatrix::new(k, vec![(format, bytes)]).unwrap();
        let n = alone.out_features();
        let mut part = vec![0.0; m * n];
        alone.forward(&x, m, &mut part).unwrap();
        for r in 0..m {
            assert_eq!(&y[r * 12 + column..][..n], &part[r * n..][..n]);
        }
        column += n;
    }
}

#[test]
fn bad_shapes_and_bytes_are_typed_errors() {
    let row = random_rows(QuantFormat::Q4_1, 1, 64, 1);
    assert!(matches!(QuantMatrix::new(64, vec![]), Err(Error::Shape(_))));
    assert!(matches!(
        QuantMatrix::new(0, vec![(QuantFormat::Q4_1, row.clone())]),
        Err(Error::Shape(_))
    ));
    // 48 weights are not whole blocks of 32; 256-weight formats need rows of 256.
    assert!(matches!(
        QuantMatrix::new(48, vec![(QuantFormat::Q4_1, row.clone())]),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        QuantMatrix::new(64, vec![(QuantFormat::Q4K, row.clone())]),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        QuantMatrix::new(64, vec![(QuantFormat::Q4_1, row[..39].to_vec())]),
        Err(Error::Shape(_))
    ));
    let matrix = QuantMatrix::new(64, vec![(QuantFormat::Q4_1, row)]).unwrap();
    let mut y = [0.0; 2];
    assert!(matches!(
        matrix.forward(&[0.0; 63], 1, &mut y[..1]),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        matrix.forward(&[0.0; 64], 1, &mut y),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        matrix.forward_with(Isa::Avx512, &[0.0; 64], 1, &mut y[..1]),
        Err(Error::InvalidArgument(_))
    ));
    let mut out = [0.0; 64];
    assert!(matches!(
        matrix.dequantize_rows(&[1], &mut out),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        matrix.dequantize_rows(&[0, 0], &mut out),
        Err(Error::Shape(_))
    ));
    assert!("q3_k".parse::<QuantFormat>().is_err());
    assert_eq!("Q4_K".parse::<QuantFormat>().unwrap(), QuantFormat::Q4K);
}

#[test]
fn every_f16_scale_converts_exactly() {
    use format::Half;
    let f16c = Isa::Avx2.available();
    for bits in 0..=u16::MAX {
        let theirs = f16::from_bits(bits).to_f32();
        // SAFETY: the software conversion runs everywhere; F16C only where AVX2 (with it) is.
        let ours = unsafe { format::SoftHalf::to_f32(bits) };
        assert!(
            ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
            "{bits:#06x}"
        );
        #[cfg(target_arch = "x86_64")]
        if f16c {
            let ours = unsafe { format::F16c::to_f32(bits) };
            assert!(
                ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()),
                "{bits:#06x}"
            );
        }
    }
}

#[test]
fn activations_round_to_nearest_even_like_ggml() {
    // max |x| = 127, so the scale is 1 and each value is its own quant, ties to even.
    let mut x = vec![0.0f32; 32];
    x[..8].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.49]);
    let acts = kernels::Activations::quantize(&x, 1, 32);
    let tile = acts.tiles()[0];
    assert_eq!(
        &acts.block(tile, 0, 0)[..8],
        &[127, 0, 2, 2, 0, -2, -2, 126]
    );
}

#[test]
fn a_nan_activation_reaches_the_outputs_and_huge_rows_are_refused() {
    let k = 64;
    let matrix = QuantMatrix::new(
        k,
        vec![(QuantFormat::Q4_1, random_rows(QuantFormat::Q4_1, 3, k, 2))],
    )
    .unwrap();
    let mut x = vec![0.5f32; 2 * k];
    x[40] = f32::NAN; // row 0, second block
    for isa in Isa::available_of(&ISAS) {
        let mut y = vec![0.0; 2 * 3];
        matrix.forward_with(isa, &x, 2, &mut y).unwrap();
        assert!(y[..3].iter().all(|v| v.is_nan()), "{isa:?}: {y:?}");
        assert!(y[3..].iter().all(|v| v.is_finite()), "{isa:?}: {y:?}");
    }
    let row = random_rows(QuantFormat::Q6K, 1, 256, 3);
    assert!(matches!(
        QuantMatrix::new(usize::MAX / 256 * 256, vec![(QuantFormat::Q6K, row)]),
        Err(Error::Shape(_))
    ));
}
