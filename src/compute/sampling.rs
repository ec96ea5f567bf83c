//! Choosing the next token of each row of a batch of logits: penalties, temperature, top-k, min-p,
//! top-p, one draw, and the model's logprobs. Rows run in parallel on the worker pool (`cpu::pool`).
//!
//! Why Rust: at a 49,152-token vocabulary numpy needs a full sort per row for top-p (191 ms for 16
//! rows) and several full-width temporaries even for plain temperature (29 ms); `argpartition`
//! alone costs ~0.4 ms per row. Here a row costs a few passes over its logits, each vectorisable
//! (max, the polynomial `exp` of `cpu::vmath`, compares), and no sort wider than the candidates
//! kept.
//!
//! The row's passes are plain Rust, compiled three times (`ISAS`): for the baseline target and,
//! chosen at run time through `cpu::isa`, for AVX2 and for AVX-512, where the compiler vectorises
//! the max, `exp`, compare and sum passes 8 or 16 wide. The code is the same and nothing is
//! fused (Rust never contracts `a·b + c`), so every path gives the same bits.
//!
//! Invariants (the Python `pagedkv.sampling` documents them to users):
//! - The processed logits are: repetition penalty on every token of the row's history (positive
//!   logits divided by it, negative multiplied: HF/vLLM), then `frequency × output count` and
//!   `presence × (output count > 0)` subtracted (OpenAI), then the row's logit bias added to its
//!   tokens (OpenAI's `logit_bias`). Greedy rows (temperature 0) take the first maximum of the
//!   processed logits.
//! - Sampled rows keep the tokens whose processed logit is at least the k-th largest (ties at the
//!   k-th all kept) and at least `max + T·ln(min_p)` (probability ≥ min_p × the top one's); then,
//!   over those renormalised, top-p keeps the smallest prefix in (probability desc, index asc)
//!   order whose mass before each token is below top_p. Tokens whose weight underflows f32 (below
//!   e^-87 relative to the top) count as probability 0.
//! - The draw is an inverse CDF in token-index order over the kept weights with the row's one
//!   uniform number in [0, 1): the caller's generator draws it, so a seed fixes the token whatever
//!   shares the batch and however many threads run.
//! - Logprobs are the log-softmax of the row's raw logits (before penalties, temperature and
//!   filters, as vLLM reports by default): the chosen token's and the top-n, by (logprob desc,
//!   index asc).
//! - Non-finite rows: a NaN, or no logit above -inf, gives no token ([`NO_TOKEN`]); a row with
//!   +inf logits is the softmax's limit, only its +inf tokens (equally likely) remain.

use rayon::prelude::*;

use crate::compute::cpu::vmath::{self, exp_nonpositive};
use crate::compute::cpu::Isa;
use crate::error::{ensure, Result};

/// The instruction sets the sampler is compiled for.
pub const ISAS: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Portable];

/// The instruction set calls take by default: the best of [`ISAS`] under `cpu::ceiling`.
pub fn default_isa() -> Isa {
    Isa::default_of(&ISAS)
}

/// The token of a row with nothing to draw from.
pub const NO_TOKEN: i64 = -1;

/// How one row is sampled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowParams {
    /// 0 (or below) for greedy.
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// The row's uniform number in [0, 1) (unused by greedy rows).
    pub uniform: f64,
    /// None: no logprobs; Some(n): the chosen token's and the n most likely.
    pub top_logprobs: Option<usize>,
}

/// The tokens a row's penalties look at: each token once, with its count in the output so far
/// (0 for a token only in the prompt, which only the repetition penalty sees).
#[derive(Clone, Copy, Debug, Default)]
pub struct History<'a> {
    pub tokens: &'a [i32],
    pub counts: &'a [i32],
}

/// What moves a row's logits besides its penalties: values added to some tokens after the
/// penalties (`tokens[i]` gets `values[i]`; a token given twice gets both), and the tokens a
/// grammar allows (bit `t % 32` of word `t / 32`; `None`: every token), applied first, so every
/// other token is out of the penalties, the filters, the draw and the logprobs alike.
#[derive(Clone, Copy, Debug, Default)]
pub struct Bias<'a> {
    pub tokens: &'a [i32],
    pub values: &'a [f32],
    pub allowed: Option<&'a [u32]>,
}

/// What one row gave.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The token, or [`NO_TOKEN`].
    pub token: i64,
    /// Its logprob (NaN when not asked for, or without a token).
    pub logprob: f32,
    /// The most likely tokens and their logprobs, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Samples every row of `logits` (`params.len()` rows of `vocab`), row r under `params[r]`,
