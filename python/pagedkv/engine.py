"""The threaded engine: submit requests from any thread, stream their tokens, or generate a batch.

A background worker owns an :class:`~pagedkv.engine_core.EngineCore` and runs its step loop,
sleeping on a condition variable while there is nothing to do and waking on submission. Requests
reach it through an inbox guarded by that condition; results flow back through per-request
handles. Every submission ends in exactly one of: its finished output, an abort, or an error
raised from the handle, so no request is ever silently lost.

Back-pressure: at most ``max_waiting`` requests may be queued (inbox plus the scheduler's waiting
queue); ``submit`` blocks until there is room, or raises :class:`EngineOverloadedError` after
``timeout``.

Shutdown (:meth:`Engine.shutdown`): ``drain=True`` (the default, and what ``with Engine(...)``
does) stops accepting submissions and finishes every request already submitted; ``drain=False``
aborts them (their handles end with ``finish_reason == "abort"``).
"""

from __future__ import annotations

import asyncio
import itertools
import operator
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

from pagedkv.engine_core import (
    EngineCore,
    PagedModelRunner,
    RequestOutput,
    EngineConfig,
    TokenEvent,
)
from pagedkv.errors import DuplicateSequenceError, InvalidArgumentError, PagedKVError
from pagedkv.metrics import EngineMetrics
from pagedkv.model import LlamaConfig, LlamaModel, SamplingParams
from pagedkv.model.tokenizer import Tokenizer, load_tokenizer
from pagedkv.model.weights import LlamaWeights, load_checkpoint

__all__ = ["Engine", "EngineClosedError", "EngineOverloadedError", "RequestHandle"]


class EngineClosedError(PagedKVError, RuntimeError):
    """The engine is shut down (or its worker died) and takes no more requests."""


class EngineOverloadedError(PagedKVError, RuntimeError):
    """The waiting queue stayed full for the whole submission timeout."""


_DONE = object()  # end-of-stream marker in a handle's queue


class RequestHandle:
    """A submitted request: iterate it for tokens as they are produced (blocking), ``async for``
    it in asyncio, or wait for the whole :class:`RequestOutput` with :meth:`result` / ``await``."""

    def __init__(self, engine: "Engine", request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self._engine = engine
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._finished = threading.Event()
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None

    # Called by the worker.
    def _push(self, event: TokenEvent) -> None:
        self._events.put(event)

    def _complete(self, output: RequestOutput | None, error: BaseException | None = None) -> None:
        self._output, self._error = output, error
        self._finished.set()
        self._events.put(_DONE)

    # Consumer side.
    def __iter__(self) -> Iterator[TokenEvent]:
        """Tokens as they are produced; raises the request's error, if it failed, at the end."""
        while (event := self._events.get()) is not _DONE:
            yield event  # type: ignore[misc]
        self._raise_if_failed()

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        while (event := await loop.run_in_executor(None, self._events.get)) is not _DONE:
            yield event  # type: ignore[misc]
        self._raise_if_failed()

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Blocks until the request ends; returns its output or raises its error."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} still running after {timeout} s")
        self._raise_if_failed()
        assert self._output is not None
        return self._output

    def __await__(self):
        return asyncio.get_running_loop().run_in_executor(None, self.result).__await__()

    def done(self) -> bool:
        """Whether the request has ended."""
        return self._finished.is_set()

    def abort(self) -> None:
        """Asks the engine to stop this request; it ends with ``finish_reason == "abort"``."""
        self._engine.abort(self.request_id)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


@dataclass
class _Submission:
    handle: RequestHandle
    params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float


