//! [`Decoder`]: a pre-norm decoder's weights and its forward pass over one scheduler step, in one
//! call: embedding, every layer's norms, projections, rotary embedding, K/V writes, attention,
//! gated MLP and residuals, then the final norm (and the output projection).
//!
//! What a layer is comes from its weights and the [`DecoderConfig`], so Llama and Gemma 3 share
//! the executor: Gemma's per-head query/key norms and its norms after attention and after the
//! MLP are optional weights; the activation, the attention scale, the embedding scale and each
//! layer's rotary frequencies are configuration. Norm weights are the multipliers themselves
//! (Gemma's `1 + w` is folded in by whoever builds the decoder).
//!
//! Invariants:
//! - Construction checks every shape against the configuration, so a forward pass never meets a
//!   weight of the wrong size; a step's ids, positions and rows are checked before any K/V is
//!   touched, so bad input changes nothing.
//! - The whole pass runs inside the one worker pool (`cpu::pool`): its matrix products and
//!   attention calls join the pool from one of its own threads, so there is no hand-over to
//!   sleeping workers between calls (that cost 20-35 µs per call when Python drove each one).
//! - The K/V are reached only through the [`StepKv`] given, layer by layer in order: copies
//!   first, then for each layer its write before its attention.

use std::sync::Arc;

use super::kv::StepKv;
use super::ops::{self, Activation};
use crate::alloc::try_zeroed_vec;
use crate::compute::cpu::pool::pool;
use crate::compute::linear::Linear;
use crate::error::{ensure, Error, Result};

/// The dimensions and constants of a decoder.
#[derive(Debug, Clone)]
pub struct DecoderConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub activation: Activation,
    /// What attention scores are multiplied by (`1/√head_dim` for Llama).
    pub attention_scale: f32,
    /// What embeddings are multiplied by (1 for Llama, `√hidden_size` for Gemma).
    pub embedding_scale: f32,
    /// Positions must stay below this.
    pub max_positions: usize,
    /// Sets of rotary frequencies (`head_dim / 2` radians per position each); layers name one.
    pub rope_frequencies: Vec<Vec<f64>>,
}

/// Token embeddings: a float table `[vocab, hidden]`, or the rows of a quantized weight
/// (a tied output projection's own), dequantized on gather.
pub enum Embedding {
    Table { rows: Vec<f32>, hidden_size: usize },
    Rows(Arc<Linear>),
}

impl Embedding {
    /// A float table of rows of `hidden_size` values; `InvalidArgument` unless whole rows.
    pub fn table(rows: Vec<f32>, hidden_size: usize) -> Result<Self> {
        ensure(
            hidden_size > 0 && rows.len().is_multiple_of(hidden_size),
            || {
                format!(
                    "an embedding table of {} values is not rows of {hidden_size}",
                    rows.len()
                )
            },
        )?;
        Ok(Embedding::Table { rows, hidden_size })
    }

    /// The rows of a quantized weight (its output features); `InvalidArgument` for a float one,
    /// whose panels are laid out for products, not rows.
    pub fn rows(linear: Arc<Linear>) -> Result<Self> {
        ensure(linear.is_quantized(), || {
            format!(
                "embedding rows come from a quantized weight, not a {} one",
                linear.storage()
            )
        })?;
        Ok(Embedding::Rows(linear))
    }

    /// `(vocab_size, hidden_size)`.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Embedding::Table { rows, hidden_size } => (rows.len() / hidden_size, *hidden_size),
            Embedding::Rows(linear) => (linear.out_features(), linear.in_features()),
        }
    }

    /// Bytes held (a shared quantized weight counts in full).
    pub fn nbytes(&self) -> usize {
        match self {
            Embedding::Table { rows, .. } => std::mem::size_of_val(rows.as_slice()),
            Embedding::Rows(linear) => linear.nbytes(),
        }
    }

    /// The rows of tokens `ids` into `out` (`[ids.len(), hidden_size]`); `InvalidArgument` for
    /// an id outside the vocabulary.
    pub fn gather(&self, ids: &[usize], out: &mut [f32]) -> Result<()> {
        let (vocab, h) = self.shape();
        check_len("out", out.len(), ids.len() * h)?;
        if let Some(id) = ids.iter().find(|&&id| id >= vocab) {
            return Err(Error::InvalidArgument(format!(
                "token id {id} is outside the vocabulary 0..{vocab}"
            )));
        }
        match self {
            Embedding::Table { rows, .. } => {
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(h)) {
                    row.copy_from_slice(&rows[id * h..][..h]);
                }
                Ok(())
            }
            Embedding::Rows(linear) => linear.dequantize_rows(ids, out),
        }
    }
}

