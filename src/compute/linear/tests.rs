use super::*;

/// Deterministic values in [-1, 1).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// `x · W` in f64 over the weight as rounded to `dtype`.
fn reference(x: &[f32], w: &[f32], m: usize, k: usize, n: usize, dtype: KvDtype) -> Vec<f64> {
    let round = |v: f32| match dtype {
        KvDtype::F32 => v,
        KvDtype::F16 => f16::from_f32(v).to_f32(),
        KvDtype::Bf16 => bf16::from_f32(v).to_f32(),
    };
    let mut y = vec![0.0f64; m * n];
    for i in 0..m {
        for kk in 0..k {
            let xv = f64::from(x[i * k + kk]);
            for j in 0..n {
                y[i * n + j] += xv * f64::from(round(w[kk * n + j]));
            }
        }
    }
    y
}

const DTYPES: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16];

#[test]
fn every_kernel_and_dtype_matches_the_reference_on_odd_shapes() {
    let shapes = [
        (1, 1, 1),
        (1, 13, 17),
        (2, 7, 33),
        (3, 5, 64),
        (5, 19, 31),
        (7, 9, 129),
        (16, 33, 47),
        (17, 64, 160),
        (33, 3, 15),
        // Enough panels for whole groups of the widest M = 1 and M = 2 tiles, and a tail.
        (1, 37, 200),
        (2, 50, 100),
        (1, 5, 16 * 21),
    ];
    for kernel in Isa::available_of(&ISAS) {
        for dtype in DTYPES {
            for &(m, k, n) in &shapes {
                let x = values(m * k, 1 + m as u64);
                let w = values(k * n, 2 + n as u64);
                let linear = Linear::new(&w, k, n, (n, 1), dtype).unwrap();
                let mut y = vec![f32::NAN; m * n];
                linear.forward_with(kernel, &x, m, &mut y).unwrap();
                let want = reference(&x, &w, m, k, n, dtype);
                for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
                    // f32 sums of k terms of magnitude ≤ 1: error ≤ k · 2^-24 · Σ|terms| ≤ k² 2^-24.
                    let bound = (k * k) as f64 * 6e-8 + 1e-6;
                    assert!(
                        (f64::from(got) - want).abs() <= bound,
                        "{} {} m={m} k={k} n={n} at {i}: {got} vs {want}",
                        kernel.name(),
                        dtype.name()
                    );
                }
            }
        }
    }
}

#[test]
fn paths_agree_to_rounding_and_thread_count_does_not_matter() {
    let (m, k, n) = (12, 100, 200);
    let x = values(m * k, 5);
    let w = values(k * n, 6);
    let linear = Linear::new(&w, k, n, (n, 1), KvDtype::Bf16).unwrap();
    let mut first = vec![0.0f32; m * n];
    linear.forward(&x, m, &mut first).unwrap();
    for kernel in Isa::available_of(&ISAS) {
        let mut y = vec![0.0f32; m * n];
        linear.forward_with(kernel, &x, m, &mut y).unwrap();
        for (a, b) in y.iter().zip(&first) {
            assert!((a - b).abs() <= 1e-4, "{}: {a} vs {b}", kernel.name());
        }
    }
    // Same kernel, same sums in the same order: identical bits whatever the split.
    let mut again = vec![0.0f32; m * n];
    linear.forward(&x, m, &mut again).unwrap();
    assert_eq!(again, first);
}

#[test]
fn transposed_strides_read_the_out_in_layout() {
    let (m, k, n) = (3, 21, 37);
    let x = values(m * k, 7);
    let w = values(k * n, 8);
    let mut w_t = vec![0.0f32; k * n];
    for kk in 0..k {
        for j in 0..n {
            w_t[j * k + kk] = w[kk * n + j];
        }
    }
    let direct = Linear::new(&w, k, n, (n, 1), KvDtype::F32).unwrap();
    let transposed = Linear::new(&w_t, k, n, (1, k), KvDtype::F32).unwrap();
    let (mut a, mut b) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
    direct.forward(&x, m, &mut a).unwrap();
    transposed.forward(&x, m, &mut b).unwrap();
    assert_eq!(a, b);
}

