"""Choosing the next token: :class:`SamplingParams` (per request) and :func:`sample` (per step).

Greedy when ``temperature == 0``; otherwise the logits are divided by the temperature, cut to the
``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p`` (nucleus),
renormalised, and drawn from with the request's own random generator, so a seeded request gives
the same tokens whatever else shares its batch.

Non-finite logits: a row holding +inf draws uniformly among its +inf tokens (the limit of the
softmax), greedy takes the first of them; a row holding a NaN, or only -inf, has no token to give
and gets :data:`NO_TOKEN` (the engine fails that request alone).

:class:`SamplingParams` checks only what the sampler uses (temperature, top_k, top_p, seed);
``max_tokens``, ``n``, ``stop_token_ids`` and ``ignore_eos`` are the scheduler's, checked by it
when the request is submitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from pagedkv.errors import InvalidArgumentError, ShapeError

__all__ = ["NO_TOKEN", "SamplingParams", "sample"]

NO_TOKEN = -1  # what `sample` gives a row with nothing to draw from (NaN, or only -inf)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    - ``max_tokens``: most tokens to generate (≥ 1, checked by the scheduler).
    - ``temperature``: 0 for greedy (argmax), else > 0; higher flattens the distribution.
    - ``top_k``: keep the k most likely tokens; 0 keeps all.
    - ``top_p``: keep the smallest most-likely set whose probability reaches top_p, in (0, 1].
    - ``seed``: seeds the request's generator; None draws from fresh OS entropy.
    - ``stop_token_ids``: generation ends after producing one of these (it is kept in the output).
    - ``ignore_eos``: do not stop at the model's end-of-sequence tokens.
    - ``n``: independent samples of the same prompt (parallel sampling, sharing the prompt's
      blocks; ≥ 1 and at most the scheduler's ``max_num_seqs``, checked by the scheduler).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        def is_int(value: object) -> bool:
            return isinstance(value, (int, np.integer)) and not isinstance(value, bool)

        if not isinstance(self.temperature, (int, float)) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgumentError(f"temperature must be a finite number ≥ 0, got {self.temperature!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an integer ≥ 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise InvalidArgumentError(f"seed must be a non-negative integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))  # frozen: hashable

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax."""
        return self.temperature == 0

    def make_generator(self, sample_index: int = 0) -> np.random.Generator:
        """The random generator of sample ``sample_index`` (0..n-1) of a request: with a seed,
        a stream determined by (seed, sample_index); without, fresh entropy."""
        if self.seed is None:
            return np.random.default_rng()
        return np.random.default_rng([self.seed, sample_index])


def sample(
    logits: np.ndarray, params: Sequence[SamplingParams], generators: Sequence[np.random.Generator]
) -> np.ndarray:
    """Next token of each row of ``logits`` ``[rows, vocab]`` under ``params[row]``, drawing from
    ``generators[row]`` (greedy rows draw nothing). Returns int64 ``[rows]``, :data:`NO_TOKEN` for
    a row with a NaN or without a logit above -inf.

    Rows are processed together: one argmax for the greedy rows, one sort and cumulative sum for
    the rows with top-k or top-p, one softmax for the rest; only the single uniform draw per row
    goes through its own generator.
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ShapeError(
            f"logits {logits.shape}, {len(params)} params and {len(generators)} generators must agree in rows"
        )
    rows, vocab = logits.shape
    peak = logits.max(axis=1)  # NaN wins a max: one pass finds the NaN and the infinite rows
    failed = np.isnan(peak) | (peak == -np.inf)
    infinite = peak == np.inf
    if failed.any() or infinite.any():
        logits = np.array(logits, dtype=np.float64)
        logits[infinite] = np.where(logits[infinite] == np.inf, 0.0, -np.inf)
        logits[failed] = 0.0  # any finite row: its token is replaced below
    tokens = np.empty(rows, dtype=np.int64)
    temperature = np.array([p.temperature for p in params], dtype=np.float64)
    greedy = temperature == 0
    tokens[greedy] = np.argmax(logits[greedy], axis=1)

    top_k = np.array([p.top_k for p in params], dtype=np.int64)
    top_p = np.array([p.top_p for p in params], dtype=np.float64)
    truncated = ~greedy & ((top_k > 0) & (top_k < vocab) | (top_p < 1.0))
    plain = ~greedy & ~truncated

    if plain.any():
        probs = _softmax(logits[plain] / temperature[plain, None])
        tokens[plain] = _draw(probs, [generators[i] for i in np.flatnonzero(plain).tolist()])
    if truncated.any():
        scaled = logits[truncated] / temperature[truncated, None]
        order = np.argsort(-scaled, axis=1, kind="stable")  # most likely first
        ranked = np.take_along_axis(scaled, order, axis=1)
        k = np.where(top_k[truncated] > 0, top_k[truncated], vocab)
        ranked[np.arange(vocab)[None, :] >= k[:, None]] = -np.inf
        probs = _softmax(ranked)
        mass_before = np.cumsum(probs, axis=1) - probs
        probs[mass_before >= top_p[truncated, None]] = 0.0  # the most likely token always stays
        picked = _draw(probs, [generators[i] for i in np.flatnonzero(truncated).tolist()])
        tokens[truncated] = order[np.arange(len(picked)), picked]
    tokens[failed] = NO_TOKEN
    return tokens


def _softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 (``-inf`` entries get probability 0)."""
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _draw(probs: np.ndarray, generators: Sequence[np.random.Generator]) -> np.ndarray:
    """One index per row of ``probs`` (rows need not be normalised), by inverse CDF with one
    uniform number from each row's generator."""
    cdf = np.cumsum(probs, axis=1)
    u = np.array([g.random() for g in generators]) * cdf[:, -1]
    picked = (cdf <= u[:, None]).sum(axis=1)
    # rounding can make u equal the total: fall back to the last token with probability > 0
    return np.minimum(picked, np.argmax(cdf >= cdf[:, -1:], axis=1))
