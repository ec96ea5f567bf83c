"""One engine replica: an :class:`~pagedkv.Engine` in its own process, as a Ray actor (its own KV
pool, and its own disk tier when the engine flags enable one). The front end
(:mod:`pagedkv.cluster.frontend`) reaches it only through these methods.

Ray is the transport (as vLLM and Ray Serve LLM use it): no home-made RPC. The actor is async
(one event loop, many requests at once); the engine's worker thread steps it.

Invariants:

- :meth:`Replica.generate` is a Ray streaming generator (``num_returns="streaming"``). Its first
  item is an empty batch once the engine has queued the request (a refused one raises there,
  queuing nothing); then each item is a batch of every token produced since the previous item,
  sent at most every :data:`STREAM_INTERVAL` (the first at once: it is the time to first token;
  never a round trip per token); the last is an :class:`Ended`. Cancelling
  it (the front end's ``ray.cancel``) aborts the request: its blocks go back to the pool.
- A request that fails alone (the model gave NaN logits) ends with ``Ended.error``, and so does
  one whose engine's model failed under it: the request may be what broke the model, so the front
  end fails it rather than carrying it to the next replica. An engine that was shut down under a
  request raises ``EngineClosedError``, which the front end treats as the replica's failure.
- An engine whose model failed is replaced, in the same process, by a new one with a new
  ``incarnation`` before the actor answers again (:meth:`Replica._live_engine`): the actor never
  answers heartbeats for an engine that refuses every request. (Ray restarts a replica whose
  process died; this covers one whose process lives on.)
- :meth:`Replica.poll` is heartbeat, KV event feed and load report in one call, answered within
  ``wait`` seconds: the event batches after ``after_seq`` (waking as soon as one is published), or,
  when the publisher's buffer no longer holds them (or ``after_seq`` is None), a snapshot.
- ``incarnation`` is drawn anew at each (re)start: a restarted replica's cache and event sequence
  begin again, and the front end resyncs it from a snapshot before routing to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

from pagedkv.cluster.feed import replica_answer, replica_load
from pagedkv.cluster.router import ReplicaLoad
from pagedkv.engine import Engine, EngineClosedError, TokenEvent, TokenLogprob
from pagedkv.errors import ModelError, PagedKVError
from pagedkv.kv_events import KvEventBatch, KvSnapshot
from pagedkv.observability import tracing
from pagedkv.sampling import SamplingParams
from pagedkv.text.tokenizer import Tokenizer

__all__ = ["STREAM_INTERVAL", "Ended", "PollReply", "Replica", "ReplicaInfo", "Token"]

# At most one stream object per this many seconds: each Ray object costs the replica's process
# about 2 ms of CPU (and GIL) on a loaded 2-core machine, which it takes from the engine's step.
# One stream of 200 tokens of the tiny model (scratch measurement, load average 7): 4.7 ms/token
# with an object per token (1.0 token each), 2.5 ms/token at 10 ms (4 tokens each), 2.6 at 20 ms;
# 2.0 ms/token in process. 10 ms is below what a reader of a stream notices.
STREAM_INTERVAL = 0.01

# (sample index, token id, finish reason, logprob): one token as it crosses the process boundary
# (a tuple pickles in a fraction of a dataclass's bytes and time; the text is the front end's).
Token = tuple[int, int, str | None, TokenLogprob | None]


@dataclass(frozen=True)
class Ended:
    """The last item of a stream: the prompt tokens its replica found cached, and the error that
    failed the request alone (None: it finished)."""

    num_cached_tokens: int
    error: str | None = None


@dataclass(frozen=True)
class ReplicaInfo:
    """What the front end needs of the model, asked once: the same for every replica."""

    tokenizer: Tokenizer
    default_params: SamplingParams
    max_model_len: int
    block_size: int


@dataclass(frozen=True)
class PollReply:
    """One heartbeat: who answered (``pid``, ``incarnation``), its load, and its KV events since
    the seq asked (``batches``) or, when they are gone, a ``snapshot``; ``last_seq``: the batch
    the reply brings the receiver to (a receiver short of it lost one)."""

    incarnation: str
    pid: int
    load: ReplicaLoad
    batches: list[KvEventBatch] | None
    snapshot: KvSnapshot | None
    last_seq: int


class Replica:
    """The actor's class (made remote by :func:`pagedkv.cluster.frontend.spawn_replicas`)."""

    def __init__(self, model: str, engine_kwargs: dict, otlp_endpoint: str | None = None) -> None:
        self._model = model
        # Its KV events are what the front end's router knows of its cache: always on here.
        self._engine_kwargs = {**engine_kwargs, "emit_kv_events": True, "tracer": tracing.configure(otlp_endpoint=otlp_endpoint)}
        # A model that cannot be loaded (a corrupt file) is reported by every call, info() first:
        # raised here, Ray would report only that the actor died, the error's type and text lost.
        self._load_error: PagedKVError | None = None
        try:
            self._start_engine()
        except PagedKVError as error:
            self._load_error = error

    def _start_engine(self) -> None:
        self.engine = Engine.from_pretrained(self._model, **self._engine_kwargs)
        self.engine.grammars.prepare_in_background()  # the first constraint need not wait for it
        self.incarnation = uuid.uuid4().hex
        self._news: asyncio.Event | None = None  # set when an event batch is published (for the engine's life)

    def _live_engine(self) -> Engine:
        """The engine, replaced first if its model failed (the failed one shut down: its blocks
        and worker go; the new one starts with an empty cache and event sequence)."""
        if self._load_error is not None:
            raise self._load_error
        if self.engine.closed:
            self.engine.shutdown(drain=False)
            self._start_engine()
        return self.engine

    def info(self) -> ReplicaInfo:
        engine = self._live_engine()
        return ReplicaInfo(engine.tokenizer, engine.default_params, engine.core.max_model_len, engine.core.config.block_size)

    def pid(self) -> int:
        return os.getpid()

    async def generate(self, token_ids: Sequence[int], params: SamplingParams, cache_salt: str | None,
                       trace_headers: Mapping[str, str] | None) -> AsyncIterator[list[Token] | Ended]:
        engine = self._live_engine()
        handle = engine.submit(token_ids, params, cache_salt=cache_salt, timeout=0, trace_headers=trace_headers)
        ready: asyncio.Queue[TokenEvent | None] = asyncio.Queue()  # None: the handle ended

        async def pump() -> None:
            try:
                with contextlib.suppress(PagedKVError):  # raised again by ``await handle`` below
                    async for event in handle:
                        ready.put_nowait(event)
            finally:
                ready.put_nowait(None)

        pumping = asyncio.ensure_future(pump())
        try:
            yield []
            ended, sent = False, -math.inf
            while not ended:
                batch = [await ready.get()]
                await asyncio.sleep(sent + STREAM_INTERVAL - time.monotonic())  # no wait when due
                while not ready.empty():  # every token already produced rides the same object
                    batch.append(ready.get_nowait())
                if batch[-1] is None:
                    ended = True
                    batch.pop()
                if batch:
                    sent = time.monotonic()
                    yield [(e.index, e.token_id, e.finish_reason, e.logprob) for e in batch if e is not None]
            try:
                output = await handle
            except ModelError as error:
                yield Ended(0, str(error))
                return
            except EngineClosedError as error:
                if error.__cause__ is None:
                    raise  # shut down under it: the replica is going away, the request migrates
                yield Ended(0, str(error))  # its model failed under it, perhaps because of it
                return
            yield Ended(output.num_cached_tokens)
        finally:
            pumping.cancel()
            handle.abort()  # a no-op once it has ended

    async def poll(self, after_seq: int | None, wait: float) -> PollReply:
        engine = self._live_engine()
        publisher = engine.kv_events
        if self._news is None:
            loop, news = asyncio.get_running_loop(), asyncio.Event()
            self._news = news
            publisher.subscribe(lambda _batch: loop.call_soon_threadsafe(news.set))
        self._news.clear()
        if after_seq is not None and publisher.last_seq <= after_seq:
            try:
                await asyncio.wait_for(self._news.wait(), wait)
            except asyncio.TimeoutError:
                pass
        answer = replica_answer(publisher, after_seq, engine.kv_snapshot)
        if isinstance(answer, KvSnapshot):
            return PollReply(self.incarnation, os.getpid(), self.load(), None, answer, answer.seq)
        last_seq = answer[-1].seq if answer else after_seq
        return PollReply(self.incarnation, os.getpid(), self.load(), answer, None, last_seq)  # type: ignore[arg-type]

    def kv_snapshot(self) -> KvSnapshot:
        return self._live_engine().kv_snapshot()

    def load(self) -> ReplicaLoad:
        return replica_load(self._live_engine().core)
