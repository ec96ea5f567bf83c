"""Prompt logprobs: the log-probability of each prompt token given the tokens before it, with the
most likely alternatives, from the logits at the prompt's positions while its prefill runs (what
``echo`` with ``logprobs`` and vLLM's ``prompt_logprobs`` report, and what lm-eval scores with).

Invariants:

- Position ``p``'s logits score prompt token ``p + 1``; a prompt of ``L`` tokens has ``L - 1``
  scores (token 0 has none: ``None`` in :attr:`RequestOutput.prompt_logprobs`).
- Scores are recomputed, never cached: a request asking for them shares no block with another
  request's prefix (its cache salt is its own, :func:`scoring_salt`), so every position of its
  prompt runs through the model. The cost is the prefill a prefix hit would have saved, plus the
  output projection at every prompt position (SmolLM2: 576 × 49,152 multiply-adds a token, about
  a tenth of the rest of its forward pass) and a log-softmax over the vocabulary. A chunk
  recomputed after a preemption writes the same scores again.
- Logprobs are of the raw logits (as the sampler reports them), alternatives ordered by
  (logprob desc, token id asc).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pagedkv.sampling import PromptScores

__all__ = ["ScoreRows", "rows_of", "score", "scoring_salt"]

# Rows whose logits are held at once: 256 × 49,152 float32 is 50 MB.
_CHUNK_ROWS = 256


def scoring_salt(request_id: str, cache_salt: str | None) -> str:
    """The cache salt of a request scoring its prompt: its own (no prefix hit from another
    request), keeping the caller's salt in it."""
    return f"{cache_salt or ''}\x00prompt-logprobs\x00{request_id}"


@dataclass(frozen=True)
class ScoreRows:
    """The token rows of a step whose logits score a prompt token: ``rows`` (into the step's
    tokens), ``targets`` (the prompt token each scores) and ``top`` (alternatives per row)."""

    rows: np.ndarray
    targets: np.ndarray
    top: int


def score(hidden: np.ndarray, rows: ScoreRows, logits_of: Callable[[np.ndarray], np.ndarray]) -> PromptScores:
    """The scores of ``rows`` from their final hidden states (``logits_of`` turns hidden states
    into logits), a chunk of rows at a time."""
    count = len(rows.targets)
    logprobs = np.empty(count, dtype=np.float32)
    top_ids = np.empty((count, rows.top), dtype=np.int64)
    top_logprobs = np.empty((count, rows.top), dtype=np.float32)
    for start in range(0, count, _CHUNK_ROWS):
        end = min(count, start + _CHUNK_ROWS)
        logits = np.asarray(logits_of(hidden[start:end]), dtype=np.float32)
        peak = logits.max(axis=1, keepdims=True)
        normalizer = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=1))
        logprobs[start:end] = logits[np.arange(end - start), rows.targets[start:end]] - normalizer
        if rows.top:
            ids, values = _top(logits, rows.top)
            top_ids[start:end], top_logprobs[start:end] = ids, values - normalizer[:, None]
    return PromptScores(logprobs, top_ids, top_logprobs)


def _top(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``k`` largest logits and their ids, by (value desc, id asc)."""
    k = min(k, logits.shape[1])
    candidates = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    values = np.take_along_axis(logits, candidates, axis=1)
    order = np.lexsort((candidates, -values), axis=1)
    return np.take_along_axis(candidates, order, axis=1), np.take_along_axis(values, order, axis=1)


def rows_of(
    positions: np.ndarray, query_start_loc: np.ndarray, row_prompts: Sequence[Sequence[int] | None]
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, np.ndarray]]]:
    """The token rows scoring a prompt token in a step: for each sequence row ``i`` whose
    ``row_prompts[i]`` is a prompt to score (None: not), its tokens at positions ``p`` with
    ``p + 1`` inside the prompt. Returns (rows, targets, [(sequence row, scored positions)])."""
    rows, targets, where = [], [], []
    for i, prompt in enumerate(row_prompts):
        if prompt is None:
            continue
        start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
        scored = np.flatnonzero(positions[start:end] + 1 < len(prompt))
        if scored.size:
            next_positions = positions[start:end][scored] + 1
            rows.append(start + scored)
            targets.append(np.asarray(prompt, dtype=np.int64)[next_positions])
            where.append((i, next_positions))
    if not rows:
        return np.empty(0, np.int64), np.empty(0, np.int64), []
    return np.concatenate(rows), np.concatenate(targets), where
