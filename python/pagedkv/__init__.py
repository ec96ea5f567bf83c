"""pagedkv: a paged KV cache (PagedAttention) and continuous batching for LLM inference.

The memory manager, attention kernel and scheduler are Rust (``pagedkv._core``); this package
re-exports them with the Python-side engine, model and tools.
"""

from __future__ import annotations

from pagedkv._core import (
    BlockManager,
    ContiguousKV,
    KVCache,
    ReadBandwidthProbe,
    __version__,
    available_kernels,
    get_num_threads,
    measure_read_bandwidth,
    set_num_threads,
)
from pagedkv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    PagedKVError,
    ShapeError,
    UnknownSequenceError,
)

__all__ = [
    "BlockManager",
    "KVCache",
    "ContiguousKV",
    "available_kernels",
    "get_num_threads",
    "set_num_threads",
    "measure_read_bandwidth",
    "ReadBandwidthProbe",
    "PagedKVError",
    "OutOfBlocksError",
    "UnknownSequenceError",
    "DuplicateSequenceError",
    "InvalidArgumentError",
    "ShapeError",
    "__version__",
]
