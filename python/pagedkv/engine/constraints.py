"""The grammar state of constrained requests in the engine: one matcher per sample, the masks of a
step's constrained rows started before the forward pass (:class:`StepMasks`), and the counts the
metrics export.

Invariants:

- A sample's matcher has advanced past exactly the tokens its output kept, in order (after those
  it carried from another engine, ``StructuredOutputs.continued_from``): the engine
  core advances it in the step that appends each token (never for a token the scheduler ended the
  sample with: end of sequence or the length limit) and reads its mask at the next step that
  samples it. Preemption recomputes K/V, never tokens, so a matcher never goes back.
- A step's masks are started on the worker pool (``_core.start_masks``) before the runner runs,
  so they are computed while the forward pass runs; the runner collects them (:meth:`StepMasks.wait`)
  just before sampling. A step without a constrained row starts nothing and pays nothing.
- A token the grammar refuses (it cannot be one the mask allowed) fails its request alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from pagedkv._core import Grammar, GrammarMatcher, start_masks
from pagedkv.sampling import RowMasks

__all__ = ["GrammarStats", "StepMasks", "matchers_of"]


def matchers_of(grammar: Grammar, n: int, continued_from: Sequence[int] = ()) -> list[GrammarMatcher]:
    """One matcher per sample of a request, each past the tokens its output already has
    (``continued_from``: a migrated sample's). Raises :class:`~pagedkv.errors.InvalidArgumentError`
    for a token the grammar refuses there."""
    matchers = [grammar.matcher() for _ in range(n)]
    for matcher in matchers:
        for token in continued_from:
            matcher.advance(token)
    return matchers


class GrammarStats:
    """Masks computed since the engine started: steps with a constrained row, rows masked, the
    seconds spent computing them (summed over rows: their CPU cost), and the seconds the step waited for them (what the
    forward pass did not hide)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {"grammar_mask_steps": 0.0, "grammar_mask_rows": 0.0, "grammar_mask_seconds": 0.0,
                        "grammar_mask_wait_seconds": 0.0}

    def record(self, rows: int, seconds: float, waited: float) -> None:
        with self._lock:
            self._counts["grammar_mask_steps"] += 1
            self._counts["grammar_mask_rows"] += rows
            self._counts["grammar_mask_seconds"] += seconds
            self._counts["grammar_mask_wait_seconds"] += waited

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)


class StepMasks:
    """The masks of a step's constrained sample rows, being computed on the worker pool."""

    def __init__(self, rows: Sequence[int], matchers: Sequence[GrammarMatcher], stats: GrammarStats) -> None:
        self._rows = np.asarray(rows, dtype=np.int64)
        self._pending = start_masks(list(matchers))
        self._stats = stats
        self._collected: RowMasks | None = None

    def wait(self) -> RowMasks:
        """The rows' masks (blocking for what is not computed yet); the same masks on every call."""
        if self._collected is None:
            started = time.perf_counter()
            words, errors, seconds = self._pending.wait()
            self._stats.record(len(self._rows), seconds, time.perf_counter() - started)
            failed = {int(row): f"the grammar failed: {error}" for row, error in zip(self._rows, errors, strict=True) if error}
            self._collected = RowMasks(words, self._rows, failed)
        return self._collected