#[test]
fn bad_shapes_and_kernels_are_typed_errors() {
    assert!(matches!(
        Linear::new(&[], 0, 3, (3, 1), KvDtype::F32),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        Linear::new(&[0.0; 5], 2, 3, (3, 1), KvDtype::F32),
        Err(Error::Shape(_))
    ));
    let linear = Linear::new(&[1.0; 6], 2, 3, (3, 1), KvDtype::F16).unwrap();
    assert_eq!(linear.nbytes(), 2 * 16 * 2);
    let mut y = vec![0.0f32; 3];
    assert!(matches!(
        linear.forward(&[1.0; 3], 1, &mut y),
        Err(Error::Shape(_))
    ));
    assert!(matches!(
        linear.forward(&[1.0; 2], 2, &mut y),
        Err(Error::Shape(_))
    ));
    linear.forward(&[1.0, 2.0], 1, &mut y).unwrap();
    assert_eq!(y, [3.0; 3]);
    linear.forward(&[], 0, &mut []).unwrap();
    for kernel in ISAS.into_iter().filter(|k| !k.available()) {
        assert!(matches!(
            linear.forward_with(kernel, &[1.0, 2.0], 1, &mut y),
            Err(Error::InvalidArgument(_))
        ));
    }
}

/// The AVX-512 path runs exactly when the CPU has AVX-512F (and the AVX2 set), and then agrees
/// with the portable kernel on every tile height 1..=9 (each `(rows, panels)` its match lists,
/// plus a taller M that splits into full and short tiles) and every dtype. On a CPU without
/// AVX-512F it must be refused with a typed error instead.
#[cfg(target_arch = "x86_64")]
#[test]
fn avx512_runs_when_the_cpu_has_it_and_matches_portable() {
    let has = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    assert_eq!(Isa::Avx512.available(), has);
    let (k, n) = (67, 16 * 17 + 5);
    let w = values(k * n, 11);
    for dtype in DTYPES {
        let linear = Linear::new(&w, k, n, (n, 1), dtype).unwrap();
        for m in (1..=9).chain([19]) {
            let x = values(m * k, 12 + m as u64);
            let (mut fast, mut portable) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
            let run = linear.forward_with(Isa::Avx512, &x, m, &mut fast);
            if !has {
                assert!(matches!(run, Err(Error::InvalidArgument(_))));
                continue;
            }
            run.unwrap();
            linear
                .forward_with(Isa::Portable, &x, m, &mut portable)
                .unwrap();
            for (i, (a, b)) in fast.iter().zip(&portable).enumerate() {
                // Fused vs unfused multiply-adds: one product's rounding per term, k terms ≤ 1.
                assert!(
                    (a - b).abs() <= 1e-5,
                    "{} m={m} at {i}: {a} vs {b}",
                    dtype.name()
                );
            }
        }
    }
}

#[test]
fn a_quantized_weight_many_rows_deep_is_the_float_product_of_its_dequantized_rows() {
    // Q8_0 rows of 64 weights: scale 1/64, quants from the test values.
    let (k, n, m) = (64, 37, DEQUANTIZED_FROM_ROWS + 3);
    let mut bytes = Vec::new();
    for (i, v) in values(n * k, 9).into_iter().enumerate() {
        if i % 32 == 0 {
            bytes.extend(f16::from_f32(1.0 / 64.0).to_le_bytes());
        }
        bytes.push((v * 127.0) as i8 as u8);
    }
    let matrix = QuantMatrix::new(k, vec![(QuantFormat::Q8_0, bytes.clone())]).unwrap();
    let linear = Linear::quantized(k, vec![(QuantFormat::Q8_0, bytes)]).unwrap();
    let mut w = vec![0.0; n * k];
    linear
        .dequantize_rows(&(0..n).collect::<Vec<_>>(), &mut w)
        .unwrap();
    let x = values(m * k, 10);
    // W as `[k, n]` for the reference; f32 sums of 64 terms: within 1e-5 of |x|·|w|.
    let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
    let exact = reference(&x, &wt, m, k, n, KvDtype::F32);
    for isa in Isa::available_of(&quant::ISAS) {
        // One chunk, and chunks of one panel each (a tail of 5 columns).
        for chunk in [DEQUANTIZED_CHUNK, 16 * k] {
            let mut y = vec![f32::NAN; m * n];
            forward_dequantized(&matrix, isa, &x, m, &mut y, chunk).unwrap();
            for (got, want) in y.iter().zip(&exact) {
                assert!(
                    (f64::from(*got) - want).abs() <= 1e-4,
                    "{isa:?} chunk {chunk}: {got} vs {want}"
                );
            }
        }
        let mut y = vec![f32::NAN; m * n];
        linear.forward_with(isa, &x, m, &mut y).unwrap();
        assert!(y
            .iter()
            .zip(&exact)
            .all(|(got, want)| (f64::from(*got) - want).abs() <= 1e-4));
    }
}