/// `histories[r]` and `biases[r]`, on the worker pool, on [`default_isa`].
pub fn sample(
    logits: &[f32],
    vocab: usize,
    params: &[RowParams],
    histories: &[History<'_>],
    biases: &[Bias<'_>],
) -> Result<Vec<Sampled>> {
    sample_with(default_isa(), logits, vocab, params, histories, biases)
}

/// [`sample`] on a chosen instruction set.
pub fn sample_with(
    isa: Isa,
    logits: &[f32],
    vocab: usize,
    params: &[RowParams],
    histories: &[History<'_>],
    biases: &[Bias<'_>],
) -> Result<Vec<Sampled>> {
    isa.check_for("sampling", &ISAS)?;
    let rows = params.len();
    ensure(vocab > 0 && u32::try_from(vocab).is_ok(), || {
        format!("the vocabulary must have 1..=2^32-1 tokens, got {vocab}")
    })?;
    ensure(
        logits.len() == rows * vocab && histories.len() == rows && biases.len() == rows,
        || {
            format!(
                "{} logits, {rows} rows of params, {} histories and {} biases do not make rows of \
                 {vocab}",
                logits.len(),
                histories.len(),
                biases.len()
            )
        },
    )?;
    for (r, b) in biases.iter().enumerate() {
        ensure(b.tokens.len() == b.values.len(), || {
            format!("row {r}: bias tokens and values differ in length")
        })?;
        ensure(
            b.tokens.iter().all(|&t| t >= 0 && (t as usize) < vocab),
            || format!("row {r}: a biased token is outside the vocabulary of {vocab}"),
        )?;
        ensure(b.values.iter().all(|v| v.is_finite()), || {
            format!("row {r}: a logit bias is not finite")
        })?;
        ensure(
            b.allowed.is_none_or(|m| m.len() == vocab.div_ceil(32)),
            || {
                format!(
                    "row {r}: an allowed-token mask needs {} words",
                    vocab.div_ceil(32)
                )
            },
        )?;
    }
    for (r, (h, p)) in histories.iter().zip(params).enumerate() {
        ensure(h.tokens.len() == h.counts.len(), || {
            format!("row {r}: history tokens and counts differ in length")
        })?;
        ensure(
            h.tokens.iter().all(|&t| t >= 0 && (t as usize) < vocab),
            || format!("row {r}: a history token is outside the vocabulary of {vocab}"),
        )?;
        ensure((0.0..1.0).contains(&p.uniform), || {
            format!(
                "row {r}: the uniform number must be in [0, 1), got {}",
                p.uniform
            )
        })?;
    }
    let pool = crate::compute::cpu::pool()?;
    Ok(pool.install(|| {
        logits
            .par_chunks(vocab)
            .zip(params.par_iter().zip(histories.par_iter().zip(biases)))
            .map_init(Scratch::default, |scratch, (row, (p, (h, b)))| {
                // SAFETY: `isa` runs on this CPU (checked above).
                unsafe { sample_row_on(isa, row, p, h, b, scratch) }
            })
            .collect()
    }))
}

/// Buffers a thread reuses from row to row.
#[derive(Default)]
struct Scratch {
    values: Vec<f32>,
    weights: Vec<f32>,
    select: Vec<f32>,
    candidates: Vec<(u32, f32)>,
    ordered: Vec<(u32, f32)>,
    masked: Vec<f32>,
}

/// [`sample_row`] compiled for `isa`.
///
/// # Safety
/// `isa` runs on this CPU.
unsafe fn sample_row_on(
    isa: Isa,
    row: &[f32],
    p: &RowParams,
    history: &History<'_>,
    bias: &Bias<'_>,
    s: &mut Scratch,
) -> Sampled {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => simd::avx512(row, p, history, bias, s),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => simd::avx2(row, p, history, bias, s),
        _ => sample_row(row, p, history, bias, s),
    }
}

/// The row's passes compiled with wider vectors (everything [`sample_row`] calls is inlined).
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{sample_row, Bias, History, RowParams, Sampled, Scratch};

    /// [`sample_row`] compiled for `$features` as `$name`.
    macro_rules! compiled_for {
        ($name:ident, $features:literal) => {
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(
                row: &[f32],
                p: &RowParams,
                history: &History<'_>,
                bias: &Bias<'_>,
                s: &mut Scratch,
            ) -> Sampled {
                sample_row(row, p, history, bias, s)
            }
        };
    }

    compiled_for!(avx512, "avx512f,avx512bw,avx512vl,avx2,fma,f16c");
    compiled_for!(avx2, "avx2,fma,f16c");
}

#[inline(always)]
fn sample_row(
    row: &[f32],
    p: &RowParams,
    history: &History<'_>,
    bias: &Bias<'_>,
    s: &mut Scratch,
) -> Sampled {
    // A grammar's mask first: the disallowed tokens are -inf for everything that follows.
    let row = match bias.allowed {
        None => row,
        Some(mask) => {
            s.masked.clear();
            s.masked.extend(row.iter().enumerate().map(|(t, &x)| {
                if mask[t / 32] & (1 << (t % 32)) != 0 {
                    x
                } else {
                    f32::NEG_INFINITY
                }
            }));
            &s.masked[..]
        }
    };
    let (max, nan) = max_and_nan(row);
    if nan || max == f32::NEG_INFINITY {
        return Sampled {
            token: NO_TOKEN,
            logprob: f32::NAN,
            top: Vec::new(),
        };
    }
    let Scratch {
        values: buffer,
        weights,
        select,
        candidates,
        ordered,
        ..
    } = s;
    // The softmax's limit: the +inf tokens share all the mass; penalties and biases cannot tell
    // them apart.
    let infinite = max == f32::INFINITY;
    let penalized = !infinite
        && (!bias.tokens.is_empty()
            || (!history.tokens.is_empty()
                && (p.repetition_penalty != 1.0
                    || p.presence_penalty != 0.0
                    || p.frequency_penalty != 0.0)));
    buffer.clear();
    if infinite {
        buffer.extend(row.iter().map(|&x| {
            if x == f32::INFINITY {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        }));
    } else if penalized {
        buffer.extend_from_slice(row);
        apply_penalties(buffer, p, history);
        for (&token, &value) in bias.tokens.iter().zip(bias.values) {
            buffer[token as usize] += value;
        }
    }
    let (raw, raw_max) = if infinite {
        (&buffer[..], 0.0)
    } else {
        (row, max)
    };
    let (values, values_max) = match (infinite, penalized) {
        (false, false) => (row, max),
        (true, _) => (&buffer[..], 0.0),
        (false, true) => (&buffer[..], max_and_nan(buffer).0),
    };
    let log_normalizer = p
        .top_logprobs
        .map(|_| raw_max + log_sum_exp_shifted(raw, raw_max));
    let top = match (p.top_logprobs, log_normalizer) {
        // Tokens of probability 0 (a mask's -inf) are not among the most likely.
        (Some(n), Some(z)) if n > 0 => top_n(raw, n.min(raw.len()), select)
            .into_iter()
            .filter(|&(_, x)| x > f32::NEG_INFINITY)
            .map(|(i, x)| (i, x - z))
            .collect(),
        _ => Vec::new(),
    };
    let token = if p.temperature <= 0.0 {
        values.iter().position(|&x| x == values_max).unwrap_or(0)
    } else {
        draw(values, values_max, p, weights, select, candidates, ordered)
    };
    Sampled {
        token: token as i64,
        logprob: log_normalizer.map_or(f32::NAN, |z| raw[token] - z),
        top,
    }
}

/// The row's maximum (ignoring NaN) and whether it holds a NaN. Eight lanes, so it vectorises.
#[inline(always)]
fn max_and_nan(row: &[f32]) -> (f32, bool) {
    let mut max = [f32::NEG_INFINITY; 8];
    let mut nan = [0u32; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for j in 0..8 {
            max[j] = if chunk[j] > max[j] { chunk[j] } else { max[j] };
            nan[j] |= chunk[j].is_nan() as u32;
        }
    }
    let mut m = max.into_iter().fold(f32::NEG_INFINITY, f32::max);
    let mut n = nan.iter().any(|&x| x != 0);
    for &x in tail {
        m = if x > m { x } else { m };
        n |= x.is_nan();
    }
    (m, n)
}

/// `ln Σ exp(x - max)` over the row.
#[inline(always)]
fn log_sum_exp_shifted(row: &[f32], max: f32) -> f32 {
    let mut buf = [0.0f32; 1024];
    let mut sum = 0.0f64;
    for chunk in row.chunks(1024) {
        for (e, &x) in buf.iter_mut().zip(chunk) {
            *e = exp_nonpositive(x - max);
        }
        sum += vmath::sum(&buf[..chunk.len()]) as f64;
    }
    sum.ln() as f32
}

/// The `n` (≥ 1) largest values of `row` with their indices, by (value desc, index asc).
#[inline(always)]
fn top_n(row: &[f32], n: usize, buf: &mut Vec<f32>) -> Vec<(u32, f32)> {
    let kth = kth_largest(row, n, buf);
    let mut top: Vec<(u32, f32)> = row
        .iter()
        .enumerate()
        .filter(|&(_, &x)| x >= kth)
        .map(|(i, &x)| (i as u32, x))
        .collect();
    top.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    top.truncate(n);
    top
}

/// The k-th largest value of `row` (1 ≤ k ≤ len, no NaN). A strided sample of the row guesses a
/// value a little below it; one compare pass keeps the values above the guess (a few hundred at
/// k = 50 of 49,152), and a selection among those finds it. A guess too high (fewer than k kept)
/// falls back to a selection over the whole row, so the result is exact either way.
#[inline(always)]
fn kth_largest(row: &[f32], k: usize, buf: &mut Vec<f32>) -> f32 {
    const SAMPLE: usize = 1024;
    let len = row.len();
    let desc = |a: &f32, b: &f32| b.total_cmp(a);
    if len > 4 * SAMPLE && k < len / 8 {
        let stride = len / SAMPLE;
        buf.clear();
        buf.extend((0..SAMPLE).map(|j| row[j * stride]));
        let rank = k * SAMPLE * 4 / len + 16; // 4× the expected rank of the k-th, and 16 more
        if rank < SAMPLE {
            let guess = *buf.select_nth_unstable_by(rank, desc).1;
            buf.clear();
            buf.extend(row.iter().copied().filter(|&x| x >= guess));
            if buf.len() >= k {
                return *buf.select_nth_unstable_by(k - 1, desc).1;
            }
        }
    }
    buf.clear();
    buf.extend_from_slice(row);
    *buf.select_nth_unstable_by(k - 1, desc).1
}

#[inline(always)]
fn apply_penalties(values: &mut [f32], p: &RowParams, history: &History<'_>) {
    for (&token, &count) in history.tokens.iter().zip(history.counts) {
        let x = &mut values[token as usize];
        if p.repetition_penalty != 1.0 {
            *x = if *x > 0.0 {
                *x / p.repetition_penalty
            } else {
                *x * p.repetition_penalty
            };
        }
        if count > 0 {
            *x -= p.frequency_penalty * count as f32 + p.presence_penalty;
        }
    }
}

/// The last token top-p keeps, as (weight, index): a token is kept when its weight is above the
/// cut's, or equal with an index no larger.
type Cut = Option<(f32, u32)>;

#[inline(always)]
fn kept(cut: Cut, index: u32, weight: f32) -> bool {
    weight > 0.0 && cut.is_none_or(|(w, i)| weight > w || (weight == w && index <= i))
}

/// Draws a token from processed `values` (maximum `max`) under `p` (temperature > 0).
#[inline(always)]
fn draw(
    values: &[f32],
    max: f32,
    p: &RowParams,
    weights: &mut Vec<f32>,
    select: &mut Vec<f32>,
    candidates: &mut Vec<(u32, f32)>,
    ordered: &mut Vec<(u32, f32)>,
) -> usize {
    // A temperature below 1 / f32::MAX (a subnormal such as 1e-45 is a valid f32) would make
    // `1 / t` infinite and the maximum's weight `0 × ∞ = NaN`; clamped, the maximum keeps weight 1
    // and every lower value underflows to 0, which is the limit the temperature tends to.
    let inv_t = (1.0 / p.temperature).min(f32::MAX);
    let mut threshold = f32::NEG_INFINITY;
    if p.min_p > 0.0 {
        threshold = max + p.temperature * p.min_p.ln();
    }
    let top_k = p.top_k > 0 && p.top_k < values.len();
    if top_k {
        threshold = threshold.max(kth_largest(values, p.top_k, select));
    }
    if top_k || p.min_p > 0.0 {
        // Sparse: only the candidates at or above the threshold carry weight.
        candidates.clear();
        candidates.extend(
            values
                .iter()
                .enumerate()
                .filter(|&(_, &x)| x >= threshold)
                .map(|(i, &x)| (i as u32, exp_nonpositive((x - max) * inv_t))),
        );
        let cut = if p.top_p < 1.0 {
            let total = candidates.iter().map(|&(_, w)| w as f64).sum::<f64>();
            selected_cut(candidates, p.top_p as f64 * total, ordered)
        } else {
            None
        };
        return draw_among(candidates, cut, p.uniform);
    }
    // Dense: every token carries weight.
    weights.clear();
    weights.resize(values.len(), 0.0);
    for (w, &x) in weights.iter_mut().zip(values) {
        *w = exp_nonpositive((x - max) * inv_t);
    }
    if p.top_p < 1.0 && likely_tokens(weights, p.top_p, candidates) {
        let cut = selected_cut(candidates, p.top_p as f64 * sum_f64(weights), ordered);
        return draw_among(candidates, cut, p.uniform);
    }
    let cut = if p.top_p < 1.0 {
        histogram_cut(weights, p.top_p, candidates)
    } else {
        None
    };
    const CHUNK: usize = 256;
    let sums: Vec<f64> = weights
        .chunks(CHUNK)
        .enumerate()
        .map(|(c, chunk)| match cut {
            None => vmath::sum(chunk) as f64,
            Some(_) => chunk
                .iter()
                .enumerate()
                .filter(|&(j, &w)| kept(cut, (c * CHUNK + j) as u32, w))
                .map(|(_, &w)| w as f64)
                .sum(),
        })
        .collect();
    let target = p.uniform * sums.iter().sum::<f64>();
    let mut acc = 0.0f64;
    for (c, &sum) in sums.iter().enumerate() {
        if acc + sum <= target {
            acc += sum; // the target lies further on: skip the chunk
            continue;
        }
        for (j, &w) in weights[c * CHUNK..].iter().take(CHUNK).enumerate() {
            let i = c * CHUNK + j;
            if kept(cut, i as u32, w) {
                acc += w as f64;
                if acc > target {
                    return i;
                }
            }
        }
    }
    // Rounding put the target at the total: the last kept token.
    weights
        .iter()
        .enumerate()
        .rposition(|(i, &w)| kept(cut, i as u32, w))
        .unwrap_or(0)
}

/// Draws among `candidates` (index order; every kept token of the row among them): the first
/// kept one at which the running mass passes `uniform` × the kept mass.
#[inline(always)]
fn draw_among(candidates: &[(u32, f32)], cut: Cut, uniform: f64) -> usize {
    let total: f64 = candidates
        .iter()
        .filter(|&&(i, w)| kept(cut, i, w))
        .map(|&(_, w)| w as f64)
        .sum();
    let target = uniform * total;
    let mut acc = 0.0f64;
    let mut last = candidates[0].0;
    for &(i, w) in candidates.iter().filter(|&&(i, w)| kept(cut, i, w)) {
        acc += w as f64;
        last = i;
        if acc > target {
            break;
        }
    }
    last as usize
}

/// The sum of `weights` in f64, in 8 lanes so it vectorises (one sequential f64 sum of a row of
/// 49,152 is a chain of as many dependent adds).
#[inline(always)]
fn sum_f64(weights: &[f32]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let chunks = weights.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for j in 0..8 {
            lanes[j] += chunk[j] as f64;
        }
    }
    lanes.iter().sum::<f64>() + tail.iter().map(|&w| w as f64).sum::<f64>()
}

/// Into `candidates` (index, weight), in index order, the tokens top-p cannot cut past: those
/// weighing at least half the row's mean weight times `1 - top_p`. Together the others weigh
/// less than half of `1 - top_p` of the mass, so the smallest set of most likely tokens holding
/// `top_p` of it lies among the candidates. True when they are at most `MANY`, as on a model's
/// peaked rows (a few hundred); a flatter row has the histogram find its cut, which is faster
/// there than selecting among most of the row.
#[inline(always)]
fn likely_tokens(weights: &[f32], top_p: f32, candidates: &mut Vec<(u32, f32)>) -> bool {
    const MANY: usize = 4096;
    let total = vmath::sum(weights) as f64;
    let floor = (0.5 * (1.0 - top_p as f64) * total / weights.len() as f64) as f32;
    let likely = |w: f32| w >= floor && w > 0.0;
    // Counted first (a vectorised pass), so a flat row falls back before gathering.
    let count = weights.iter().filter(|&&w| likely(w)).count();
    if count > MANY {
        return false;
    }
    // Branch-free: every token is written and the end moves past the kept ones. (A filter's
    // branch, taken for a random fifth of a flat row, mispredicted for a quarter of top-p's time.)
    candidates.clear();
    candidates.resize(weights.len(), (0, 0.0));
    let mut end = 0;
    for (i, &w) in weights.iter().enumerate() {
        candidates[end] = (i as u32, w);
        end += usize::from(likely(w));
    }
    candidates.truncate(end);
    true
}

/// Top-p's cut at `target` mass over `candidates` (index, weight; every token it could keep
/// among them) in (weight desc, index asc) order, found by selection, not a sort: halve the range
/// around its median until the range the target falls in is small, then sort only that. Expected
/// linear in the candidates. `order` is scratch.
#[inline(always)]
fn selected_cut(candidates: &[(u32, f32)], target: f64, order: &mut Vec<(u32, f32)>) -> Cut {
    let first = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    order.clear();
    order.extend_from_slice(candidates);
    let (mut range, mut before) = (&mut order[..], 0.0f64);
    // Invariant: the mass before `range` is below the target, so its crossing is in `range` or,
    // if rounding never reaches the target, the range's last token.
    while range.len() > 32 {
        let mid = range.len() / 2;
        range.select_nth_unstable_by(mid, first);
        let upper: f64 = range[..mid].iter().map(|&(_, w)| w as f64).sum();
        if before + upper >= target {
            range = &mut range[..mid];
        } else {
            before += upper;
            range = &mut range[mid..];
        }
    }
    range.sort_unstable_by(first);
    cut_in_order(range, before, target)
}

/// The last of `ordered` (most likely first) whose mass before it, counted from `before`, is
/// below `target` (the last of all when rounding never reaches it).
#[inline(always)]
fn cut_in_order(ordered: &[(u32, f32)], before: f64, target: f64) -> Cut {
    let mut acc = before;
    let mut cut = None;
    for &(i, w) in ordered {
        if acc >= target || w == 0.0 {
            break;
        }
        cut = Some((w, i));
        acc += w as f64;
    }
    cut
}

/// Top-p's cut over a whole row of weights in (0, 1]: one pass sums the mass in bins of 1/16
/// octave (the float's exponent and 4 top mantissa bits, monotone in the weight), the bins are
/// walked from the top to the one where the mass reaches `top_p`, and only that bin's tokens are
/// sorted.
#[inline(always)]
fn histogram_cut(weights: &[f32], top_p: f32, bin_tokens: &mut Vec<(u32, f32)>) -> Cut {
    const SHIFT: u32 = 19;
    let bins = (1.0f32.to_bits() >> SHIFT) as usize + 1;
    let mut mass = vec![0.0f64; bins];
    for &w in weights {
        mass[(w.to_bits() >> SHIFT) as usize] += w as f64;
    }
    mass[0] = 0.0; // weights below 2^-125 (and zeros): probability 0 here
    let target = top_p as f64 * mass.iter().sum::<f64>();
    let mut acc = 0.0f64;
    for bin in (1..bins).rev() {
        if mass[bin] == 0.0 {
            continue;
        }
        if acc + mass[bin] >= target {
            bin_tokens.clear();
            bin_tokens.extend(
                weights
                    .iter()
                    .enumerate()
                    .filter(|&(_, &w)| (w.to_bits() >> SHIFT) as usize == bin)
                    .map(|(i, &w)| (i as u32, w)),
            );
            bin_tokens.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            return cut_in_order(bin_tokens, acc, target);
        }
        acc += mass[bin];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_p_by_selection_among_the_likely_tokens_is_the_sorted_cut() {
        // Rows from peaked (a model's: few candidates, selected among) to flat (most of the row:
        // the histogram), each cut against a full sort of the row.
        let (mut selected, mut flat) = (0, 0);
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for spread in [1000.0f32, 200.0, 20.0, 1.0, 0.0] {
            let weights: Vec<f32> = (0..49_152)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                    // Coarse values, so equal weights (ties broken by index) occur too.
                    exp_nonpositive(-spread * (u * 64.0).floor() / 64.0)
                })
                .collect();
            let mut sorted: Vec<(u32, f32)> =
                (0..weights.len() as u32).zip(weights.clone()).collect();
            sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let total = sum_f64(&weights);
            for top_p in [0.01f32, 0.5, 0.9, 0.95, 0.999] {
                let target = top_p as f64 * total;
                let (mut candidates, mut ordered) = (Vec::new(), Vec::new());
                if !likely_tokens(&weights, top_p, &mut candidates) {
                    let histogram = histogram_cut(&weights, top_p, &mut ordered);
                    assert_eq!(
                        histogram,
                        cut_in_order(&sorted, 0.0, target),
                        "spread {spread} top_p {top_p}"
                    );
                    flat += 1;
                    continue;
                }
                selected += 1;
                assert!(candidates.windows(2).all(|w| w[0].0 < w[1].0));
                let cut = selected_cut(&candidates, target, &mut ordered);
                assert_eq!(
                    cut,
                    cut_in_order(&sorted, 0.0, target),
                    "spread {spread} top_p {top_p}"
                );
                let (w, i) = cut.unwrap();
                assert!(candidates.contains(&(i, w)));
            }
        }
        assert!(
            selected > 0 && flat > 0,
            "{selected} cuts selected, {flat} by histogram"
        );
    }

    fn params(temperature: f32) -> RowParams {
        RowParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            uniform: 0.5,
            top_logprobs: None,
        }
    }

    #[test]
    fn kth_largest_matches_a_sort() {
        let row: Vec<f32> = (0..20_000u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 8) % 1000) as f32)
            .collect();
        let mut sorted = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let mut buf = Vec::new();
        for k in [1, 7, 50, 300, 2_000, 19_999, 20_000] {
            assert_eq!(kth_largest(&row, k, &mut buf), sorted[k - 1], "k = {k}");
        }
    }

    #[test]
    fn refuses_mismatched_shapes_and_bad_history() {
        let p = [params(1.0)];
        assert!(sample(&[0.0; 3], 4, &p, &[History::default()], &[Bias::default()]).is_err());
        let bad = History {
            tokens: &[4],
            counts: &[1],
        };
        assert!(sample(&[0.0; 4], 4, &p, &[bad], &[Bias::default()]).is_err());
        let p = [RowParams {
            uniform: 1.0,
            ..params(1.0)
        }];
        assert!(sample(&[0.0; 4], 4, &p, &[History::default()], &[Bias::default()]).is_err());
    }

    #[test]
    fn a_temperature_whose_inverse_overflows_samples_the_maximum() {
        let rows = [0.0, 2.0, 5.0, 1.0];
        for (top_k, min_p) in [(0, 0.0), (2, 0.0), (0, 0.5)] {
            let p = [RowParams {
                top_k,
                min_p,
                uniform: 0.999,
                ..params(1e-45)
            }];
            let out = sample(&rows, 4, &p, &[History::default()], &[Bias::default()]).unwrap();
            assert_eq!(out[0].token, 2, "top_k {top_k}, min_p {min_p}");
        }
    }

    #[test]
    fn a_logit_bias_moves_the_processed_logits_not_the_logprobs() {
        let row = [1.0, 3.0, 2.0, 0.0];
        let (tokens, values) = ([2, 1], [5.0, -100.0]);
        let bias = Bias {
            tokens: &tokens,
            values: &values,
            allowed: None,
        };
        let greedy = RowParams {
            top_logprobs: Some(1),
            ..params(0.0)
        };
        let out = sample(&row, 4, &[greedy], &[History::default()], &[bias]).unwrap();
        assert_eq!(out[0].token, 2); // 2 + 5 beats 3 - 100
        let raw_z = row.iter().map(|x: &f32| x.exp()).sum::<f32>().ln();
        assert!((out[0].logprob - (2.0 - raw_z)).abs() < 1e-5); // logprobs of the raw logits
        assert_eq!(out[0].top[0].0, 1);
        // Sampled rows never draw a token biased by -100 (weight e^-97 relative: underflows).
        for uniform in [0.0, 0.3, 0.6, 0.999] {
            let p = RowParams {
                uniform,
                ..params(1.0)
            };
            let out = sample(&row, 4, &[p], &[History::default()], &[bias]).unwrap();
            assert_ne!(out[0].token, 1, "uniform {uniform}");
        }
        let outside = Bias {
            tokens: &[4],
            values: &[1.0],
            allowed: None,
        };
        assert!(sample(&row, 4, &[greedy], &[History::default()], &[outside]).is_err());
        let infinite = Bias {
            tokens: &[0],
            values: &[f32::INFINITY],
            allowed: None,
        };
        assert!(sample(&row, 4, &[greedy], &[History::default()], &[infinite]).is_err());
    }

    #[test]
    fn a_mask_keeps_its_row_to_the_allowed_tokens_and_leaves_the_others_as_they_were() {
        let vocab = 40;
        let rows: Vec<f32> = (0..2 * vocab)
            .map(|i| ((i * 7) % 13) as f32 * 0.3)
            .collect();
        let allowed = [(1u32 << 3) | (1 << 20), 1 << (37 - 32)]; // tokens 3, 20 and 37
        let masked = Bias {
            allowed: Some(&allowed),
            ..Bias::default()
        };
        let histories = [History::default(); 2];
        for isa in Isa::available_of(&ISAS) {
            for uniform in [0.0, 0.2, 0.5, 0.8, 0.999] {
                let p = RowParams {
                    uniform,
                    top_logprobs: Some(3),
                    ..params(1.0)
                };
                let both = sample_with(
                    isa,
                    &rows,
                    vocab,
                    &[p, p],
                    &histories,
                    &[masked, Bias::default()],
                )
                .unwrap();
                assert!([3, 20, 37].contains(&both[0].token), "{isa:?} {uniform}");
                // Logprobs over the allowed tokens only; the top ones are among them.
                let kept = [3, 20, 37].map(|t| rows[t]);
                let z = kept.iter().map(|x| x.exp()).sum::<f32>().ln();
                let token = both[0].token as usize;
                assert!((both[0].logprob - (rows[token] - z)).abs() < 1e-5);
                assert!(both[0].top.iter().all(|&(t, _)| [3, 20, 37].contains(&t)));
                // The unmasked row beside it: as if sampled alone.
                let alone = sample_with(
                    isa,
                    &rows[vocab..],
                    vocab,
                    &[p],
                    &histories[..1],
                    &[Bias::default()],
                )
                .unwrap();
                assert_eq!(both[1], alone[0]);
            }
        }
        let short = Bias {
            allowed: Some(&allowed[..1]),
            ..Bias::default()
        };
        let greedy = params(0.0);
        assert!(sample(&rows[..vocab], vocab, &[greedy], &histories[..1], &[short]).is_err());
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_nan_gives_no_token() {
        let rows = [0.0, 3.0, 3.0, 1.0, 0.0, f32::NAN, 1.0, 2.0];
        let out = sample(
            &rows,
            4,
            &[params(0.0); 2],
            &[History::default(); 2],
            &[Bias::default(); 2],
        )
        .unwrap();
        assert_eq!(out[0].token, 1);
        assert_eq!(out[1].token, NO_TOKEN);
    }

    #[test]
    fn every_path_samples_the_same_bits() {
        let vocab = 5000;
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let kinds = [
            params(0.0),
            params(0.7),
            RowParams {
                top_k: 40,
                ..params(1.0)
            },
            RowParams {
                top_p: 0.9,
                ..params(0.8)
            },
            RowParams {
                min_p: 0.05,
                top_p: 0.95,
                top_k: 50,
                ..params(1.2)
            },
            RowParams {
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                frequency_penalty: 0.2,
                ..params(0.9)
            },
        ];
        let mut rows = Vec::new();
        for kind in &kinds {
            for j in 0..4 {
                let uniform = f64::from(next()).min(0.999);
                let top_logprobs = if j % 2 == 0 { Some(5) } else { None };
                rows.push(RowParams {
                    uniform,
                    top_logprobs,
                    ..*kind
                });
            }
        }
        let logits: Vec<f32> = (0..rows.len() * vocab)
            .map(|_| next() * 12.0 - 6.0)
            .collect();
        let tokens = [1, 7, 4999];
        let counts = [0, 2, 1];
        let histories = vec![
            History {
                tokens: &tokens,
                counts: &counts
            };
            rows.len()
        ];
        let biases = vec![Bias::default(); rows.len()];
        let portable =
            sample_with(Isa::Portable, &logits, vocab, &rows, &histories, &biases).unwrap();
        for isa in Isa::available_of(&ISAS) {
            let other = sample_with(isa, &logits, vocab, &rows, &histories, &biases).unwrap();
            for (a, b) in portable.iter().zip(&other) {
                assert_eq!(a.token, b.token, "{isa:?}");
                assert_eq!(a.logprob.to_bits(), b.logprob.to_bits(), "{isa:?}");
                assert_eq!(a.top.len(), b.top.len());
                for (x, y) in a.top.iter().zip(&b.top) {
                    assert_eq!((x.0, x.1.to_bits()), (y.0, y.1.to_bits()), "{isa:?}");
                }
            }
        }
        assert!(sample_with(Isa::Avx512Vnni, &logits, vocab, &rows, &histories, &biases).is_err());
    }
}
