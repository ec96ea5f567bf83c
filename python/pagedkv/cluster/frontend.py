"""The front end of N engine replicas (Ray actors, :mod:`pagedkv.cluster.replica`): a
:class:`Cluster` is an :class:`~pagedkv.server.client.EngineClient`, so the OpenAI server serves it
as it serves one engine. It tokenizes, routes each request with the :class:`Router`, streams the
replica's tokens back, and migrates the requests of a replica that dies.

Everything the cluster does runs in its own thread's event loop (``_loop``): the router, the
replicas' watchers and the requests' drivers touch their state only there, so none needs a lock.
Callers (the server's loop, or any thread) reach it through ``run_coroutine_threadsafe``; handles
wake their consumers as an engine's do (they are :class:`RequestHandle`\\ s).

Invariants:

- The router's index is fed by each replica's KV events and by nothing else: one watcher per
  replica long-polls :meth:`Replica.poll` from the router's ``applied_seq`` (heartbeat, events and
  load in one call, answered within ``poll_wait`` s) and hands each reply to the replica's
  :class:`~pagedkv.cluster.feed.ReplicaFeed` (the protocol, shared with the simulated cluster),
  which applies each batch in order. A gap (a batch lost on the way or refused, so the index stops
  short of the reply's ``last_seq``; or the replica's buffer no longer holds the next batch)
  resynchronises it from the replica's snapshot.
- Health: a replica is routable from its first answered poll (after a resync) until a poll fails
  (Ray reports the actor dead or restarting) or misses its deadline (``poll_wait +
  heartbeat_timeout``); then it leaves the router, and every stream on it migrates. Ray restarts the
  actor (``max_restarts``); a new ``incarnation`` answering rejoins, resynced.
- Text is the front end's: each sample's tokens are detokenized and matched against its stop
  strings here, over all its tokens whichever replicas produced them (the replica does too, to stop
  early, but its text is not used). So a migrated stream's text is the text of its tokens.
- Migration: the unfinished samples of a request whose replica failed are resubmitted, each as its
  own request, prompt plus the tokens already streamed, ``max_tokens`` reduced by their number
  (:func:`~pagedkv.cluster.feed.continuation`), to another replica; the consumer sees each token
  once and in order. A greedy sample's continuation is the uninterrupted run's. (A seeded random
  sample continues from a fresh generator.)
- A request's own fault is never a replica's: a request its replica refuses (``n`` past
  ``max_num_seqs``, say) is refused having built nothing here (its samples' state is made once the
  first replica has queued it), and one whose replica's model failed under it fails with
  :class:`~pagedkv.errors.ModelError` rather than migrating (it may be what broke the model; the
  replica replaces its engine). A sample whose replicas are lost more than
  :data:`MAX_REPLICA_LOSSES` times fails the same way, so no request is carried across every replica.
- Every request ends exactly once, as an engine's do. Only when no replica is alive for
  ``migration_timeout`` s does a request fail (``EngineClosedError``: a 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
from ray.exceptions import RayError, RayTaskError

from pagedkv.cluster.feed import ReplicaFeed, continuation
from pagedkv.cluster.replica import Ended, PollReply, Replica, ReplicaInfo
from pagedkv.cluster.router import NoReplicaError, Router
from pagedkv.engine import (
    CompletionOutput,
    EngineClosedError,
    EngineOverloadedError,
    RequestHandle,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from pagedkv.engine.output_processor import append_token
from pagedkv.errors import InvalidArgumentError, ModelError, PagedKVError
from pagedkv.kv_events import KvSnapshot
from pagedkv.observability.metrics import EngineMetrics
from pagedkv.sampling import SamplingParams
from pagedkv.text.detokenizer import SampleText
from pagedkv.text.prompt import encode_text

__all__ = ["MAX_REPLICA_LOSSES", "Cluster", "ReplicaStatus", "spawn_replicas"]

T = TypeVar("T")

# A long poll returns as soon as an event batch is published, else after this: the heartbeat's
# period. The deadline adds HEARTBEAT_TIMEOUT (a loaded 2-core machine answers a poll in ms).
POLL_WAIT = 0.25
HEARTBEAT_TIMEOUT = 1.0
# How often a dead replica is asked again (Ray queues the call until the actor is back).
REJOIN_RETRY = 0.1
# How long a migrating request waits for any replica to be alive before failing (503).
MIGRATION_TIMEOUT = 30.0
# Replicas a sample may lose (each loss migrates it) before it fails: one kill or restart under a
# request is chance, a third in a row is more likely the request's doing (a prompt that crashes
# the process would otherwise take down every replica in turn).
MAX_REPLICA_LOSSES = 2
# How long shutdown(drain=False) waits for the aborted requests to end (each takes a step or so).
_ABORT_SECONDS = 5.0


def spawn_replicas(num_replicas: int, model: str, engine_kwargs: Mapping[str, Any], *, otlp_endpoint: str | None = None,
                   max_restarts: int = -1, num_cpus: float = 0) -> list[Any]:
    """``num_replicas`` :class:`Replica` actors, each an engine over ``model`` built with
    ``Engine.from_pretrained(model, **engine_kwargs)`` (tracing to ``otlp_endpoint`` if given).
    Ray restarts a dead one up to ``max_restarts`` times (-1: always); a task it was running is
    not retried (``max_task_retries = 0``): the front end migrates its request instead.
    ``num_cpus``: what each reserves in Ray's scheduling (0 lets N replicas share a small machine;
    the engine's threads use what is there)."""
    remote = ray.remote(Replica).options(max_restarts=max_restarts, max_task_retries=0, num_cpus=num_cpus)
    return [remote.remote(model, dict(engine_kwargs), otlp_endpoint) for _ in range(num_replicas)]


