"""The threaded engine: submit requests from any thread, stream their tokens, or generate a batch.

A background worker steps an :class:`~pagedkv.engine.EngineCore`, sleeping on a condition
variable while there is nothing to do; results flow back through per-request handles.

Invariants:

- ``submit`` adds the request to the core itself, in the caller's thread, under the engine lock:
  the scheduler validates every argument there (Python checks only the text and the vocabulary),
  so a bad argument raises in the caller, changes nothing and never reaches the worker.
- Every submission that returned a handle ends exactly once: with its finished output, an abort
  (``finish_reason == "abort"``), or an error raised from the handle. ``_handles`` holds exactly
  the submissions not yet ended; a request id is in use from ``submit`` until its handle ends.
- Aborts name a submission (its handle), not an id, and are applied by the worker between steps:
  an abort never reaches a later submission that reuses the id.
- The worker never dies from one request's fault. A request the model gives NaN logits, whose
  sampling parameters the sampling kernel refuses, or whose tokens cannot be decoded, fails alone
  with :class:`~pagedkv.errors.ModelError`. Nor from a callback's: what a KV-event subscriber,
  the tracer or the tokenizer raises (``SystemExit`` and ``KeyboardInterrupt`` included) is
  logged (:mod:`pagedkv.callbacks`).
- KV-event subscribers run in the worker after each step, holding none of the engine's locks:
  they may call :meth:`Engine.kv_snapshot`, :meth:`Engine.submit` or abort. They must not wait
  for a request (the worker they would wait on is the one running them), and ``submit`` from
  the worker never waits for room: a full queue raises :class:`EngineOverloadedError` at once.
- A failure of the model itself (the runner raises) leaves the engine **closed**: every request in
  flight fails with :class:`EngineClosedError` (``__cause__``: the model's exception) and its blocks
  are freed; ``submit`` raises :class:`EngineClosedError`; ``stats()`` and ``shutdown()`` still
  work. (The failed step may have written part of the KV cache, so no further step is trusted.)
  A bug in the core (:class:`~pagedkv.errors.InternalError`) closes it the same way; the
  scheduler then refuses every call, ``stats()`` included.
- The worker holds the engine's inner state, never the :class:`Engine`: an engine no longer
  referenced (by the caller or by a handle) is collected, and its finalizer stops the worker.

Text: the core detokenizes as it steps (every :class:`TokenEvent` carries its text delta) and
matches stop strings (:class:`~pagedkv.engine.EngineCore`). Chat
(:meth:`Engine.submit_chat`, :meth:`Engine.chat`) renders the conversation with the tokenizer's
chat template (:mod:`pagedkv.text.chat`) in the caller's thread, then submits its tokens.

Sampling parameters: a request's own :class:`SamplingParams`, else the engine's
``default_params`` (:meth:`Engine.from_pretrained` reads them from a checkpoint's
``generation_config.json``), else ``SamplingParams()``.

Back-pressure: while ``max_waiting`` sequences wait in the scheduler, ``submit`` blocks until
there is room, or raises :class:`EngineOverloadedError` after ``timeout``.

Shutdown (:meth:`Engine.shutdown`): ``drain=True`` (the default, and what ``with Engine(...)``
does) stops accepting submissions and finishes every request already submitted; ``drain=False``
aborts them.

Handles replay: each iteration of a handle (blocking, or ``async for``) yields every token from
the first, so two consumers each see the whole stream. asyncio consumers are woken through
``loop.call_soon_threadsafe``; no thread waits on their behalf, so cancelling one leaks nothing.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pagedkv.engine.config import EngineConfig
from pagedkv.engine.core import EngineCore
from pagedkv.engine.handle import RequestHandle
from pagedkv.engine.outputs import RequestOutput, TokenEvent
from pagedkv.engine.runners import PagedModelRunner
from pagedkv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    ModelError,
    PagedKVError,
)
from pagedkv.grammar import GrammarCompiler
from pagedkv.kv_events import KvEventPublisher, KvSnapshot
from pagedkv.loaders.generation_config import default_sampling_params
from pagedkv.loaders.identity import WeightsDigest, kv_identity
from pagedkv.loaders.registry import load_model
from pagedkv.models import PagedDecoder
from pagedkv.models.llama import DEFAULT_WEIGHT_DTYPE
from pagedkv.observability.metrics import EngineMetrics
from pagedkv.sampling import SamplingParams
from pagedkv.text.prompt import encode_chat, encode_text
from pagedkv.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagedkv.observability.tracing import RequestTracer

__all__ = ["Engine", "EngineClosedError", "EngineOverloadedError", "RequestHandle"]


class EngineClosedError(PagedKVError, RuntimeError):
    """The engine is shut down (or its model failed) and takes no more requests."""


class EngineOverloadedError(PagedKVError, RuntimeError):
    """The waiting queue stayed full for the whole submission timeout."""


class Engine:
    """Continuous batching over a paged KV cache, driven by a background worker thread."""

    def __init__(
        self,
        model: PagedDecoder,
        tokenizer: Tokenizer,
        config: EngineConfig = EngineConfig(),
        *,
        max_waiting: int = 1024,
        metrics: EngineMetrics | None = None,
        default_params: SamplingParams | None = None,
        tracer: RequestTracer | None = None,
        weights_digest: str | None = None,
    ) -> None:
        """``default_params``: what a request submitted without parameters samples with (None:
        ``SamplingParams()``). ``tracer``: traces each request (:func:`pagedkv.observability.tracing.configure`).
        ``weights_digest``: the :class:`~pagedkv.loaders.identity.WeightsDigest` of the model's
        tensors as loaded, which a disk tier (``config.kv_disk_path``) needs to record whose
        blocks it holds (:meth:`from_pretrained` computes it). Raises
        :class:`InvalidArgumentError` (or ``MemoryError``) for a configuration the model, the KV
        cache, the scheduler or the disk tier refuses, and :class:`~pagedkv.errors.KvTierError`
        for a disk tier that cannot be opened."""
        if max_waiting < 1:
            raise InvalidArgumentError(f"max_waiting must be ≥ 1, got {max_waiting}")
        if default_params is not None and not isinstance(default_params, SamplingParams):
            raise InvalidArgumentError(f"default_params must be SamplingParams, got {type(default_params).__name__}")
        identity = None
        if config.disk_tier() is not None:
            if weights_digest is None:
                raise InvalidArgumentError("a disk tier needs the model's weights_digest (Engine.from_pretrained computes it)")
            identity = kv_identity(model.config, weights_digest, model.weight_dtype, config.kv_dtype, config.block_size)
        runner = PagedModelRunner(model, config.kv_dtype)
        core = EngineCore(
            runner, config, eos_token_ids=model.config.eos_token_ids, tokenizer=tokenizer, tracer=tracer, model_identity=identity
        )
        self.tokenizer = tokenizer
        self.model = model
        self.default_params = SamplingParams() if default_params is None else default_params
        self.metrics = metrics or EngineMetrics()
        self._state = _EngineState(core, self.metrics, max_waiting)
        weakref.finalize(self, self._state.close, False)

    @classmethod
    def from_pretrained(
        cls, path: str | Path = "tiny", *, seed: int = 0, weight_dtype: str = DEFAULT_WEIGHT_DTYPE, **kwargs
    ) -> Engine:
        """An engine over a model named as :func:`pagedkv.loaders.load_pretrained` takes it: the
        built-in ``"tiny"`` (seeded random weights), a registry name such as ``"smollm2-135m"``, a
        ``.gguf`` file, or a Hugging Face Llama checkpoint directory, loaded tensor by tensor
        (:func:`pagedkv.loaders.load_model`) with its projections stored as ``weight_dtype``
        ("float32", "float16", "bfloat16", or "auto": a GGUF file's quantized tensors as shipped).
        Keyword arguments go to :class:`EngineConfig` or the
        engine: ``kv_disk_path=DIR, kv_disk_bytes=N`` add a disk tier for this model (its
        identity: the config, a digest of the tensors as loaded, the weight and KV dtypes and the
        block size; a tier written for another is cleared). A directory's
        ``generation_config.json``, if any, gives ``default_params`` (unless passed here)."""
        engine_keys = {"max_waiting", "metrics", "default_params", "tracer"}
        engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in engine_keys}
        config = EngineConfig(**kwargs)  # a bad engine argument fails before the model loads
        digest = None if config.disk_tier() is None else WeightsDigest()  # hashing costs a pass: only for a tier
        model, tokenizer = load_model(path, seed=seed, weight_dtype=weight_dtype, digest=digest)
        if "default_params" not in engine_kwargs and Path(path).is_dir():
            engine_kwargs["default_params"] = default_sampling_params(Path(path))
        weights_digest = None if digest is None else digest.hexdigest()
        return cls(model, tokenizer, config, weights_digest=weights_digest, **engine_kwargs)

    @property
    def closed(self) -> bool:
        """Whether the engine takes no more requests: :meth:`shutdown` was called (requests
        already submitted may still be finishing) or its model failed. Once True, it stays True
        and :meth:`submit` raises :class:`EngineClosedError` (what a health check reports)."""
        return not self._state.accepting()

    @property
    def core(self) -> EngineCore:
        """The core the worker steps (read its scheduler's figures; do not step it)."""
        return self._state.core

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of this engine's structured outputs (a bounded cache): compile a
        constraint ahead (``grammars.compile(spec)``, from any thread) so that submitting it does
        not pay the compile."""
        return self._state.core.grammars

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> RequestHandle:
        """Queues a request from any thread (a text prompt or token ids); returns its handle.
        Blocks while the waiting queue is full (up to ``timeout`` seconds). Raises, changing
        nothing: :class:`InvalidArgumentError` for a bad argument (of any type or value),
        :class:`DuplicateSequenceError` for a ``request_id`` in use, :class:`EngineOverloadedError`,
        :class:`EngineClosedError`. Without ``request_id``, a fresh one is made; without
        ``params``, the engine's :attr:`default_params` apply. ``trace_headers`` (e.g. an HTTP
        request's, with W3C ``traceparent``) make the request's trace span a child of the caller's."""
        token_ids: Sequence[int]
        if isinstance(prompt, str):
            text, token_ids = prompt, encode_text(self.tokenizer, prompt)
        else:
            text, token_ids = None, prompt
        return self._submit(text, token_ids, params, request_id, priority, cache_salt, timeout, trace_headers)

    def submit_chat(
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> RequestHandle:
        """Queues the reply to a conversation, as :meth:`submit` queues a prompt: ``messages``
        (a list of ``{"role": ..., "content": ...}`` dicts, string contents) rendered with the
        tokenizer's chat template as transformers' ``apply_chat_template`` renders it, ending with
        the assistant's turn opened when ``add_generation_prompt``; the handle's ``prompt`` is the
        rendered text. Raises, in the caller, changing nothing: :class:`NoChatTemplateError` if
        the tokenizer has no template, :class:`InvalidArgumentError` for malformed messages or
        messages the template refuses (e.g. an unknown role), and what :meth:`submit` raises."""
        text, token_ids = encode_chat(self.tokenizer, messages, add_generation_prompt)
        return self._submit(text, token_ids, params, request_id, priority, cache_salt, timeout, trace_headers)

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        params: SamplingParams | None = None,
        *,
        add_generation_prompt: bool = True,
        timeout: float | None = None,
    ) -> RequestOutput:
        """The reply to a conversation, blocking until it is complete (:meth:`submit_chat`). Its
        :attr:`RequestOutput.text` is the reply. ``timeout`` bounds the whole wait: past it the
        request is aborted and ``TimeoutError`` raised."""
        deadline = None if timeout is None else time.monotonic() + timeout
        handle = self.submit_chat(messages, params, add_generation_prompt=add_generation_prompt, timeout=timeout)
        try:
            return handle.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            handle.abort()
            raise

    def _submit(self, text: str | None, token_ids: Sequence[int], params: SamplingParams | None,
                request_id: str | None, priority: int, cache_salt: str | None, timeout: float | None,
                trace_headers: Mapping[str, str] | None) -> RequestHandle:
        params = self.default_params if params is None else params
        return self._state.submit(self, text, token_ids, params, request_id, priority, cache_salt, timeout, trace_headers)

    def generate(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Runs a batch to completion; outputs in prompt order."""
        batch: list[str | Sequence[int]] = [prompts] if isinstance(prompts, str) else list(prompts)
        handles = [self.submit(p, params) for p in batch]
        return [h.result() for h in handles]

    def abort(self, request_id: str) -> None:
        """Stops the submission now using ``request_id`` (a no-op if none does)."""
        self._state.abort_id(request_id)

    def _abort_submission(self, handle: RequestHandle) -> None:
        """What a handle's ``abort`` calls: stops that submission (a no-op once it has ended)."""
        self._state.abort(handle)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops the worker: ``drain`` finishes submitted requests first, else aborts them. Once
        the worker has stopped (within ``timeout``), the disk tier, if any, is flushed and closed:
        its directory may then be opened by another engine (a warm restart)."""
        self._state.close(drain)
        self._state.thread.join(timeout)
        if not self._state.thread.is_alive():
            self._state.core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(drain=exc[0] is None)

    def stats(self) -> dict[str, float]:
        """The scheduler's cumulative figures, current: once a handle has ended, they include
        the step that ended it. With a disk tier, its figures too (``disk_*`` keys); the
        grammars' (``grammar_*``, :meth:`EngineCore.stats`)."""
        return self.core.stats()

    @property
    def kv_events(self) -> KvEventPublisher:
        """The publisher of this engine's KV events (subscribe, ``since``); it publishes only
        when the engine was made with ``emit_kv_events=True``."""
        return self._state.core.kv_events

    def kv_snapshot(self) -> KvSnapshot:
        """The blocks this engine holds findable now, consistent with :attr:`kv_events`'
        numbering (:meth:`EngineCore.kv_snapshot`): what a router resynchronises from after a gap."""
        return self._state.core.kv_snapshot()


def _closed_error(cause: BaseException) -> EngineClosedError:
    error = EngineClosedError(f"the engine's model failed: {cause!r}")
    error.__cause__ = cause
    return error


class _EngineState:
    """An engine's requests, core and worker thread: everything the worker touches. ``cond``
    guards every field below it; lock order: ``cond``, then the core's lock, then a handle's."""

    def __init__(self, core: EngineCore, metrics: EngineMetrics, max_waiting: int) -> None:
        self.core = core
        self.metrics = metrics
        self.metrics.follow(core.stats)  # the load gauges, read at each scrape
        self.metrics.follow_groups([group.attention for group in core.kv_groups()], core.kv_group_usage)
        self.max_waiting = max_waiting
        self.cond = threading.Condition()
        self.handles: dict[str, RequestHandle] = {}  # submitted, not yet ended
        self.aborts: list[RequestHandle] = []
        self.closing = False
        self.drain = True
        self.dead: BaseException | None = None  # the model's failure
        self.ids = itertools.count()
        self.thread = threading.Thread(target=self.run, name="pagedkv-engine", daemon=True)
        self.thread.start()

    # ---- callers' side ----------------------------------------------------------------------

    def submit(
        self,
        engine: Engine,
        text: str | None,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str | None,
        priority: int,
        cache_salt: str | None,
        timeout: float | None,
        trace_headers: Mapping[str, str] | None,
    ) -> RequestHandle:
        deadline = None if timeout is None else time.monotonic() + timeout
        if threading.current_thread() is self.thread:
            deadline = time.monotonic()  # a callback in the worker: it would wait for itself
        with self.cond:
            while self.accepting() and self.core.scheduler.num_waiting >= self.max_waiting:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise EngineOverloadedError(f"{self.max_waiting} requests already waiting")
                self.cond.wait(remaining)
            if not self.accepting():
                raise EngineClosedError("the engine is shut down") from self.dead
            if request_id is None:
                request_id = self.fresh_id()
            elif isinstance(request_id, str) and request_id in self.handles:  # other types: refused below
                raise DuplicateSequenceError(f"request id {request_id!r} is in flight")
            output = self.core.add_request(
                request_id, prompt, params, prompt=text, priority=priority, cache_salt=cache_salt, trace_headers=trace_headers
            )
            handle = RequestHandle(request_id, text, output.prompt_token_ids, engine._abort_submission)
            self.handles[request_id] = handle
            self.cond.notify_all()
        return handle

    def fresh_id(self) -> str:
        """An id no submission in flight uses (a caller may have chosen ``req-<n>`` itself)."""
        while (request_id := f"req-{next(self.ids)}") in self.handles:
            pass
        return request_id

    def abort(self, handle: RequestHandle) -> None:
        with self.cond:
            if self.handles.get(handle.request_id) is handle:
                self.aborts.append(handle)
                self.cond.notify_all()

    def abort_id(self, request_id: str) -> None:
        with self.cond:
            handle = self.handles.get(request_id)
        if handle is not None:
            self.abort(handle)

    def close(self, drain: bool) -> None:
        with self.cond:
            self.closing = True
            self.drain = self.drain and drain
            self.cond.notify_all()

    def accepting(self) -> bool:
        return not self.closing and self.dead is None

    # ---- worker -----------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while self.take_work():
                events, ended = self.core.step()
                self.deliver(events, ended)
        except BaseException as error:  # noqa: BLE001 - the model failed (a request's fault never reaches here)
            self.fail_all(error)

    def take_work(self) -> bool:
        """Applies pending aborts; waits until there is a step to run (True) or the engine stops."""
        with self.cond:
            while True:
                if self.closing and not self.drain:
                    self.aborts.extend(self.handles.values())
                aborts, self.aborts = self.aborts, []
                for handle in aborts:
                    if self.handles.get(handle.request_id) is handle:  # not ended meanwhile
                        self.end(handle, self.core.abort(handle.request_id))
                self.cond.notify_all()  # aborts made room in the waiting queue
                if self.core.has_unfinished():
                    return True
                if self.closing:
                    return False
                self.cond.wait()

    def deliver(self, events: list[TokenEvent], ended: list[RequestOutput]) -> None:
        self.metrics.record_scheduler(self.core.stats())
        with self.cond:
            for event in events:
                self.handles[event.request_id]._push(event)
            for output in ended:
                if output.error is None:
                    m = output.metrics
                    self.metrics.record_finished(m.ttft, m.tpot, m.e2e_latency or 0.0)
                self.end(self.handles[output.request_id], output)
            self.cond.notify_all()  # room in the waiting queue

    def end(self, handle: RequestHandle, output: RequestOutput) -> None:
        """Ends a submission with its output, or with the error that failed its request alone."""
        error: BaseException | None = None
        if output.error is not None:
            error = ModelError(f"request {output.request_id!r} failed: {output.error}")
        del self.handles[handle.request_id]
        handle._complete(output, error)

    def fail_all(self, cause: BaseException) -> None:
        """The model failed: the engine closes, the requests in flight free their blocks and fail
        with the cause (they end even if the core is too broken to free anything)."""
        with self.cond:
            self.dead = cause
            handles, self.handles = self.handles, {}
            try:
                for request_id in handles:
                    if request_id in self.core.scheduler:  # the failed step's requests are already out
                        self.core.abort(request_id)
            finally:
                for handle in handles.values():
                    handle._complete(None, _closed_error(cause))
                self.cond.notify_all()
