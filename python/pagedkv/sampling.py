"""Choosing the next token: :class:`SamplingParams` (per request), :class:`TokenHistory` (per
sample, for the penalties) and :func:`sample` (per step).

The work is the Rust kernel ``pagedkv._core.sample_rows`` (``src/compute/sampling.rs``), rows in parallel
on the worker pool: numpy needed a full sort per row for top-p (191 ms for 16 × 49,152 logits)
and ~29 ms for plain temperature. What a row goes through, in order:

0. a grammar's mask (:class:`RowMasks`, a constrained request's: ``structured_outputs``): the
   tokens it does not allow become -inf, for everything below, logprobs included;
1. penalties on the logits: repetition (HF/vLLM: a positive logit of a token in the prompt or the
   output divided by it, a negative one multiplied), then frequency × the token's output count and
   presence × (count > 0) subtracted (OpenAI), then the request's ``logit_bias`` added (OpenAI's);
2. greedy (``temperature == 0``) takes the first maximum; otherwise the logits are divided by the
   temperature, ``top_k`` keeps those at least the k-th largest (ties kept), ``min_p`` those with a
   probability at least min_p × the top one's, and ``top_p``, over what is left renormalised, the
   smallest most-likely set whose probability reaches top_p (ties by lower token id);
3. one uniform number from the sample's own generator picks the token by inverse CDF in token-id
   order, so a seeded request gives the same tokens whatever else shares its batch.

Logprobs (``logprobs=True``) are the log-softmax of the model's raw logits, before penalties,
temperature and filters (what vLLM reports by default), masked by a grammar if the row has one
(an alternative the grammar forbids is never listed): the chosen token's, and the
``top_logprobs`` most likely with theirs.

Non-finite logits: a row holding +inf draws uniformly among its +inf tokens (the limit of the
softmax), greedy takes the first of them; a row holding a NaN, or only -inf, has no token to give
and gets :data:`NO_TOKEN` (the engine fails that request alone).

A batch the kernel refuses (a row's parameters it cannot take: ``SamplingParams`` should have
refused them) is sampled again row by row; a row refused alone gets :data:`NO_TOKEN` and its
reason in :attr:`Samples.refused`, the others their tokens (the engine fails that request alone).

:class:`SamplingParams` checks only what the sampler uses and ``stop``; ``max_tokens``, ``n``,
``stop_token_ids`` and ``ignore_eos`` are the scheduler's, checked by it when the request is
submitted.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import pagedkv._core as _core
from pagedkv.errors import InvalidArgumentError, ShapeError
from pagedkv.grammar.spec import StructuredOutputs

__all__ = [
    "MAX_LOGIT_BIAS", "MAX_LOGIT_BIAS_TOKENS", "MAX_STOP_STRING_CHARS", "MAX_STOP_STRINGS", "MAX_TOP_LOGPROBS",
    "NO_TOKEN", "PromptScores", "RowMasks", "SamplingParams", "Samples",
    "TokenHistory", "sample", "sample_with_logprobs",
]

NO_TOKEN = -1  # what `sample` gives a row with nothing to draw from (NaN, or only -inf)


MAX_TOP_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's bound)

# A logit bias: at most this many tokens, each biased within ±MAX_LOGIT_BIAS (OpenAI's range: -100
# bans a token in practice, +100 forces it). The kernel's cost is one add per biased token.
MAX_LOGIT_BIAS_TOKENS = 1024
MAX_LOGIT_BIAS = 100.0

# Stop strings a request may give, and their length. OpenAI takes 4; clients such as lm-eval send a
# handful of few-character strings. The matcher's cost per character does not grow with either
# (an Aho-Corasick automaton); the bounds keep the automaton built per request small (4,096 states).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    - ``max_tokens``: most tokens to generate (≥ 1, checked by the scheduler).
    - ``temperature``: 0 for greedy (argmax), else > 0; higher flattens the distribution.
    - ``top_k``: keep the k most likely tokens; 0, or any k at least the vocabulary's size,
      keeps all.
    - ``top_p``: keep the smallest most-likely set whose probability reaches top_p, in (0, 1].
    - ``min_p``: keep tokens at least min_p × as likely as the most likely, in [0, 1]; 0 keeps all.
    - ``presence_penalty``, ``frequency_penalty``: in [-2, 2]; subtracted from the logit of each
      token already generated, once / per occurrence (OpenAI).
    - ``repetition_penalty``: > 0; 1 is off; divides the positive and multiplies the negative
      logits of tokens in the prompt or the output (HF).
    - ``logprobs``: report each token's logprob; ``top_logprobs``: and that many most likely
      alternatives (0 to :data:`MAX_TOP_LOGPROBS`; needs ``logprobs``).
    - ``seed``: seeds the request's generator; None draws from fresh OS entropy.
    - ``stop_token_ids``: generation ends after producing one of these (it is kept in the output).
    - ``stop``: strings (one, or a sequence) that end generation when the decoded text contains
      one, across token boundaries; the text then ends before it (OpenAI's semantics; the tokens
      keep the one that completed it) and ``finish_reason`` is "stop". Matched by the engine core
      (:class:`~pagedkv.text.detokenizer.StopStringMatcher`; the one completing first wins);
      at most :data:`MAX_STOP_STRINGS`, each a non-empty string of at most
      :data:`MAX_STOP_STRING_CHARS` characters.
    - ``ignore_eos``: do not stop at the model's end-of-sequence tokens.
    - ``n``: independent samples of the same prompt (parallel sampling, sharing the prompt's
      blocks; ≥ 1 and at most the scheduler's ``max_num_seqs``, checked by the scheduler).
    - ``prompt_logprobs``: None, or report each prompt token's logprob given the tokens before
      it with that many most likely alternatives (0 to :data:`MAX_TOP_LOGPROBS`; vLLM's). Such a
      request shares no cached prefix: its prompt is computed whole
      (:mod:`pagedkv.engine.prompt_scoring`).
    - ``logit_bias``: token id → a value in [-100, 100] added to its logit after the penalties
      (OpenAI's); at most :data:`MAX_LOGIT_BIAS_TOKENS` tokens, each below the vocabulary's size
      (checked when sampled: a token past it fails the request). Kept as sorted (token, value)
      pairs. Logprobs stay those of the raw logits.
    - ``structured_outputs``: None, or what every sample's text must match
      (:class:`~pagedkv.grammar.StructuredOutputs`: a JSON schema, a regex, choices, a Lark
      grammar). The engine compiles it when the request is submitted (an invalid one is refused
      then) and masks, at every step, the tokens that would leave it: before penalties, filters and
      logprobs. A sample whose output the grammar completes ends ("stop").

    The float parameters must be numbers a float64 holds exactly (the kernel's parameter matrix
    is float64): an int past 2**53, or past the float range, is refused.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    stop: tuple[str, ...] = ()
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        def is_int(value: object) -> bool:
            return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

        def number_in(name: str, low: float, high: float, low_open: bool = False) -> None:
            value = getattr(self, name)
            bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
            ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
            x = _float64(name, value) if ok else math.nan
            if not math.isfinite(x) or x > high or x < low or (low_open and x == low):
                raise InvalidArgumentError(f"{name} must be a number in {bound}, got {value!r}")

        number_in("temperature", 0.0, math.inf)
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an integer ≥ 0 (0 disables it), got {self.top_k!r}")
        number_in("top_p", 0.0, 1.0, low_open=True)
        number_in("min_p", 0.0, 1.0)
        number_in("presence_penalty", -2.0, 2.0)
        number_in("frequency_penalty", -2.0, 2.0)
        number_in("repetition_penalty", 0.0, math.inf, low_open=True)
        if not isinstance(self.logprobs, bool):
            raise InvalidArgumentError(f"logprobs must be a bool, got {self.logprobs!r}")
        if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgumentError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise InvalidArgumentError("top_logprobs needs logprobs=True")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            raise InvalidArgumentError(
                f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs!r}"
            )
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise InvalidArgumentError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))  # frozen: hashable
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidArgumentError(f"stop must be a non-empty string or a sequence of them, got {self.stop!r:.80}")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise InvalidArgumentError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters each"
            )
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise InvalidArgumentError(
                f"structured_outputs must be None or StructuredOutputs, got {type(self.structured_outputs).__name__}"
            )

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the sample then needs a :class:`TokenHistory`)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def make_generator(self, sample_index: int = 0) -> np.random.Generator:
        """The random generator of sample ``sample_index`` (0..n-1) of a request: with a seed,
        a stream determined by (seed, sample_index); without, fresh entropy."""
        if self.seed is None:
            return np.random.default_rng()
        return np.random.default_rng([self.seed, sample_index])


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``bias`` (a mapping or (token, value) pairs) as sorted pairs, or :class:`InvalidArgumentError`."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(pairs, (tuple, list, type({}.items()))):
        raise InvalidArgumentError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    checked: dict[int, float] = {}
    for pair in pairs:
        token, value = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
        if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or not 0 <= token < 2**31:
            raise InvalidArgumentError(f"logit_bias keys must be token ids (integers ≥ 0), got {token!r}")
        ok = isinstance(value, (int, float, np.number)) and not isinstance(value, bool)
        x = _float64("logit_bias", value) if ok else math.nan  # type: ignore[arg-type]
        if not -MAX_LOGIT_BIAS <= x <= MAX_LOGIT_BIAS:
            raise InvalidArgumentError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
        checked[int(token)] = x
    if len(checked) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidArgumentError(f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(checked)}")
    return tuple(sorted(checked.items()))


def _float64(name: str, value: float | int | np.number) -> float:
    """``value`` as the float64 the sampling kernel's parameter matrix holds it, or
    :class:`InvalidArgumentError` for an integer a float64 cannot hold exactly (past 2**53, or
    past the float range: ``float`` raises OverflowError)."""
    try:
        x = float(value)
    except OverflowError:
        raise InvalidArgumentError(f"{name} {value!r} does not fit a float64") from None
    if isinstance(value, (int, np.integer)) and int(value) != x:
        raise InvalidArgumentError(f"{name} {value!r} is not exactly a float64 (integers past 2**53 are rounded)")
    return x


class TokenHistory:
    """The tokens one sample's penalties look at: each distinct token of the prompt (for the
    repetition penalty; built once, O(prompt)) and of the output, with its output count. Appending
    a token costs O(1) amortised; a step hands the kernel views, never re-scanning the context."""

    def __init__(self, prompt_token_ids: Sequence[int], with_prompt: bool = True) -> None:
        ids = np.unique(np.asarray(prompt_token_ids, dtype=np.int32)) if with_prompt else np.empty(0, np.int32)
        self._size = len(ids)
        self._tokens = np.zeros(max(16, 2 * self._size), dtype=np.int32)
        self._counts = np.zeros_like(self._tokens)
        self._tokens[: self._size] = ids
        self._where = dict(zip(ids.tolist(), range(self._size), strict=True))

    def append(self, token: int) -> None:
        """Counts one generated token."""
        slot = self._where.get(token)
        if slot is None:
            if self._size == len(self._tokens):
                self._tokens = np.concatenate([self._tokens, np.zeros_like(self._tokens)])
                self._counts = np.concatenate([self._counts, np.zeros_like(self._counts)])
            slot = self._where[token] = self._size
            self._tokens[slot] = token
            self._size += 1
        self._counts[slot] += 1

    def copy(self) -> TokenHistory:
        """An independent history with the same tokens and counts (the n samples of a request
        start from one built once from the prompt)."""
        twin = TokenHistory.__new__(TokenHistory)
        twin._size = self._size
        twin._tokens = self._tokens.copy()
        twin._counts = self._counts.copy()
        twin._where = dict(self._where)
        return twin

    @property
    def tokens(self) -> np.ndarray:
        """Each distinct token once (int32 view)."""
        return self._tokens[: self._size]

    @property
    def counts(self) -> np.ndarray:
        """Each token's count in the output (0: prompt only; int32 view)."""
        return self._counts[: self._size]


