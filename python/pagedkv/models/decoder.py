"""What every decoder on the paged KV cache shares: :class:`PagedDecoder`, the entry points a
runner calls (:meth:`~PagedDecoder.forward`, or :meth:`~PagedDecoder.hidden` then
:meth:`~PagedDecoder.logits`), the cap on numpy's BLAS threads while they run, and a K/V cache of
one's own shaped by the model's :meth:`~PagedDecoder.kv_spec`.

Invariants: a subclass computes one step in ``_forward`` (final-normed hidden states of the rows
asked for) and projects them with ``_lm_head``; both run under the BLAS cap; ``weight_dtype`` is
validated before any tensor is read.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from pagedkv._core import KVCache, KvSpec, Linear
from pagedkv.errors import InvalidArgumentError, ShapeError
from pagedkv.models.layers import canonical_weight_dtype, check_weight_dtype
from pagedkv.models.step import ModelStep

__all__ = ["PagedDecoder"]


class PagedDecoder:
    """A decoder running on paged K/V, reached through each step (:class:`ModelStep`).

    ``blas_threads`` caps numpy's BLAS threads while a step runs (None leaves BLAS as it is), for
    whatever numpy still does there. The default, 1, is deliberate: the Rust workers need the
    same cores, and OpenBLAS threads that spin waiting for work starve everything else. On 2
    loaded cores, a batch-32 decode step of the tiny model took 14 ms with one BLAS thread and
    166 ms with two when numpy did the matrix products. The cap is process-wide while it holds,
    so numpy work on other threads during a step runs single-threaded too."""

    config: Any
    weight_dtype: str
    _lm_head: Linear

    def __init__(self, config: Any, blas_threads: int | None, weight_dtype: str) -> None:
        if blas_threads is not None and blas_threads < 1:
            raise InvalidArgumentError(f"blas_threads must be ≥ 1 or None, got {blas_threads}")
        self.config = config
        self.weight_dtype = canonical_weight_dtype(weight_dtype)
        self._blas_threads = blas_threads
        self._blas = ThreadpoolController() if blas_threads is not None else None

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
        attends through its tables (each through the step: ``step.copy_blocks()``,
        ``step.write``, ``step.attention``) and returns the float32 logits
        ``[len(step.logits_indices), vocab_size]`` of the rows ``step.logits_indices``."""
        return self.logits(self.hidden(step, np.asarray(step.logits_indices)))

    def hidden(self, step: ModelStep, rows: np.ndarray) -> np.ndarray:
        """Runs one step as :meth:`forward` does; returns the final-normed hidden states
        ``[len(rows), hidden_size]`` of the token ``rows`` (for :meth:`logits`)."""
        with self._blas_limit():
            return self._forward(step, rows)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        """The float32 logits ``[rows, vocab_size]`` of final hidden states."""
        with self._blas_limit():
            return self._lm_head(hidden)

    def _forward(self, step: ModelStep, rows: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _step_inputs(self, step: ModelStep) -> tuple[np.ndarray, np.ndarray]:
        """The step's token ids and positions, checked: equal 1-D shapes, every position below
        ``max_position_embeddings``."""
        input_ids, positions = np.asarray(step.input_ids), np.asarray(step.positions)
        if input_ids.ndim != 1 or positions.shape != input_ids.shape:
            raise ShapeError(f"input_ids {input_ids.shape} and positions {positions.shape} must be equal 1-D shapes")
        limit = self.config.max_position_embeddings
        if input_ids.size and int(positions.max()) >= limit:
            raise InvalidArgumentError(f"position {int(positions.max())} is past max_position_embeddings {limit}")
        return input_ids, positions

    def _split_qkv(self, qkv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A fused projection's rows ``[num_tokens, (heads + 2 kv_heads) * head_dim]`` as q
        ``[num_tokens, heads, head_dim]`` and k, v ``[num_tokens, kv_heads, head_dim]`` (v made
        contiguous: the cache copies it row by row)."""
        c = self.config
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        num_tokens = qkv.shape[0]
        q = qkv[:, :q_dim].reshape(num_tokens, c.num_heads, c.head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].reshape(num_tokens, c.num_kv_heads, c.head_dim)
        v = np.ascontiguousarray(qkv[:, q_dim + kv_dim :]).reshape(num_tokens, c.num_kv_heads, c.head_dim)
        return q, k, v

    def _blas_limit(self) -> contextlib.AbstractContextManager[object]:
        if self._blas is None:
            return contextlib.nullcontext()
        return self._blas.limit(limits=self._blas_threads, user_api="blas")