/// One layer's weights: norms as multipliers of `hidden_size` (`head_dim` for the per-head ones),
/// projections with `x · W` shapes.
#[derive(Clone)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    /// `[hidden, (heads + 2 kv_heads) · head_dim]`: `[q | k | v]`.
    pub qkv: Arc<Linear>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// `[heads · head_dim, hidden]`.
    pub o: Arc<Linear>,
    /// Norm of the attention's output before the residual add (Gemma).
    pub post_attention_norm: Option<Vec<f32>>,
    pub pre_mlp_norm: Vec<f32>,
    /// `[hidden, 2 · intermediate]`: `[gate | up]`.
    pub gate_up: Arc<Linear>,
    /// `[intermediate, hidden]`.
    pub down: Arc<Linear>,
    /// Norm of the MLP's output before the residual add (Gemma).
    pub post_mlp_norm: Option<Vec<f32>>,
    /// Index of this layer's set in `DecoderConfig::rope_frequencies`.
    pub rope: usize,
}

/// What a forward pass returns for each row asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// The final-normed hidden state (`hidden_size` floats).
    Hidden,
    /// Its projection by the output projection (`vocab_size` logits).
    Logits,
}

/// A decoder: see the module doc.
pub struct Decoder {
    config: DecoderConfig,
    embedding: Arc<Embedding>,
    layers: Vec<LayerWeights>,
    final_norm: Vec<f32>,
    lm_head: Arc<Linear>,
}

fn check_len(name: &str, got: usize, want: usize) -> Result<()> {
    ensure(got == want, || {
        format!("{name} has {got} values, expected {want}")
    })
}

fn check_linear(name: &str, linear: &Linear, k: usize, n: usize) -> Result<()> {
    let got = (linear.in_features(), linear.out_features());
    ensure(got == (k, n), || {
        format!("{name} is {} x {}, expected {k} x {n}", got.0, got.1)
    })
}

