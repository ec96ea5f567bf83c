"""What every decoder on the paged KV cache shares: :class:`PagedDecoder`, the entry points a
runner calls (:meth:`~PagedDecoder.forward`, or :meth:`~PagedDecoder.hidden` then
:meth:`~PagedDecoder.logits`), and a K/V cache of one's own shaped by the model's
:meth:`~PagedDecoder.kv_spec`.

Invariants: the whole forward pass over a step is one call into the core
(:class:`pagedkv._core.Decoder`, built by the subclass from its packed weights): no numpy runs
between the layers, so the core's worker pool stays busy for the whole step; ``weight_dtype`` is
validated before any tensor is read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv._core import Decoder, KVCache, KvSpec, Linear
from pagedkv.models.layers import canonical_weight_dtype, check_weight_dtype
from pagedkv.models.step import ModelStep

__all__ = ["PagedDecoder"]


class PagedDecoder:
    """A decoder running on paged K/V, reached through each step (:class:`ModelStep`: a
    scheduler's ``SchedulerOutput`` or a :class:`~pagedkv.models.step.CacheStep`)."""

    config: Any
    weight_dtype: str
    _decoder: Decoder
    _lm_head: Linear

    def __init__(self, config: Any, weight_dtype: str) -> None:
        self.config = config
        self.weight_dtype = canonical_weight_dtype(weight_dtype)

    @staticmethod
    def check_weight_dtype(weight_dtype: str) -> None:
        """Raises :class:`InvalidArgumentError` unless ``weight_dtype`` is a storage type of the
        projections or "auto" (:func:`pagedkv.models.layers.check_weight_dtype`)."""
        check_weight_dtype(weight_dtype)

    def linears(self) -> list[Linear]:
        """Every projection a decode step multiplies by, the lm_head included."""
        raise NotImplementedError

    @property
    def projection_nbytes(self) -> int:
        """Bytes of weights one decode step streams: every projection and the lm_head as stored
        (what a single-stream decode's bandwidth limit divides by)."""
        return sum(linear.nbytes for linear in self.linears())

    def kv_spec(self, dtype: str | None = None) -> KvSpec:
        """What this model keeps of K/V, layer by layer, stored as ``dtype`` (None: the core's
        default): what a :class:`~pagedkv.Scheduler` given it (``kv_spec=``) derives its KV
        cache groups from and allocates for its pool."""
        raise NotImplementedError

    def new_kv_cache(self, num_blocks: int, block_size: int = 16, dtype: str | None = None) -> KVCache:
        """A K/V cache of one's own shaped for this model (for a :class:`~pagedkv.models.step.CacheStep`)."""
        spec = self.kv_spec(dtype)
        first = spec.layers[0]
        return KVCache(len(spec.layers), num_blocks, block_size, first.num_kv_heads, first.head_dim, spec.dtype)

    def forward(self, step: ModelStep) -> np.ndarray:
        """Runs one step: applies its copy-on-write copies, writes every token's K/V at its slots,
        attends through its tables and returns the float32 logits
        ``[len(step.logits_indices), vocab_size]`` of the rows ``step.logits_indices``. Raises
        :class:`InvalidArgumentError`, touching no K/V, for a token id outside the vocabulary, a
        position past ``max_position_embeddings`` or a row outside the step."""
        return self._decoder.logits(step, step.logits_indices)

    def hidden(self, step: ModelStep, rows: np.ndarray) -> np.ndarray:
        """Runs one step as :meth:`forward` does; returns the final-normed hidden states
        ``[len(rows), hidden_size]`` of the token ``rows`` (for :meth:`logits`)."""
        return self._decoder.hidden(step, rows)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """The float32 logits ``[rows, vocab_size]`` of final hidden states."""
        return self._lm_head(hidden)
