"""What a model reads from one scheduler step: the :class:`ModelStep` protocol.

``pagedkv.Scheduler.schedule()`` returns an object with these attributes; tests build their own.
The step's tokens are flattened: sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``
of ``input_ids``, ``positions`` and ``slot_mapping``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

__all__ = ["ModelStep"]


class ModelStep(Protocol):
    """The arrays of one batched step.

    - ``input_ids`` int ``[num_tokens]``: the tokens to run (prefill chunks and decode tokens).
    - ``positions`` int64 ``[num_tokens]``: each token's position in its sequence.
    - ``slot_mapping`` int64 ``[num_tokens]``: the KV cache slot each token's K/V is written to.
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
