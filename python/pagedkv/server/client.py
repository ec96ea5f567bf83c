"""What the server serves: an :class:`EngineClient`, either one in-process
:class:`~pagedkv.Engine` (:class:`LocalEngine`) or a cluster of replicas
(:class:`pagedkv.cluster.Cluster`). The app sees only this protocol.

Invariants:

- ``submit`` returns a handle (:class:`~pagedkv.engine.RequestHandle`'s API:
  ``async for`` its :class:`TokenEvent`\\ s, ``await`` its output, ``abort()``) only once the request
  is queued; a refused one raises there (a bad argument, a full queue, a closed engine), having
  queued nothing. They never block the event loop.
- ``shutdown(drain=True, timeout=0)`` stops accepting at once; ``drain=False`` aborts what runs.
- A client may have ``grammars``, the engine's :class:`~pagedkv.grammar.GrammarCompiler`: the
  server then compiles a request's constraint in a worker thread before submitting it, so the
  engine's own compile (in ``submit``, on the event loop's thread) is a cache hit. A cluster has
  none: its replicas compile in their own processes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pagedkv.engine import Engine, RequestHandle
from pagedkv.grammar import GrammarCompiler
from pagedkv.sampling import SamplingParams
from pagedkv.text.tokenizer import Tokenizer

__all__ = ["EngineClient", "LocalEngine"]


class EngineClient(Protocol):
    """The engine side of the server."""

    tokenizer: Tokenizer
    default_params: SamplingParams

    @property
    def max_model_len(self) -> int: ...

    async def submit(self, prompt: Sequence[int], params: SamplingParams, *, cache_salt: str | None,
                     trace_headers: Mapping[str, str] | None) -> RequestHandle:
        """Queues a prompt's token ids (the server encodes prompts itself:
        :class:`~pagedkv.server.prompts.PromptEncoder`)."""
        ...

    def health(self) -> dict:
        """``status`` ("ok" while it serves requests; anything else is answered 503) and what the
        engine(s) hold now (``num_running``, ``num_waiting``, ...)."""
        ...

    def metrics_text(self) -> str:
        """The Prometheus exposition of its metrics."""
        ...

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None: ...


class LocalEngine:
    """One in-process :class:`Engine` as an :class:`EngineClient` (submissions never wait:
    ``timeout=0``, so a full queue is a 429 at once)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.default_params = engine.default_params

    @property
    def max_model_len(self) -> int:
        return self.engine.core.max_model_len

    @property
    def grammars(self) -> GrammarCompiler:
        """The engine's compiler of constraints (and its cache)."""
        return self.engine.grammars

    async def submit(self, prompt: Sequence[int], params: SamplingParams, *, cache_salt: str | None,
                     trace_headers: Mapping[str, str] | None) -> RequestHandle:
        return self.engine.submit(prompt, params, cache_salt=cache_salt, timeout=0, trace_headers=trace_headers)

    def health(self) -> dict:
        if self.engine.closed:  # its scheduler may refuse every call (a core that failed)
            return {"status": "closed"}
        scheduler = self.engine.core.scheduler
        num_blocks = self.engine.core.config.num_blocks
        return {
            "status": "ok",
            "num_running": scheduler.num_running,
            "num_waiting": scheduler.num_waiting,
            "num_blocks": num_blocks,
            "blocks_in_use": num_blocks - scheduler.num_free_blocks,
            # Per KV cache group (a hybrid model's full and sliding-window layers).
            "kv_groups": [{"layers": g.layers, "attention": g.attention, "blocks_in_use": g.blocks_in_use,
                           "block_size": g.block_size}
                          for g in self.engine.core.kv_groups()],
        }

    def metrics_text(self) -> str:
        return self.engine.metrics.text()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        self.engine.shutdown(drain=drain, timeout=timeout)
