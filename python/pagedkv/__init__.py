"""pagedkv: a paged KV cache (PagedAttention) and continuous batching for LLM inference.

The memory manager, attention kernel and scheduler are Rust (``pagedkv._core``); this package
re-exports them with the Python-side engine, model and tools.
"""

from __future__ import annotations

from pagedkv._core import (
    BlockManager,
    ContiguousKV,
    KVCache,
    PrefixIndex,
    ReadBandwidthProbe,
    Scheduler,
    SchedulerOutput,
    UpdateOutput,
    __version__,
    available_kernels,
    block_hashes,
    get_num_threads,
    measure_read_bandwidth,
    set_num_threads,
)
from pagedkv.engine import (
    CompletionOutput,
    Engine,
    EngineClosedError,
    EngineConfig,
    EngineCore,
    EngineOverloadedError,
    RequestHandle,
    RequestMetrics,
    RequestOutput,
    TokenEvent,
    TokenLogprob,
)
from pagedkv.errors import (
    CheckpointError,
    DuplicateSequenceError,
    InternalError,
    InvalidArgumentError,
    KvTierError,
    ModelError,
    NoChatTemplateError,
    OutOfBlocksError,
    PagedKVError,
    ShapeError,
    UnknownSequenceError,
)
from pagedkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, KvEventPublisher, KvSnapshot
from pagedkv.models import LlamaConfig, LlamaModel, SimulatedModel
from pagedkv.sampling import SamplingParams

__all__ = [
    "BlockManager",
    "KVCache",
    "Scheduler",
    "SchedulerOutput",
    "UpdateOutput",
    "ContiguousKV",
    "available_kernels",
    "block_hashes",
    "PrefixIndex",
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
    "CheckpointError",
    "ModelError",
    "KvTierError",
    "NoChatTemplateError",
    "InternalError",
    "LlamaConfig",
    "LlamaModel",
    "SamplingParams",
    "SimulatedModel",
    "Engine",
    "EngineConfig",
    "EngineCore",
    "EngineClosedError",
    "EngineOverloadedError",
    "RequestHandle",
    "RequestOutput",
    "CompletionOutput",
    "RequestMetrics",
    "TokenEvent",
    "TokenLogprob",
    "KvEventPublisher",
    "KvEventBatch",
    "KvSnapshot",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "__version__",
]