/// `x · W` in f64 over `x` and `W` rounded to bf16: what the bf16-pair tiles compute, to their
/// f32 sums' rounding.
fn reference_bf16(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
    let x: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    reference(&x, w, m, k, n, KvDtype::Bf16)
}

#[test]
fn bf16_pair_tiles_are_the_product_of_bf16_rounded_activations_and_weights() {
    if !Isa::Avx512Bf16.available() {
        return; // the path cannot run on this CPU (runs wherever it can, as the AVX-512 test)
    }
    // Odd k (a zero-padded last pair), tails of rows and panels, and rows either side of
    // PAIRED_FROM_ROWS (below it the f32 tiles run, within f32 rounding of `reference`).
    let shapes = [
        (16, 1, 1),
        (16, 13, 17),
        (17, 64, 160),
        (33, 3, 15),
        (40, 37, 200),
        (5, 19, 31),
    ];
    for &(m, k, n) in &shapes {
        let x = values(m * k, 20 + m as u64);
        let w = values(k * n, 21 + n as u64);
        let linear = Linear::new(&w, k, n, (n, 1), KvDtype::Bf16).unwrap();
        let mut y = vec![f32::NAN; m * n];
        linear.forward_with(Isa::Avx512Bf16, &x, m, &mut y).unwrap();
        let want = if m >= PAIRED_FROM_ROWS {
            reference_bf16(&x, &w, m, k, n)
        } else {
            reference(&x, &w, m, k, n, KvDtype::Bf16)
        };
        let bound = (k * k) as f64 * 6e-8 + 1e-6;
        for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(got) - want).abs() <= bound,
                "m={m} k={k} n={n} at {i}: {got} vs {want}"
            );
        }
    }
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let linear = Linear::new(&[1.0; 4], 2, 2, (2, 1), dtype).unwrap();
        assert!(matches!(
            linear.forward_with(Isa::Avx512Bf16, &[1.0; 2], 1, &mut [0.0; 2]),
            Err(Error::InvalidArgument(_))
        ));
    }
}

#[test]
fn a_quantized_prompt_on_bf16_pairs_is_the_product_of_its_rows_rounded_to_bf16() {
    if !Isa::Avx512Bf16.available() {
        return;
    }
    let (k, n, m) = (96, 37, DEQUANTIZED_FROM_ROWS + 5);
    let mut bytes = Vec::new();
    for (i, v) in values(n * k, 30).into_iter().enumerate() {
        if i % 32 == 0 {
            bytes.extend(f16::from_f32(1.0 / 64.0).to_le_bytes());
        }
        bytes.push((v * 127.0) as i8 as u8);
    }
    let linear = Linear::quantized(k, vec![(QuantFormat::Q8_0, bytes)]).unwrap();
    let mut w = vec![0.0; n * k];
    linear
        .dequantize_rows(&(0..n).collect::<Vec<_>>(), &mut w)
        .unwrap();
    let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
    let x = values(m * k, 31);
    let want = reference_bf16(&x, &wt, m, k, n);
    let mut y = vec![f32::NAN; m * n];
    linear.forward_with(Isa::Avx512Bf16, &x, m, &mut y).unwrap();
    for (got, want) in y.iter().zip(&want) {
        assert!((f64::from(*got) - want).abs() <= 1e-4, "{got} vs {want}");
    }
    // Below DEQUANTIZED_FROM_ROWS the same set runs the int8 kernels: as VNNI does.
    let (mut a, mut b) = (vec![0.0; 3 * n], vec![0.0; 3 * n]);
    linear
        .forward_with(Isa::Avx512Bf16, &x[..3 * k], 3, &mut a)
        .unwrap();
    linear
        .forward_with(Isa::Avx512Vnni, &x[..3 * k], 3, &mut b)
        .unwrap();
    assert_eq!(a, b);
}
