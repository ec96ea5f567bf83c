//! The row operations of a decoder layer between its matrix products: RMSNorm, rotary embedding,
//! the gated activations and the residual add, each over row-major `[rows, width]` f32 buffers.
//!
//! Invariants:
//! - Every function computes in f32 as the numpy reference does, in the same order of roundings
//!   (`x · (1/√(mean + eps)) · w`; rotation `x1·c − x2·s`, `x2·c + x1·s`, unfused), except the
//!   mean of squares, summed in f64 (no worse than numpy's pairwise f32 sum).
//! - The activations share one sigmoid, `1 / (1 + e^-x)` from `vmath::exp_nonpositive` on
//!   `-|x|`, branch-free so the loops vectorise; no input overflows (±inf give 0 and x).
//! - Rotation pairs are the two halves of a head (Hugging Face's `rotate_half`), not adjacent lanes.

use crate::compute::cpu::vmath::exp_nonpositive;

/// `out[r] = x[r] · (1/√(mean(x[r]²) + eps)) · weight` for each row of `x` (`width` = `weight.len()`).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let width = weight.len();
    for (row, out) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let inverse = inverse_rms(row, eps);
        for ((o, &v), &w) in out.iter_mut().zip(row).zip(weight) {
            *o = v * inverse * w;
        }
    }
}

/// [`rms_norm`] of each row of `x` in place.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let width = weight.len();
    for row in x.chunks_exact_mut(width) {
        let inverse = inverse_rms(row, eps);
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v * inverse * w;
        }
    }
}

/// `1/√(mean(row²) + eps)`, in f32 after an f64 sum.
#[inline]
fn inverse_rms(row: &[f32], eps: f32) -> f32 {
    let sum: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean = (sum / row.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// The f32 cosines and sines `[positions.len(), frequencies.len()]` of each position's angles
/// `position · frequency`, computed in f64 (as the reference does).
pub fn rope_table(frequencies: &[f64], positions: &[i64]) -> (Vec<f32>, Vec<f32>) {
    let n = positions.len() * frequencies.len();
    let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for &position in positions {
        for &frequency in frequencies {
            let angle = position as f64 * frequency;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// Rotates one head `x` (`head_dim` = 2 · `cos.len()`) by its token's angles into `out`.
#[inline]
pub fn rotate(x: &[f32], cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let half = cos.len();
    let (x1, x2) = x.split_at(half);
    let (o1, o2) = out.split_at_mut(half);
    for i in 0..half {
        o1[i] = x1[i] * cos[i] - x2[i] * sin[i];
        o2[i] = x2[i] * cos[i] + x1[i] * sin[i];
    }
}

/// The gated MLP's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x · sigmoid(x)` (Llama's SiLU).
    Silu,
    /// GELU's tanh approximation, `x/2 · (1 + tanh(√(2/π)(x + 0.044715 x³)))` (Gemma's).
    GeluTanh,
}

impl std::str::FromStr for Activation {
    type Err = crate::error::Error;

    fn from_str(name: &str) -> crate::error::Result<Self> {
        match name {
            "silu" => Ok(Activation::Silu),
            "gelu_tanh" => Ok(Activation::GeluTanh),
            _ => Err(crate::error::Error::InvalidArgument(format!(
                "activation must be 'silu' or 'gelu_tanh', got {name:?}"
            ))),
        }
    }
}

/// `sigmoid(x) = 1 / (1 + e^-x)`, through `e^-|x|` so no exponent overflows.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    let e = exp_nonpositive(-x.abs());
    // e/(1 + e) for x < 0: 1 - 1/(1 + e) would cancel to 0 long before the true value does.
    let numerator = if x >= 0.0 { 1.0 } else { e };
    numerator / (1.0 + e)
}

/// √(2/π), GELU's tanh-approximation constant.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// `out[r][i] = act(gate_up[r][i]) · gate_up[r][width + i]` for rows `[gate | up]` of `2 · width`.
pub fn gated(activation: Activation, gate_up: &[f32], width: usize, out: &mut [f32]) {
    for (row, out) in gate_up
        .chunks_exact(2 * width)
        .zip(out.chunks_exact_mut(width))
    {
        let (gate, up) = row.split_at(width);
        match activation {
            Activation::Silu => {
                for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                    *o = g * sigmoid(g) * u;
                }
            }
            // x/2 · (1 + tanh(y)) = x · sigmoid(2y).
            Activation::GeluTanh => {
                for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                    let inner = SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g);
                    *o = g * sigmoid(2.0 * inner) * u;
                }
            }
        }
    }
}