@dataclass
class ReplicaStatus:
    """What the front end knows of one replica (read it with :meth:`Cluster.replicas`)."""

    id: str
    alive: bool = False
    pid: int | None = None
    incarnation: str | None = None
    seq: int | None = None  # the router's index of it is at this event batch (None: not routable)
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    deaths: int = 0
    resyncs: int = 0
    served: int = 0  # streams started on it
    streams: int = 0  # streams open on it now
    down_since: float | None = None  # time.monotonic() of its latest death, until it rejoined
    recoveries: list[float] = field(default_factory=list)  # seconds from each death to its rejoining


class _ReplicaLost(Exception):
    """The replica a stream ran on died, restarted, or missed its heartbeat."""


@dataclass
class _Replica:
    status: ReplicaStatus  # what other threads read: the feed's part copied by publish()
    feed: ReplicaFeed
    actor: Any
    died: asyncio.Future  # resolved when this incarnation is declared dead

    def publish(self) -> None:
        """Copies the feed's state into ``status`` (in the cluster's loop)."""
        status, feed = self.status, self.feed
        status.alive, status.seq = feed.member, feed.applied_seq
        status.deaths, status.resyncs = feed.deaths, feed.snapshots
        status.down_since, status.recoveries = feed.down_since, list(feed.recoveries)
        if feed.load is not None:
            load = feed.load
            status.num_waiting, status.num_running, status.kv_usage = load.num_waiting, load.num_running, load.kv_usage


@dataclass
class _Sample:
    text: SampleText
    completion: CompletionOutput
    lost_at: float | None = None  # when its replica was lost, until its next token arrives
    losses: int = 0  # replicas lost under it


@dataclass
class _Flight:
    """One request's state in the front end."""

    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    trace_headers: dict[str, str] | None
    metrics: RequestMetrics
    samples: list[_Sample] = field(default_factory=list)  # made once the first replica has queued it
    output: RequestOutput | None = None  # with the samples: their completions, the metrics
    num_cached_tokens: int = 0
    error: BaseException | None = None
    stopped_here: bool = False  # a stop string ended a sample its replica still runs (it straddled a migration)
    task: asyncio.Task | None = None

    def unfinished(self, indices: Sequence[int]) -> list[int]:
        return [i for i in indices if self.samples[i].completion.finish_reason is None]


