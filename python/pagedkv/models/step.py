"""What a model reads from one scheduler step, and its one way into the K/V: :class:`ModelStep`.

``pagedkv.Scheduler.schedule()`` returns a :class:`ModelStep` (a ``SchedulerOutput`` of a
scheduler made with a ``kv_spec``): its arrays, and ``write``/``copy_blocks``/``attention``, which
touch the scheduler's K/V only where the step was scheduled, and only until it is updated.
:class:`CacheStep` gives the same to a step's arrays over a :class:`~pagedkv.KVCache` of one's own
(tests, benchmarks, driving a model by hand).

A layer's sliding window is a fact about the model, stated once, never passed per call: a
scheduler's step reads each layer's from its ``kv_spec``, a :class:`CacheStep` from the ``windows``
it was made with. So a model calls ``step.attention(layer, query)`` alike over either.

The step's tokens are flattened: sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``
of ``input_ids``, ``positions`` and ``slot_mapping``.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from pagedkv._core import KVCache
from pagedkv.errors import InvalidArgumentError

__all__ = ["CacheStep", "ModelStep", "StepArrays"]


class StepArrays(Protocol):
    """The arrays of one batched step.

    - ``input_ids`` int ``[num_tokens]``: the tokens to run (prefill chunks and decode tokens).
    - ``positions`` int64 ``[num_tokens]``: each token's position in its sequence.
    - ``slot_mapping`` int64 ``[num_tokens]``: the KV cache slot each token's K/V is written to
      (a scheduler's step over several KV cache groups has one row per group, ``[G, num_tokens]``,
      and ``block_tables`` ``[G, num_seqs, width]``: its own ``write``/``attention`` pick each
      layer's group; a :class:`CacheStep` addresses one cache, so it takes one group's arrays).
    - ``query_start_loc`` int32 ``[num_seqs + 1]``: prefix sums of tokens per sequence.
    - ``context_lens`` int32 ``[num_seqs]``: tokens in the cache for each sequence, this step's included.
    - ``block_tables`` int32 ``[num_seqs, width]``: physical blocks of each sequence, padded with -1.
    - ``copy_ops``: ``(src, dst)`` block copies (copy-on-write), applied before anything reads the cache;
      a sequence of pairs or an int array ``[n, 2]``.
    - ``logits_indices`` int ``[num_samples]``: the token rows whose logits are wanted.
    """

    @property
    def input_ids(self) -> np.ndarray: ...

    @property
    def positions(self) -> np.ndarray: ...

    @property
    def slot_mapping(self) -> np.ndarray: ...

    @property
    def query_start_loc(self) -> np.ndarray: ...

    @property
    def context_lens(self) -> np.ndarray: ...

    @property
    def block_tables(self) -> np.ndarray: ...

    @property
    def copy_ops(self) -> np.ndarray | Iterable[tuple[int, int]]: ...

    @property
    def logits_indices(self) -> np.ndarray: ...


class ModelStep(StepArrays, Protocol):
    """A step's arrays and its K/V calls, each at the step's own slots and tables."""

    def write(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Stores the step's K and V rows (float32 ``[num_tokens, num_kv_heads, head_dim]``) of ``layer``."""
        ...

    def copy_blocks(self) -> None:
        """Applies the step's copy-on-write block copies."""
        ...

    def attention(self, layer: int, query: np.ndarray, scale: float | None = None, kernel: str | None = None) -> np.ndarray:
        """Attention of ``query`` over ``layer`` through the step's tables, over the layer's sliding
        window if it has one: the step knows it (a scheduler's from its ``kv_spec``, a
        :class:`CacheStep` from its ``windows``), the caller never passes it."""
        ...


class CacheStep:
    """A :class:`ModelStep` over a :class:`~pagedkv.KVCache` of one's own: ``arrays`` (a step built
    by hand, or a ``SchedulerOutput`` of a scheduler without K/V) addressing ``kv_cache``.

    ``windows`` gives each layer's sliding window (None: full attention), as a scheduler's step
    takes them from its ``kv_spec`` (``[layer.window for layer in spec.layers]``); without it every
    layer attends over every earlier token. ``InvalidArgumentError`` unless it has one entry per
    layer of the cache, each None or a positive int."""

    def __init__(self, arrays: StepArrays, kv_cache: KVCache, windows: Sequence[int | None] | None = None) -> None:
        self.arrays = arrays
        self.kv_cache = kv_cache
        self.windows = _layer_windows(windows, kv_cache.num_layers)

    @property
    def input_ids(self) -> np.ndarray:
        return self.arrays.input_ids

    @property
    def positions(self) -> np.ndarray:
        return self.arrays.positions

    @property
    def slot_mapping(self) -> np.ndarray:
        return self.arrays.slot_mapping

    @property
    def query_start_loc(self) -> np.ndarray:
        return self.arrays.query_start_loc

    @property
    def context_lens(self) -> np.ndarray:
        return self.arrays.context_lens

    @property
    def block_tables(self) -> np.ndarray:
        return self.arrays.block_tables

    @property
    def copy_ops(self) -> np.ndarray | Iterable[tuple[int, int]]:
        return self.arrays.copy_ops

    @property
    def logits_indices(self) -> np.ndarray:
        return self.arrays.logits_indices

    def write(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        self.kv_cache.write(layer, keys, values, self.arrays.slot_mapping)

    def copy_blocks(self) -> None:
        self.kv_cache.copy_blocks(self.arrays.copy_ops)

    def attention(self, layer: int, query: np.ndarray, scale: float | None = None, kernel: str | None = None) -> np.ndarray:
        a = self.arrays
        try:
            window = self.windows[layer] if layer >= 0 else None
        except (IndexError, TypeError):
            window = None  # not a layer of the cache, which refuses it, typed
        return self.kv_cache.attention(
            layer, query, a.block_tables, a.context_lens, a.query_start_loc, scale, kernel, window=window
        )


def _layer_windows(windows: Sequence[int | None] | None, num_layers: int) -> tuple[int | None, ...]:
    """``windows`` checked (one per layer, each None or a positive int), or no window for each layer."""
    if windows is None:
        return (None,) * num_layers
    if isinstance(windows, (str, bytes)) or not isinstance(windows, Sequence) or len(windows) != num_layers:
        raise InvalidArgumentError(f"windows must be a sequence of one window per layer ({num_layers}), got {windows!r}")
    checked: list[int | None] = []
    for layer, window in enumerate(windows):
        try:
            value = None if window is None or isinstance(window, bool) else operator.index(window)
        except TypeError:
            value = None
        if window is not None and (value is None or value < 1):
            raise InvalidArgumentError(f"windows[{layer}] must be None or a positive int, got {window!r}")
        checked.append(value)
    return tuple(checked)