impl DecoderConfig {
    fn check(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("max_positions", self.max_positions),
        ];
        for (name, value) in sizes {
            ensure(value > 0, || format!("{name} must be positive"))?;
        }
        ensure(self.num_heads.is_multiple_of(self.num_kv_heads), || {
            format!(
                "num_heads ({}) must be a multiple of num_kv_heads ({})",
                self.num_heads, self.num_kv_heads
            )
        })?;
        ensure(self.head_dim.is_multiple_of(2), || {
            format!("head_dim must be even, got {}", self.head_dim)
        })?;
        for (name, value) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("attention_scale", self.attention_scale),
            ("embedding_scale", self.embedding_scale),
        ] {
            ensure(value.is_finite() && value >= 0.0, || {
                format!("{name} must be a finite non-negative number, got {value}")
            })?;
        }
        ensure(!self.rope_frequencies.is_empty(), || {
            "rope_frequencies must hold at least one set".into()
        })?;
        for (i, set) in self.rope_frequencies.iter().enumerate() {
            check_len(
                &format!("rope_frequencies[{i}]"),
                set.len(),
                self.head_dim / 2,
            )?;
            ensure(set.iter().all(|f| f.is_finite()), || {
                format!("rope_frequencies[{i}] must be finite")
            })?;
        }
        Ok(())
    }

    fn q_width(&self) -> usize {
        self.num_heads * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

impl LayerWeights {
    fn check(&self, index: usize, c: &DecoderConfig) -> Result<()> {
        let name = |part: &str| format!("layers[{index}].{part}");
        let h = c.hidden_size;
        check_len(&name("input_norm"), self.input_norm.len(), h)?;
        check_len(&name("pre_mlp_norm"), self.pre_mlp_norm.len(), h)?;
        for (part, norm, want) in [
            ("q_norm", &self.q_norm, c.head_dim),
            ("k_norm", &self.k_norm, c.head_dim),
            ("post_attention_norm", &self.post_attention_norm, h),
            ("post_mlp_norm", &self.post_mlp_norm, h),
        ] {
            if let Some(norm) = norm {
                check_len(&name(part), norm.len(), want)?;
            }
        }
        check_linear(&name("qkv"), &self.qkv, h, c.q_width() + 2 * c.kv_width())?;
        check_linear(&name("o"), &self.o, c.q_width(), h)?;
        check_linear(&name("gate_up"), &self.gate_up, h, 2 * c.intermediate_size)?;
        check_linear(&name("down"), &self.down, c.intermediate_size, h)?;
        ensure(self.rope < c.rope_frequencies.len(), || {
            format!(
                "{} = {} names no set of rope_frequencies ({} given)",
                name("rope"),
                self.rope,
                c.rope_frequencies.len()
            )
        })
    }
}

/// One step's token-sized buffers, made once per call.
struct Buffers {
    hidden: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    query: Vec<f32>,
    keys: Vec<f32>,
    values: Vec<f32>,
    attended: Vec<f32>,
    projected: Vec<f32>,
    gate_up: Vec<f32>,
    activated: Vec<f32>,
}

impl Buffers {
    fn new(c: &DecoderConfig, m: usize) -> Result<Self> {
        let buffer = |width: usize| try_zeroed_vec(m * width, "a forward pass's activations");
        Ok(Buffers {
            hidden: buffer(c.hidden_size)?,
            normed: buffer(c.hidden_size)?,
            qkv: buffer(c.q_width() + 2 * c.kv_width())?,
            query: buffer(c.q_width())?,
            keys: buffer(c.kv_width())?,
            values: buffer(c.kv_width())?,
            attended: buffer(c.q_width())?,
            projected: buffer(c.hidden_size)?,
            gate_up: buffer(2 * c.intermediate_size)?,
            activated: buffer(c.intermediate_size)?,
        })
    }
}

impl Decoder {
    /// A decoder of `config` with these weights; `InvalidArgument` naming the first weight whose
    /// shape the configuration does not imply.
    pub fn new(
        config: DecoderConfig,
        embedding: Arc<Embedding>,
        layers: Vec<LayerWeights>,
        final_norm: Vec<f32>,
        lm_head: Arc<Linear>,
    ) -> Result<Self> {
        config.check()?;
        ensure(!layers.is_empty(), || {
            "a decoder needs at least one layer".into()
        })?;
        for (index, layer) in layers.iter().enumerate() {
            layer.check(index, &config)?;
        }
        check_len("final_norm", final_norm.len(), config.hidden_size)?;
        check_linear("lm_head", &lm_head, config.hidden_size, config.vocab_size)?;
        let (vocab, hidden) = embedding.shape();
        ensure(
            (vocab, hidden) == (config.vocab_size, config.hidden_size),
            || {
                format!(
                    "the embedding is {vocab} x {hidden}, expected {} x {}",
                    config.vocab_size, config.hidden_size
                )
            },
        )?;
        Ok(Decoder {
            config,
            embedding,
            layers,
            final_norm,
            lm_head,
        })
    }

    pub fn config(&self) -> &DecoderConfig {
        &self.config
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Floats per row of `output`.
    pub fn width(&self, output: Output) -> usize {
        match output {
            Output::Hidden => self.config.hidden_size,
            Output::Logits => self.config.vocab_size,
        }
    }

    /// Runs one step: the tokens `input_ids` at `positions` (one per token), every layer's K/V
    /// written and attended through `kv`; writes `output` of token `rows` into `out`
    /// (`[rows.len(), width(output)]`). `InvalidArgument`, with nothing touched, for an id
    /// outside the vocabulary, a position at or past `max_positions`, a row outside the step or
    /// an `out` of the wrong size.
    pub fn forward(
        &self,
        kv: &mut (dyn StepKv + Send),
        input_ids: &[i64],
        positions: &[i64],
        rows: &[usize],
        output: Output,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_step(input_ids, positions, rows)?;
        check_len("out", out.len(), rows.len() * self.width(output))?;
        match output {
            Output::Hidden => pool()?.install(|| self.run(kv, input_ids, positions, rows, out)),
            Output::Logits => {
                let h = self.config.hidden_size;
                let mut hidden = try_zeroed_vec(rows.len() * h, "hidden states")?;
                pool()?.install(|| {
                    self.run(kv, input_ids, positions, rows, &mut hidden)?;
                    self.lm_head.forward(&hidden, rows.len(), out)
                })
            }
        }
    }

    fn check_step(&self, input_ids: &[i64], positions: &[i64], rows: &[usize]) -> Result<()> {
        let c = &self.config;
        ensure(positions.len() == input_ids.len(), || {
            format!(
                "input_ids ({}) and positions ({}) must have one entry per token",
                input_ids.len(),
                positions.len()
            )
        })?;
        if let Some(id) = input_ids
            .iter()
            .find(|&&id| !(0..c.vocab_size as i64).contains(&id))
        {
            return Err(Error::InvalidArgument(format!(
                "token id {id} is outside the vocabulary 0..{}",
                c.vocab_size
            )));
        }
        if let Some(p) = positions.iter().find(|&&p| p < 0) {
            return Err(Error::InvalidArgument(format!("position {p} is negative")));
        }
        if let Some(&p) = positions
            .iter()
            .max()
            .filter(|&&p| p as u64 >= c.max_positions as u64)
        {
            return Err(Error::InvalidArgument(format!(
                "position {p} is past max_position_embeddings {}",
                c.max_positions
            )));
        }
        if let Some(row) = rows.iter().find(|&&row| row >= input_ids.len()) {
            return Err(Error::InvalidArgument(format!(
                "row {row} is outside the step's {} tokens",
                input_ids.len()
            )));
        }
        Ok(())
    }

    fn embed(&self, input_ids: &[i64], out: &mut [f32]) -> Result<()> {
        let ids: Vec<usize> = input_ids.iter().map(|&id| id as usize).collect();
        self.embedding.gather(&ids, out)?;
        let scale = self.config.embedding_scale;
        if scale != 1.0 {
            out.iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }

    fn run(
        &self,
        kv: &mut (dyn StepKv + Send),
        input_ids: &[i64],
        positions: &[i64],
        rows: &[usize],
        out: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let m = input_ids.len();
        let mut b = Buffers::new(c, m)?;
        let rotations: Vec<(Vec<f32>, Vec<f32>)> = c
            .rope_frequencies
            .iter()
            .map(|set| ops::rope_table(set, positions))
            .collect();
        kv.copy_blocks()?;
        self.embed(input_ids, &mut b.hidden)?;
        for (index, layer) in self.layers.iter().enumerate() {
            ops::rms_norm(&b.hidden, &layer.input_norm, c.rms_norm_eps, &mut b.normed);
            layer.qkv.forward(&b.normed, m, &mut b.qkv)?;
            self.split_heads(layer, &rotations[layer.rope], &mut b);
            kv.write(index, &b.keys, &b.values)?;
            let scale = c.attention_scale;
            kv.attention(index, &b.query, c.num_heads, scale, &mut b.attended)?;
            layer.o.forward(&b.attended, m, &mut b.projected)?;
            if let Some(norm) = &layer.post_attention_norm {
                ops::rms_norm_in_place(&mut b.projected, norm, c.rms_norm_eps);
            }
            ops::add(&mut b.hidden, &b.projected);
            ops::rms_norm(
                &b.hidden,
                &layer.pre_mlp_norm,
                c.rms_norm_eps,
                &mut b.normed,
            );
            layer.gate_up.forward(&b.normed, m, &mut b.gate_up)?;
            ops::gated(
                c.activation,
                &b.gate_up,
                c.intermediate_size,
                &mut b.activated,
            );
            layer.down.forward(&b.activated, m, &mut b.projected)?;
            if let Some(norm) = &layer.post_mlp_norm {
                ops::rms_norm_in_place(&mut b.projected, norm, c.rms_norm_eps);
            }
            ops::add(&mut b.hidden, &b.projected);
        }
        let h = c.hidden_size;
        for (&row, out) in rows.iter().zip(out.chunks_exact_mut(h)) {
            ops::rms_norm(
                &b.hidden[row * h..][..h],
                &self.final_norm,
                c.rms_norm_eps,
                out,
            );
        }
        Ok(())
    }

    /// Splits each token's `[q | k | v]` into the query, key and value buffers, per-head normed
    /// (if the layer has those norms) and rotated.
    fn split_heads(&self, layer: &LayerWeights, rotation: &(Vec<f32>, Vec<f32>), b: &mut Buffers) {
        let c = &self.config;
        let (d, half) = (c.head_dim, c.head_dim / 2);
        let (q_width, kv_width) = (c.q_width(), c.kv_width());
        let width = q_width + 2 * kv_width;
        let mut normed = vec![0.0f32; d];
        let tokens = b.qkv.chunks_exact(width).enumerate();
        for (t, row) in tokens {
            let (cos, sin) = (
                &rotation.0[t * half..][..half],
                &rotation.1[t * half..][..half],
            );
            let (q, rest) = row.split_at(q_width);
            let (k, v) = rest.split_at(kv_width);
            for (heads, norm, out) in [
                (q, &layer.q_norm, &mut b.query[t * q_width..][..q_width]),
                (k, &layer.k_norm, &mut b.keys[t * kv_width..][..kv_width]),
            ] {
                for (head, out) in heads.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
                    match norm {
                        Some(weight) => {
                            ops::rms_norm(head, weight, c.rms_norm_eps, &mut normed);
                            ops::rotate(&normed, cos, sin, out);
                        }
                        None => ops::rotate(head, cos, sin, out),
                    }
                }
            }
            b.values[t * kv_width..][..kv_width].copy_from_slice(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::dtype::KvDtype;

    /// Records the K/V calls a pass makes; attention returns zeros.
    #[derive(Default)]
    struct Recorder {
        calls: Vec<String>,
    }

    impl StepKv for Recorder {
        fn copy_blocks(&mut self) -> Result<()> {
            self.calls.push("copy".into());
            Ok(())
        }

        fn write(&mut self, layer: usize, _keys: &[f32], _values: &[f32]) -> Result<()> {
            self.calls.push(format!("write {layer}"));
            Ok(())
        }

        fn attention(
            &mut self,
            layer: usize,
            _query: &[f32],
            _num_heads: usize,
            _scale: f32,
            out: &mut [f32],
        ) -> Result<()> {
            self.calls.push(format!("attention {layer}"));
            out.fill(0.0);
            Ok(())
        }
    }

    const H: usize = 8;

    fn zeros(k: usize, n: usize) -> Arc<Linear> {
        Arc::new(Linear::new(&vec![0.0; k * n], k, n, (n, 1), KvDtype::F32).unwrap())
    }

    /// Two layers whose projections are all zero: each layer adds nothing, so the hidden state
    /// is the final norm of the embedding.
    fn decoder() -> Decoder {
        let config = DecoderConfig {
            vocab_size: 4,
            hidden_size: H,
            intermediate_size: 6,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            rms_norm_eps: 0.0,
            activation: Activation::Silu,
            attention_scale: 0.5,
            embedding_scale: 2.0,
            max_positions: 16,
            rope_frequencies: vec![vec![1.0, 0.5]],
        };
        let layer = LayerWeights {
            input_norm: vec![1.0; H],
            qkv: zeros(H, 16),
            q_norm: None,
            k_norm: None,
            o: zeros(8, H),
            post_attention_norm: None,
            pre_mlp_norm: vec![1.0; H],
            gate_up: zeros(H, 12),
            down: zeros(6, H),
            post_mlp_norm: None,
            rope: 0,
        };
        let table: Vec<f32> = (0..4 * H).map(|i| i as f32 - 9.0).collect();
        let embedding = Arc::new(Embedding::table(table, H).unwrap());
        let final_norm = (0..H).map(|i| 1.0 + i as f32).collect();
        Decoder::new(
            config,
            embedding,
            vec![layer.clone(), layer],
            final_norm,
            zeros(H, 4),
        )
        .unwrap()
    }

    #[test]
    fn a_pass_copies_first_then_writes_each_layer_before_attending_it() {
        let d = decoder();
        let mut kv = Recorder::default();
        let mut out = vec![0.0; 2 * H];
        let (ids, positions) = ([3, 1, 2], [0, 1, 2]);
        d.forward(&mut kv, &ids, &positions, &[2, 0], Output::Hidden, &mut out)
            .unwrap();
        assert_eq!(
            kv.calls,
            ["copy", "write 0", "attention 0", "write 1", "attention 1"]
        );
        // Zero projections: the final norm of the (scaled) embedding of tokens 2 and 3.
        for (row, id) in [(0, 2usize), (1, 3)] {
            let x: Vec<f32> = (0..H).map(|i| 2.0 * ((id * H + i) as f32 - 9.0)).collect();
            let mut want = vec![0.0; H];
            ops::rms_norm(&x, &d.final_norm, 0.0, &mut want);
            assert_eq!(out[row * H..][..H], want[..]);
        }
    }

    #[test]
    fn bad_input_makes_no_kv_call() {
        let d = decoder();
        let mut out = vec![0.0; H];
        for (ids, positions, rows) in [
            (&[4i64][..], &[0i64][..], &[0usize][..]),
            (&[-1], &[0], &[0]),
            (&[1], &[16], &[0]),
            (&[1], &[-3], &[0]),
            (&[1], &[0], &[1]),
            (&[1, 2], &[0], &[0]),
        ] {
            let mut kv = Recorder::default();
            let result = d.forward(&mut kv, ids, positions, rows, Output::Hidden, &mut out);
            assert!(
                matches!(result, Err(Error::InvalidArgument(_))),
                "{ids:?} {positions:?} {rows:?}"
            );
            assert!(kv.calls.is_empty());
        }
        let mut kv = Recorder::default();
        let result = d.forward(&mut kv, &[1], &[0], &[0, 0], Output::Hidden, &mut out);
        assert!(result.is_err());
        assert!(kv.calls.is_empty());
    }
}