/// `acc[i] += x[i]`.
pub fn add(acc: &mut [f32], x: &[f32]) {
    for (a, &v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sigmoid_is_within_rounding_of_the_exact_value_everywhere() {
        for i in -2000..=2000 {
            let x = i as f32 * 0.05;
            let exact = 1.0 / (1.0 + (-(x as f64)).exp());
            let got = sigmoid(x) as f64;
            assert!(
                (got - exact).abs() <= 4e-7 * exact.max(1e-30) + 1e-37,
                "{x}: {got} vs {exact}"
            );
        }
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
        assert_eq!(sigmoid(f32::NEG_INFINITY), 0.0);
        assert_eq!(sigmoid(-200.0), 0.0);
    }

    #[test]
    fn activations_match_their_definitions() {
        let gate: Vec<f32> = (-40..40).map(|i| i as f32 * 0.25).collect();
        let mut gate_up = gate.clone();
        gate_up.extend(std::iter::repeat_n(1.5f32, gate.len()));
        let mut out = vec![0.0; gate.len()];
        gated(Activation::Silu, &gate_up, gate.len(), &mut out);
        for (&x, &o) in gate.iter().zip(&out) {
            let x = x as f64;
            let want = x / (1.0 + (-x).exp()) * 1.5;
            assert!(
                (o as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                "silu {x}"
            );
        }
        gated(Activation::GeluTanh, &gate_up, gate.len(), &mut out);
        for (&x, &o) in gate.iter().zip(&out) {
            let x = x as f64;
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            let want = 0.5 * x * (1.0 + inner.tanh()) * 1.5;
            assert!(
                (o as f64 - want).abs() <= 2e-6 * want.abs().max(1.0),
                "gelu {x}: {o} vs {want}"
            );
        }
    }

    #[test]
    fn rms_norm_and_rotation_follow_the_reference_formulas() {
        let x = [3.0f32, -4.0, 0.0, 12.0, 1.0, 1.0, 1.0, 1.0];
        let weight = [1.0f32, 2.0, 0.5, 1.0];
        let mut out = [0.0f32; 8];
        rms_norm(&x, &weight, 0.0, &mut out);
        let inverse = 1.0 / (169.0f32 / 4.0).sqrt();
        assert_eq!(
            out[..4],
            [3.0 * inverse, -4.0 * inverse * 2.0, 0.0, 12.0 * inverse]
        );
        assert_eq!(out[4..], [1.0, 2.0, 0.5, 1.0]);
        let mut y = x;
        rms_norm_in_place(&mut y, &weight, 0.0);
        assert_eq!(y, out);

        let (cos, sin) = rope_table(&[1.0, 0.5], &[0, 2]);
        assert_eq!(cos[..2], [1.0, 1.0]);
        assert_eq!(sin[2..], [(2.0f64).sin() as f32, (1.0f64).sin() as f32]);
        let mut rotated = [0.0f32; 4];
        rotate(&[1.0, 2.0, 3.0, 4.0], &cos[2..], &sin[2..], &mut rotated);
        let (c, s) = (cos[2], sin[2]);
        assert_eq!(rotated[0], 1.0 * c - 3.0 * s);
        assert_eq!(rotated[2], 3.0 * c + 1.0 * s);
    }
}
