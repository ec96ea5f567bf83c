"""The logits of one sequence prefilled whole on a fresh cache: what parity and loading tests
compare models by, without a scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np

from pagedkv.models import CacheStep, LlamaModel


def prefill_logits(model: LlamaModel, tokens: Sequence[int]) -> np.ndarray:
    """``[len(tokens), vocab]`` float32 logits, row ``i`` predicting token ``i + 1``."""
    n = len(tokens)
    blocks = -(-n // 16)
    step = SimpleNamespace(
        input_ids=np.asarray(tokens, np.int64),
        positions=np.arange(n, dtype=np.int64),
        slot_mapping=np.arange(n, dtype=np.int64),
        query_start_loc=np.array([0, n], np.int32),
        context_lens=np.array([n], np.int32),
        block_tables=np.arange(blocks, dtype=np.int32)[None],
        copy_ops=[],
        logits_indices=np.arange(n, dtype=np.int64),
    )
    # Each layer's sliding window, as a scheduler's step takes it from the spec.
    windows = [layer.window for layer in model.kv_spec().layers]
    return model.forward(CacheStep(step, model.new_kv_cache(blocks), windows=windows))
