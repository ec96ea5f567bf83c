"""The engine: continuous batching over the paged KV cache, one request at a time or many.

- :mod:`~pagedkv.engine.config`: :class:`EngineConfig`, the limits an engine is built with;
- :mod:`~pagedkv.engine.outputs`: what it reports (:class:`RequestOutput`, :class:`TokenEvent`, ...);
- :mod:`~pagedkv.engine.runners`: what runs the model for a step (a paged model, or a simulated one);
- :mod:`~pagedkv.engine.core`: :class:`EngineCore`, one synchronous step at a time (and
  :class:`KvGroup`, what each KV cache group holds);
- :mod:`~pagedkv.engine.handle`: :class:`RequestHandle`, a submitted request's stream and result;
- :mod:`~pagedkv.engine.engine`: :class:`Engine`, the core on a worker thread.
"""

from __future__ import annotations

from pagedkv.engine.config import DEFAULT_KV_DISK_BYTES, EngineConfig
from pagedkv.engine.core import EngineCore, KvGroup
from pagedkv.engine.engine import Engine, EngineClosedError, EngineOverloadedError
from pagedkv.engine.handle import RequestHandle
from pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenEvent, TokenLogprob
from pagedkv.engine.runners import ModelRunner, PagedModelRunner, SimulatedRunner, VirtualClock

__all__ = [
    "DEFAULT_KV_DISK_BYTES",
    "CompletionOutput",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineCore",
    "EngineOverloadedError",
    "KvGroup",
    "ModelRunner",
    "PagedModelRunner",
    "RequestHandle",
    "RequestMetrics",
    "RequestOutput",
    "SimulatedRunner",
    "TokenEvent",
    "TokenLogprob",
    "VirtualClock",
]