class Engine:
    """Continuous batching over a paged KV cache, driven by a background worker thread."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        config: EngineConfig = EngineConfig(),
        *,
        max_waiting: int = 1024,
        metrics: EngineMetrics | None = None,
    ) -> None:
        if max_waiting < 1:
            raise InvalidArgumentError(f"max_waiting must be ≥ 1, got {max_waiting}")
        eos = model.config.eos_token_ids[0] if model.config.eos_token_ids else None
        runner = PagedModelRunner(model, config.num_blocks, config.block_size, config.kv_dtype)
        self.core = EngineCore(runner, config, eos_token_id=eos)
        self.tokenizer = tokenizer
        self.model = model
        self.metrics = metrics or EngineMetrics()
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._inbox: list[_Submission] = []
        self._aborts: list[str] = []
        self._handles: dict[str, RequestHandle] = {}  # admitted to the core, owned by the worker
        self._in_flight: set[str] = set()  # submitted and not yet ended, guarded by _cond
        self._num_waiting = 0  # the scheduler's waiting queue, as of the last step
        self._last_stats: dict[str, float] = {}
        self._closing = False
        self._drain = True
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._worker = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._worker.start()

    @classmethod
    def from_pretrained(cls, path: str | Path = "tiny", *, seed: int = 0, **kwargs) -> "Engine":
        """An engine over a Hugging Face Llama checkpoint directory (``config.json`` +
        ``*.safetensors`` [+ ``tokenizer.json``]), or over the built-in ``"tiny"`` model with
        seeded random weights. Keyword arguments go to :class:`EngineConfig` or the engine."""
        engine_keys = {"max_waiting", "metrics"}
        engine_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in engine_keys}
        if str(path) == "tiny":
            weights = LlamaWeights.random(LlamaConfig.tiny(), seed=seed)
            tokenizer = load_tokenizer(None, weights.config.vocab_size)
        else:
            weights = load_checkpoint(path)
            tokenizer = load_tokenizer(path, weights.config.vocab_size)
        return cls(LlamaModel(weights), tokenizer, EngineConfig(**kwargs), **engine_kwargs)

    # ---- submission -------------------------------------------------------------------------

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        timeout: float | None = None,
    ) -> RequestHandle:
        """Queues a request from any thread (a text prompt or token ids); returns its handle.
        Blocks while the waiting queue is full (up to ``timeout`` seconds)."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self._check_tokens(prompt)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        handle = RequestHandle(self, request_id, text, token_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if request_id in self._in_flight:
                raise DuplicateSequenceError(f"request id {request_id!r} is in flight")
            while self._accepting() and len(self._inbox) + self._num_waiting >= self.max_waiting:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise EngineOverloadedError(f"{self.max_waiting} requests already waiting")
                self._cond.wait(remaining)
            if not self._accepting():
                raise EngineClosedError("the engine is shut down") from self._dead
            self._inbox.append(_Submission(handle, params, priority, cache_salt, time.perf_counter()))
            self._in_flight.add(request_id)
            self._cond.notify_all()
        return handle

    def _check_tokens(self, prompt: Sequence[int]) -> list[int]:
        """Validates a token-id prompt here, in the caller's thread, so bad input raises at once."""
        try:
            token_ids = [operator.index(t) for t in prompt]
        except TypeError as error:
            raise InvalidArgumentError(f"a prompt is a str or a sequence of int token ids: {error}") from None
        vocab = self.model.config.vocab_size
        if not token_ids:
            raise InvalidArgumentError("empty prompt")
        if not all(0 <= t < vocab for t in token_ids):
            raise InvalidArgumentError(f"prompt token ids must lie in [0, {vocab})")
        if len(token_ids) >= self.core.max_model_len:
            raise InvalidArgumentError(
                f"prompt of {len(token_ids)} tokens leaves no room to generate within max_model_len {self.core.max_model_len}"
            )
        return token_ids

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Runs a batch to completion; outputs in prompt order."""
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        handles = [self.submit(p, params) for p in batch]
        return [h.result() for h in handles]

    def abort(self, request_id: str) -> None:
        """Stops a request in any state (a no-op once it has ended)."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify_all()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops the worker: ``drain`` finishes submitted requests first, else aborts them."""
        with self._cond:
            self._closing = True
            self._drain = self._drain and drain
            self._cond.notify_all()
        self._worker.join(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(drain=exc[0] is None)

    def stats(self) -> dict[str, float]:
        """The scheduler's cumulative figures (as of the last step)."""
        with self._cond:
            return dict(self._last_stats)

    def _accepting(self) -> bool:
        return not self._closing and self._dead is None

    # ---- worker -----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._take_work():
                events, finished = self.core.step()
                self._deliver(events, finished)
        except BaseException as error:  # the model or scheduler failed: fail every request loudly
            self._die(error)

    def _take_work(self) -> bool:
        """Waits for work, then moves submissions and aborts into the core. False: stop."""
        with self._cond:
            while not (self._inbox or self._aborts or self.core.has_unfinished() or self._closing):
                self._cond.wait()
            if self._closing and not self._drain:
                self._aborts.extend(self._handles)
                self._aborts.extend(s.handle.request_id for s in self._inbox)
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for submission in inbox:
            self._admit(submission)
        for request_id in aborts:
            self._abort(request_id)
        with self._cond:
            self._num_waiting = self.core.scheduler.num_waiting
            self._cond.notify_all()
            return self.core.has_unfinished() or not self._closing or bool(self._inbox)

    def _admit(self, submission: _Submission) -> None:
        handle = submission.handle
        try:
            self.core.add_request(
                handle.request_id,
                handle.prompt_token_ids,
                submission.params,
                prompt=handle.prompt,
                arrival_time=submission.arrival_time,
                priority=submission.priority,
                cache_salt=submission.cache_salt,
            )
        except PagedKVError as error:
            self._end(handle, None, error)
            return
        self._handles[handle.request_id] = handle

    def _abort(self, request_id: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is None:
            return  # already finished, or never admitted
        output = self.core.abort(request_id)
        self._decode_text(output)
        self._end(handle, output)

    def _deliver(self, events: list[TokenEvent], finished: list[RequestOutput]) -> None:
        for event in events:
            self._handles[event.request_id]._push(event)
        for output in finished:
            self._decode_text(output)
            m = output.metrics
            self.metrics.record_finished(m.ttft, m.tpot, m.e2e_latency or 0.0)
            self._end(self._handles.pop(output.request_id), output)
        stats = self.core.stats()
        self.metrics.record_scheduler(stats)
        with self._cond:
            self._last_stats = stats

    def _end(self, handle: RequestHandle, output: RequestOutput | None, error: BaseException | None = None) -> None:
        with self._cond:
            self._in_flight.discard(handle.request_id)
        handle._complete(output, error)

    def _decode_text(self, output: RequestOutput) -> None:
        for completion in output.outputs:
            completion.text = self.tokenizer.decode(completion.token_ids)

    def _die(self, error: BaseException) -> None:
        with self._cond:
            self._dead = error
            inbox, self._inbox = self._inbox, []
            self._cond.notify_all()
        failure = EngineClosedError(f"the engine worker failed: {error!r}")
        failure.__cause__ = error
        for handle in [*self._handles.values(), *(s.handle for s in inbox)]:
            self._end(handle, None, failure)
        self._handles.clear()
