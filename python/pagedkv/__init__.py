"""pagedkv: a paged KV cache (PagedAttention) and continuous batching for LLM inference.

The memory manager, attention kernel and scheduler are Rust (``pagedkv._core``); this package
re-exports them with the Python-side engine, model and tools.
"""

from __future__ import annotations

from pagedkv._core import (
    BlockManager,
    KVCache,
    Scheduler,
    SchedulerOutput,
    UpdateOutput,
    __version__,
)
from pagedkv.errors import (
    CheckpointError,
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    PagedKVError,
    ShapeError,
    UnknownSequenceError,
)
from pagedkv.model import LlamaConfig, LlamaModel, SamplingParams, SimulatedModel

__all__ = [
    "BlockManager",
    "KVCache",
    "Scheduler",
    "SchedulerOutput",
    "UpdateOutput",
    "PagedKVError",
    "OutOfBlocksError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "InvalidArgumentError",
    "ShapeError",
    "CheckpointError",
    "LlamaConfig",
    "LlamaModel",
    "SamplingParams",
    "SimulatedModel",
    "__version__",
]