@dataclass(frozen=True)
class PromptScores:
    """Scores of prompt tokens (:mod:`pagedkv.engine.prompt_scoring`): ``logprobs`` float32
    ``[R]`` of each scored token; ``top_ids`` int64 and ``top_logprobs`` float32 ``[R, top]``,
    the most likely tokens at its position."""

    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass(frozen=True)
class Samples:
    """What :func:`sample` gives: ``tokens`` int64 ``[rows]`` (:data:`NO_TOKEN` for a row with
    nothing to draw from); ``logprobs`` float32 ``[rows]`` (NaN for a row that asked for none);
    ``top_ids`` int64 and ``top_logprobs`` float32 ``[rows, n]`` (n the largest ``top_logprobs``
    asked; a row's unused entries -1 and NaN); ``refused``: the rows the kernel refused to sample
    (their token :data:`NO_TOKEN`), by row, with its reason; ``prompt_scores``: the prompt
    positions' scores a runner was asked for in the same step."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    refused: Mapping[int, str] = field(default_factory=dict)
    prompt_scores: PromptScores | None = None

    @classmethod
    def certain(cls, tokens: np.ndarray, params: Sequence[SamplingParams], masks: RowMasks | None = None) -> Samples:
        """``tokens`` drawn with probability 1, for a runner that picks them without logits (a
        simulated or scripted model): a row that asked for logprobs gets 0 for its token, and its
        token as its only alternative. A row of ``masks`` whose token its mask does not allow
        takes the lowest one it does (:data:`NO_TOKEN` if none: refused, with a failed grammar's
        reason)."""
        tokens = np.array(tokens, dtype=np.int64)
        refused: dict[int, str] = {}
        if masks is not None:
            for row, words in zip(masks.rows.tolist(), masks.words, strict=True):
                allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
                if tokens[row] not in allowed:
                    tokens[row] = allowed[0] if len(allowed) else NO_TOKEN
            refused = {row: why for row, why in masks.errors.items()}
            empty = [row for row in masks.rows.tolist() if tokens[row] == NO_TOKEN and row not in refused]
            refused |= dict.fromkeys(empty, "its grammar allows no token")
        asked = np.array([p.logprobs for p in params], dtype=bool)
        width = max((p.top_logprobs for p in params), default=0)
        with_top = np.array([p.top_logprobs > 0 for p in params], dtype=bool)
        top_ids = np.full((len(tokens), width), -1, dtype=np.int64)
        top_logprobs = np.full((len(tokens), width), np.nan, dtype=np.float32)
        if width:
            top_ids[with_top, 0] = tokens[with_top]
            top_logprobs[with_top, 0] = 0.0
        return cls(tokens, np.where(asked, 0.0, np.nan).astype(np.float32), top_ids, top_logprobs, refused)


def sample(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    generators: Sequence[np.random.Generator],
    histories: Sequence[TokenHistory | None] | None = None,
    masks: RowMasks | Mapping[int, np.ndarray] | None = None,
) -> np.ndarray:
    """The tokens of :func:`sample_with_logprobs` (int64 ``[rows]``)."""
    return sample_with_logprobs(logits, params, generators, histories, masks).tokens


def sample_with_logprobs(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    generators: Sequence[np.random.Generator],
    histories: Sequence[TokenHistory | None] | None = None,
    masks: RowMasks | Mapping[int, np.ndarray] | None = None,
) -> Samples:
    """Samples each row of ``logits`` ``[rows, vocab]`` under ``params[row]``, drawing one
    uniform number from ``generators[row]`` (greedy rows draw nothing) and penalising by
    ``histories[row]`` (None: no history, so no penalty applies). ``masks`` (a :class:`RowMasks`,
    or by row a bool array over the vocabulary, as :meth:`pagedkv._core.GrammarMatcher.allowed`
    gives) keep their rows to the tokens they allow, before penalties, filters and logprobs; other
    rows are untouched. A row whose grammar failed (:attr:`RowMasks.errors`) is refused."""
    logits = np.asarray(logits)
    rows = len(params)
    histories = [None] * rows if histories is None else list(histories)
    if logits.ndim != 2 or logits.shape[0] != rows or rows != len(generators) or rows != len(histories):
        raise ShapeError(
            f"logits {logits.shape}, {rows} params, {len(generators)} generators and "
            f"{len(histories)} histories must agree in rows"
        )
    vocab = logits.shape[1]
    table = np.empty((rows, len(_COLUMNS)), dtype=np.float64)
    for r, (p, g) in enumerate(zip(params, generators, strict=True)):
        table[r] = [getattr(p, name) for name in _PARAM_COLUMNS] + [
            0.0 if p.greedy else g.random(),
            p.top_logprobs if p.logprobs else -1,
        ]
        # Any k ≥ vocab keeps all; the kernel takes k as a count (< 2**32), so it gets at most vocab.
        table[r, _TOP_K] = min(p.top_k, vocab)
    present = [h for h in histories if h is not None]
    offsets = np.zeros(rows + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([0 if h is None else len(h.tokens) for h in histories])
    tokens = np.concatenate([h.tokens for h in present]) if present else np.empty(0, np.int32)
    counts = np.concatenate([h.counts for h in present]) if present else np.empty(0, np.int32)
    if masks is not None and not isinstance(masks, RowMasks):
        masks = RowMasks.from_bools(masks, rows, vocab)
    bias = _BiasRows(params, masks)
    logits = logits.astype(np.float32, copy=False)
    try:
        samples = Samples(*_core.sample_rows(logits, table, offsets, tokens, counts, *bias.arrays()))
    except ShapeError:
        raise  # the arrays disagree: the caller's bug, not one row's
    except InvalidArgumentError:
        samples = _sample_rows_alone(logits, table, offsets, tokens, counts, bias)
    if masks is not None and masks.errors:  # a failed grammar's row has an empty mask: no token
        samples = dataclasses.replace(samples, refused={**samples.refused, **masks.errors})
    return samples


@dataclass(frozen=True)
class RowMasks:
    """Grammar masks of some rows of a batch: ``words`` uint32 ``[k, ceil(vocab / 32)]`` (bit
    ``t % 32`` of word ``t // 32`` set when token ``t`` may come next) for rows ``rows`` int64
    ``[k]`` (distinct); ``errors``: rows whose grammar failed, by row, with why (they are refused:
    :attr:`Samples.refused`)."""

    words: np.ndarray
    rows: np.ndarray
    errors: Mapping[int, str] = field(default_factory=dict)

    @classmethod
    def from_bools(cls, masks: Mapping[int, np.ndarray], rows: int, vocab: int) -> RowMasks:
        """Each row's bool mask over the vocabulary (``masks[row]``), packed."""
        packed = []
        for row, mask in sorted(masks.items()):
            mask = np.asarray(mask)
            if mask.dtype != np.bool_ or mask.shape != (vocab,) or not 0 <= row < rows:
                raise ShapeError(f"masks[{row}] must be a bool array of {vocab} for a row below {rows}")
            bits = np.zeros(-(-vocab // 32) * 32, dtype=np.bool_)
            bits[:vocab] = mask
            packed.append(np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32))
        words = np.stack(packed) if packed else np.empty((0, -(-vocab // 32)), dtype=np.uint32)
        return cls(words, np.array(sorted(masks), dtype=np.int64))

    def of_row(self, row: int) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
        """The kernel's mask arguments for ``row`` sampled alone."""
        where = np.flatnonzero(self.rows == row)
        return (self.words[where], np.zeros(1, dtype=np.int64)) if len(where) else (None, None)


class _BiasRows:
    """The rows' logit biases in the kernel's CSR form, and their grammar masks (packed)."""

    def __init__(self, params: Sequence[SamplingParams], masks: RowMasks | None) -> None:
        self.offsets = np.zeros(len(params) + 1, dtype=np.int64)
        self.offsets[1:] = np.cumsum([len(p.logit_bias) for p in params])
        pairs = [pair for p in params for pair in p.logit_bias]  # type: ignore[union-attr]
        self.tokens = np.array([t for t, _ in pairs], dtype=np.int32)
        self.values = np.array([v for _, v in pairs], dtype=np.float32)
        self.masks = masks

    def arrays(self, row: int | None = None) -> tuple[np.ndarray, ...] | tuple[Any, ...]:
        """Every row's, or ``row``'s alone: the kernel's bias and mask arguments."""
        masks = self.masks
        if row is None:
            given = masks is not None and len(masks.rows) > 0
            return self.offsets, self.tokens, self.values, *((masks.words, masks.rows) if given else (None, None))
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        mask = (None, None) if masks is None else masks.of_row(row)
        return np.array([0, end - start], dtype=np.int64), self.tokens[start:end], self.values[start:end], *mask


def _sample_rows_alone(
    logits: np.ndarray, table: np.ndarray, offsets: np.ndarray, tokens: np.ndarray, counts: np.ndarray, bias: _BiasRows
) -> Samples:
    """The kernel refused a batch (a row's parameters it cannot take, which ``SamplingParams``
    should have refused): samples each row alone, from the same table (so each row's uniform
    number is the one drawn for it), and marks the rows the kernel refuses again
    (:attr:`Samples.refused`, token :data:`NO_TOKEN`) instead of failing the rest."""
    rows, vocab = logits.shape
    width = min(vocab, max(0, int(table[:, -1].max(initial=0))))
    tokens_out = np.full(rows, NO_TOKEN, dtype=np.int64)
    logprobs_out = np.full(rows, np.nan, dtype=np.float32)
    top_ids_out = np.full((rows, width), -1, dtype=np.int64)
    top_logprobs_out = np.full((rows, width), np.nan, dtype=np.float32)
    refused: dict[int, str] = {}
    for r in range(rows):
        start, end = int(offsets[r]), int(offsets[r + 1])
        history_offsets = np.array([0, end - start], dtype=np.int64)
        try:
            token, logprob, top_ids, top_logprobs = _core.sample_rows(
                logits[r : r + 1], table[r : r + 1], history_offsets, tokens[start:end], counts[start:end], *bias.arrays(r)
            )
        except ShapeError:
            raise
        except InvalidArgumentError as error:
            refused[r] = str(error)
            continue
        tokens_out[r], logprobs_out[r] = token[0], logprob[0]
        top_ids_out[r, : top_ids.shape[1]], top_logprobs_out[r, : top_logprobs.shape[1]] = top_ids[0], top_logprobs[0]
    return Samples(tokens_out, logprobs_out, top_ids_out, top_logprobs_out, refused)


_COLUMNS: tuple[str, ...] = tuple(_core.SAMPLING_COLUMNS)
_PARAM_COLUMNS = _COLUMNS[:-2]  # the kernel's last two: the row's uniform number, its top_logprobs
assert _COLUMNS[-2:] == ("uniform", "top_logprobs"), _COLUMNS
_TOP_K = _COLUMNS.index("top_k")
assert NO_TOKEN == _core.NO_TOKEN