@dataclass
class _Leg:
    """One replica stream serving some samples of a request (``indices[k]`` is its sample k)."""

    replica: _Replica
    epoch: int  # its replica's feed's when it was routed: finished there only in the same one
    stream: Any  # ray.ObjectRefGenerator
    indices: list[int]
    ended: bool = False  # its Ended arrived, or it was cancelled
    closed: bool = False
    counted: bool = False  # in its replica's ``streams``


class Cluster:
    """N replicas behind one :class:`Router`, as one engine client."""

    def __init__(self, actors: Sequence[Any], router: Router | None = None, *, policy: str = "prefix_aware",
                 chat_template: str | None = None, metrics: EngineMetrics | None = None, owns_actors: bool = True,
                 poll_wait: float = POLL_WAIT, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 migration_timeout: float = MIGRATION_TIMEOUT) -> None:
        """Fronts ``actors`` (from :func:`spawn_replicas`; killed by :meth:`shutdown` when
        ``owns_actors``). ``router``: None builds one of ``policy`` over the replicas' block
        size. Blocks until the model's details are known (the first replica to answer)."""
        if not actors:
            raise PagedKVError("a cluster needs at least one replica")
        try:
            info: ReplicaInfo = ray.get(actors[0].info.remote())
        except RayTaskError as error:  # the replica could not load the model: its own error, as one engine raises it
            if isinstance(error.cause, PagedKVError):
                raise error.cause from None
            raise
        self.tokenizer = info.tokenizer
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
        self.default_params = info.default_params
        self._max_model_len = info.max_model_len
        self.router = router if router is not None else Router(policy, info.block_size)
        self.metrics = metrics or EngineMetrics()
        self._owns_actors = owns_actors
        self._poll_wait, self._heartbeat_timeout, self._migration_timeout = poll_wait, heartbeat_timeout, migration_timeout
        self._ids = itertools.count()
        self._closing = False
        self._flights: dict[str, _Flight] = {}
        # (lost at, resumed at), time.monotonic(), of each migrated sample: when its replica was
        # found lost, and when its first token from the next replica arrived.
        self.migration_log: list[tuple[float, float]] = []
        self._stopped = False
        self._stop_lock = threading.Lock()
        self._idle = threading.Condition()  # notified when _flights empties
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pagedkv-cluster", daemon=True)
        self._thread.start()
        self._replicas = self._call(self._start_watchers(actors))

    # ---- the engine client ------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    async def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                     cache_salt: str | None = None, trace_headers: Mapping[str, str] | None = None) -> RequestHandle:
        """Queues a request on the replica the router picks; returns once that replica has
        queued it (raising, having queued nothing, what its engine refused). Prompt logprobs are
        refused: a replica's reach the front end only token by token."""
        if params is not None and params.prompt_logprobs is not None:
            raise InvalidArgumentError("prompt_logprobs (and echo with logprobs) are not supported across replicas yet")
        text, token_ids = (prompt, encode_text(self.tokenizer, prompt)) if isinstance(prompt, str) else (None, prompt)
        return await self._submit(text, token_ids, params, cache_salt, trace_headers)

    def wait_ready(self, timeout: float) -> None:
        """Blocks until every replica has answered a heartbeat (raises ``TimeoutError`` after
        ``timeout`` s, naming those that did not)."""
        deadline = time.monotonic() + timeout
        while not all(r.alive for r in self.replicas()):
            if time.monotonic() > deadline:
                missing = [r.id for r in self.replicas() if not r.alive]
                raise TimeoutError(f"replicas {missing} did not start in {timeout} s")
            time.sleep(0.05)

    def health(self) -> dict:
        replicas = self.replicas()
        alive = [r for r in replicas if r.alive]
        return {
            "status": "ok" if alive else "unavailable",
            "num_running": sum(r.num_running for r in alive),
            "num_waiting": sum(r.num_waiting for r in alive),
            "replicas": [dataclasses.asdict(r) for r in replicas],
        }

    def metrics_text(self) -> str:
        return self.metrics.text()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stops accepting; ``drain`` lets the requests in flight finish (waiting up to
        ``timeout`` s), else aborts them (each ends with "abort"). Once none is in flight, stops
        the watchers and kills the owned actors; a drain that times out leaves that to a later
        call."""
        self._closing = True
        if self._stopped:
            return
        if not drain:
            self._loop.call_soon_threadsafe(self._abort_all)
        with self._idle:
            idle = self._idle.wait_for(lambda: not self._flights, timeout if drain else _ABORT_SECONDS)
        if not idle:
            return
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            self._call(self._stop_watchers())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            if self._owns_actors:
                for replica in self._replicas:
                    ray.kill(replica.actor, no_restart=True)

    # ---- what tests and /health read ---------------------------------------------------------

    def replicas(self) -> list[ReplicaStatus]:
        """A copy of each replica's status."""
        return [dataclasses.replace(r.status, recoveries=list(r.status.recoveries)) for r in self._replicas]

    def actor(self, replica_id: str) -> Any:
        return next(r.actor for r in self._replicas if r.status.id == replica_id)

    def indexed_blocks(self, replica_id: str) -> frozenset[tuple[int, str]]:
        """What the router's index holds for a replica now (read in the cluster's loop)."""

        async def read() -> frozenset[tuple[int, str]]:
            return self.router.blocks_of(replica_id)

        return self._call(read())

    # ---- in the cluster's loop ---------------------------------------------------------------

    def _call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _start_watchers(self, actors: Sequence[Any]) -> list[_Replica]:
        replicas = [_Replica(ReplicaStatus(f"r{i}"), ReplicaFeed(self.router, f"r{i}"), actor, self._loop.create_future())
                    for i, actor in enumerate(actors)]
        self._watchers = [asyncio.ensure_future(self._watch(r)) for r in replicas]
        return replicas

    async def _stop_watchers(self) -> None:
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)

    async def _watch(self, replica: _Replica) -> None:
        """The replica's heartbeat, event feed and load (see the module doc)."""
        feed = replica.feed
        deadline = self._poll_wait + self._heartbeat_timeout
        while True:
            try:
                poll = replica.actor.poll.remote(feed.applied_seq, self._poll_wait)
                reply: PollReply = await asyncio.wait_for(_await(poll), deadline)
                if feed.member and not feed.current(reply.incarnation):
                    self._down(replica)  # it restarted between two polls: what ran there is gone
                    continue
                snapshot = reply.snapshot
                if reply.batches is not None and feed.batches(reply.batches, reply.last_seq) is not None:
                    snapshot = await asyncio.wait_for(_await(replica.actor.kv_snapshot.remote()), deadline)
            except (RayError, asyncio.TimeoutError):
                self._down(replica)
                await asyncio.sleep(REJOIN_RETRY)
                continue
            if snapshot is not None:
                if feed.member:
                    feed.resynced(snapshot)
                else:
                    self._up(replica, reply, snapshot)
            feed.report(reply.load)
            replica.publish()

    def _up(self, replica: _Replica, reply: PollReply, snapshot: KvSnapshot) -> None:
        replica.feed.join(time.monotonic(), snapshot, reply.incarnation)
        replica.status.pid, replica.status.incarnation = reply.pid, reply.incarnation
        replica.died = self._loop.create_future()

    def _down(self, replica: _Replica) -> None:
        if not replica.feed.lose(time.monotonic()):
            return
        replica.publish()
        replica.died.set_result(None)

    def _abort_all(self) -> None:
        for flight in list(self._flights.values()):
            if flight.task is not None:
                flight.task.cancel()

    def _abort(self, handle: RequestHandle) -> None:
        flight = self._flights.get(handle.request_id)
        if flight is not None and flight.handle is handle and flight.task is not None:
            self._loop.call_soon_threadsafe(flight.task.cancel)

    # ---- requests ----------------------------------------------------------------------------

    async def _submit(self, text: str | None, token_ids: Sequence[int], params: SamplingParams | None,
                      cache_salt: str | None, trace_headers: Mapping[str, str] | None) -> RequestHandle:
        if self._closing:
            raise EngineClosedError("the cluster is shut down")
        params = self.default_params if params is None else params
        request_id = f"req-{next(self._ids)}"
        prompt_ids = list(token_ids)
        handle = RequestHandle(request_id, text, prompt_ids, self._abort)  # its tokens are pushed by the driver
        flight = _Flight(handle, prompt_ids, params, cache_salt, None if trace_headers is None else dict(trace_headers),
                         RequestMetrics(time.perf_counter()))
        started = asyncio.run_coroutine_threadsafe(self._start(flight), self._loop)
        await asyncio.wrap_future(started)
        return handle

    async def _start(self, flight: _Flight) -> None:
        """Queues the request's first leg (raising what its replica refused), then drives it."""
        params = flight.params
        leg = await self._leg(flight, list(range(params.n)), first=True)
        flight.samples = [_Sample(SampleText(self.tokenizer, params.stop),
                                  CompletionOutput(i, logprobs=[] if params.logprobs else None)) for i in range(params.n)]
        flight.output = RequestOutput(flight.handle.request_id, flight.prompt_ids, [s.completion for s in flight.samples],
                                      flight.metrics, prompt=flight.handle.prompt)
        self._flights[flight.handle.request_id] = flight
        flight.task = asyncio.ensure_future(self._drive(flight, leg))

    async def _drive(self, flight: _Flight, leg: _Leg) -> None:
        try:
            await self._run(flight, leg.indices, leg)
        except asyncio.CancelledError:
            pass  # aborted: the unfinished samples end with "abort" below
        except Exception as error:  # noqa: BLE001 - a request's failure (or a bug) ends it, never the cluster
            flight.error = error
        self._end(flight)

    async def _run(self, flight: _Flight, indices: list[int], leg: _Leg | None) -> None:
        """Runs samples ``indices`` to their end, migrating them while their replica fails."""
        while True:
            if leg is None:
                leg = await self._leg(flight, indices)
            try:
                await self._stream(flight, leg)
                return
            except _ReplicaLost:
                lost_at = time.monotonic()
            finally:
                self._close(leg)
            indices = flight.unfinished(indices)
            for index in indices:
                sample = flight.samples[index]
                sample.lost_at, sample.losses = lost_at, sample.losses + 1
                if sample.losses > MAX_REPLICA_LOSSES:
                    raise ModelError(f"request {flight.handle.request_id!r}: {sample.losses} replicas were lost under it")
            if len(indices) > 1:  # each sample continues from its own tokens: one request each
                await asyncio.gather(*(self._run(flight, [i], None) for i in indices))
                return
            if not indices:
                return
            leg = None

    async def _leg(self, flight: _Flight, indices: list[int], first: bool = False) -> _Leg:
        """A stream of samples ``indices`` queued on a replica the router picks (every sample for
        the first leg; else one, as prompt plus its tokens so far)."""
        params, prompt = flight.params, flight.prompt_ids
        if not first:
            (index,) = indices
            prompt, params = continuation(prompt, params, flight.samples[index].completion.token_ids)
        excluded: set[str] = set()
        deadline = time.monotonic() + self._migration_timeout
        while True:
            try:
                replica_id = self.router.route(prompt, flight.cache_salt, exclude=excluded)
            except NoReplicaError:
                if first and not excluded:
                    raise EngineClosedError("no replica is alive") from None
                if time.monotonic() > deadline:
                    raise EngineClosedError(f"no replica alive for {self._migration_timeout} s") from None
                excluded.clear()
                await asyncio.sleep(REJOIN_RETRY)
                continue
            replica = next(r for r in self._replicas if r.status.id == replica_id)
            stream = replica.actor.generate.options(num_returns="streaming").remote(prompt, params, flight.cache_salt,
                                                                                 flight.trace_headers)
            leg = _Leg(replica, replica.feed.epoch, stream, indices)
            try:
                await self._next(leg)  # the replica queued it
            except _ReplicaLost:
                self._close(leg)
                excluded.add(replica_id)
                continue
            except EngineOverloadedError:
                self._close(leg)
                if first:
                    raise
                excluded.add(replica_id)
                continue
            except BaseException:
                self._close(leg)
                raise
            replica.status.served += 1
            replica.status.streams += 1
            leg.counted = True
            return leg

    async def _stream(self, flight: _Flight, leg: _Leg) -> None:
        """Delivers the leg's tokens until it ends (or every sample it serves has, one by a stop
        string only the front end saw: the replica is then cancelled)."""
        while flight.unfinished(leg.indices) or not flight.stopped_here:
            item = await self._next(leg)
            if isinstance(item, Ended):
                leg.ended = True
                flight.num_cached_tokens = flight.num_cached_tokens or item.num_cached_tokens
                if item.error is not None:
                    raise ModelError(f"request {flight.handle.request_id!r} failed: {item.error}")
                return
            for index, token_id, reason, logprob in item:
                self._deliver(flight, leg.indices[index], token_id, reason, logprob)

    async def _next(self, leg: _Leg) -> Any:
        """The leg's next item; raises :class:`_ReplicaLost` if its replica fails first, and
        the cause of a request the replica refused."""
        task = asyncio.ensure_future(_next_item(leg.stream))
        died = leg.replica.died
        await asyncio.wait({task, died}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise _ReplicaLost()
        try:
            return task.result()
        except RayTaskError as error:
            cause = error.cause
            if isinstance(cause, PagedKVError) and not isinstance(cause, EngineClosedError):
                raise cause from None
            raise _ReplicaLost() from error
        except (RayError, StopAsyncIteration) as error:
            raise _ReplicaLost() from error

    def _close(self, leg: _Leg) -> None:
        """Ends the leg's stream: a leg left before its end is cancelled at the replica."""
        if leg.closed:
            return
        leg.closed = True
        leg.replica.status.streams -= leg.counted
        if not leg.ended:
            leg.ended = True
            with contextlib.suppress(RayError, ValueError):
                ray.cancel(leg.stream)
        leg.replica.feed.finished(leg.epoch)

    def _deliver(self, flight: _Flight, index: int, token_id: int, reason: str | None, logprob: TokenLogprob | None) -> None:
        sample = flight.samples[index]
        assert flight.output is not None, "samples come with their output"
        if sample.completion.finish_reason is not None:
            return  # ended here by a stop string; its replica had not seen it yet
        if sample.lost_at is not None:
            self.migration_log.append((sample.lost_at, time.monotonic()))
            sample.lost_at = None
        try:
            event = append_token(flight.output, sample.text, index, token_id, reason, logprob, time.perf_counter())
        except Exception as error:  # noqa: BLE001 - whatever the tokenizer raises fails this request only
            raise ModelError(f"request {flight.handle.request_id!r}: its tokens cannot be decoded: {error!r}") from None
        flight.stopped_here = flight.stopped_here or (reason is None and event.finish_reason is not None)
        flight.handle._push(event)

    def _end(self, flight: _Flight) -> None:
        for sample in flight.samples:
            sample.completion.finish_reason = sample.completion.finish_reason or ("error" if flight.error else "abort")
        metrics = flight.metrics
        metrics.finished_time = time.perf_counter()
        output = flight.output
        assert output is not None, "a flight ends once its samples are made"
        output.finished, output.num_cached_tokens = True, flight.num_cached_tokens
        output.error = None if flight.error is None else str(flight.error)
        if flight.error is None:
            self.metrics.record_finished(metrics.ttft, metrics.tpot, metrics.e2e_latency or 0.0)
        del self._flights[flight.handle.request_id]
        flight.handle._complete(output, flight.error)
        with self._idle:
            self._idle.notify_all()


async def _await(ref: Any) -> Any:
    return await ref


async def _next_item(stream: Any) -> Any:
    ref = await stream.__anext__()
    return await ref
