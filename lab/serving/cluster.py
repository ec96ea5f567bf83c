"""A simulated cluster: R replicas of the simulated model behind the :class:`~pagedkv.cluster.Router`,
in virtual time, with delayed and lossy KV events, replica failures, and request migration.

Design (a discrete-event simulation over one virtual timeline):

- Each replica is an :class:`~pagedkv.engine.EngineCore` over a :class:`SimulatedRunner` (the
  Rust scheduler and block manager run for real) on its own :class:`VirtualClock`. A replica step
  is computed when its start event comes up (its clock set to that time, the runner advancing it
  by the modelled duration); what the step produced (tokens, finishes, its load report) becomes
  visible at its end, when the replica's next step starts. The event heap orders every replica's
  ends, arrivals and deliveries by time (ties by insertion), so the clocks advance in lockstep
  with the timeline: nothing observes a replica's step before it has ended.
- The router's side of each replica (membership, its KV event feed, gaps and resyncs, its load,
  what a migrated request asks) is :mod:`pagedkv.cluster.feed`, the protocol the Ray front end
  drives too; this module only carries its messages.
- KV events: each replica's core publishes a batch after each step (:attr:`EngineCore.kv_events`),
  stamped with the replica's clock (its step's end); the router receives it ``event_delay_s``
  later, unless it is lost (each batch with probability ``event_loss``; load reports share the
  channel and its loss). On a gap the router asks the replica (one delay each way) for its replay
  since the router's seq, or for a snapshot (:meth:`EngineCore.kv_snapshot`) when the replay
  buffer no longer reaches; replies are not lost (a request/response channel). With one delay
  for every message, replies overtake nothing. (A snapshot taken while a step runs includes that
  step's batch, numbered as such: the router then ignores the batch when it lands.)
- Failures: each replica fails after an exponential time of mean ``mtbf_s`` (None: never). A dead
  replica's running step never ends. The router learns of it ``detect_s`` later (the heartbeat
  deadline) and every request it held (those routed there meanwhile too) is migrated: routed
  again and resubmitted as its prompt plus the tokens already streamed, asking only for the rest.
  The replica restarts ``restart_s`` after detection with an empty cache and a new publisher,
  and rejoins. While no replica is alive requests wait and are routed at the next restart.
- A request's client sees one stream: tokens are appended in order as steps end, from whichever
  replica serves it; the simulated model's token depends only on (position, input token), so a
  greedy migrated stream must equal an uninterrupted one (what the tests check).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from lab.serving.simulation import ServingSetup
from lab.serving.workload import Workload
from pagedkv.cluster.feed import ReplicaFeed, continuation, replica_answer, replica_load
from pagedkv.cluster.router import NoReplicaError, ReplicaLoad, Router
from pagedkv.engine import EngineCore, RequestOutput, SimulatedRunner, TokenEvent, VirtualClock
from pagedkv.errors import InvalidArgumentError
from pagedkv.kv_events import KvEventBatch
from pagedkv.models.simulated import SimulatedModel
from pagedkv.sampling import SamplingParams

__all__ = ["ClusterRequest", "ClusterResult", "ClusterSetup", "simulate_cluster"]


@dataclass(frozen=True)
class ClusterSetup:
    """A simulated cluster: ``replicas`` engines of ``replica`` each, routed by ``policy``."""

    replicas: int = 8
    policy: str = "prefix_aware"
    replica: ServingSetup = field(default_factory=lambda: ServingSetup(num_blocks=2048, max_num_seqs=64))
    event_delay_s: float = 0.002  # one way, router ↔ replica: KV events, load reports, resyncs
    event_loss: float = 0.0  # probability that a KV event batch or a load report is lost
    # Batches a replica can replay to the router: fewer than its publisher keeps models a smaller
    # replay buffer (a longer gap is healed from a snapshot).
    replay: int = 1024
    mtbf_s: float | None = None  # mean time between failures of each replica; None: never fails
    detect_s: float = 0.5  # failure → the router knows (heartbeat deadline)
    restart_s: float = 2.0  # detection → the replica serves again (empty cache)
    queue_weight: float = 0.5  # the router's cost weights (pagedkv.cluster.Router)
    kv_weight: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.replicas <= 1024:
            raise InvalidArgumentError(f"replicas must be in [1, 1024], got {self.replicas!r}")
        if self.replay < 0:
            raise InvalidArgumentError(f"replay must be ≥ 0, got {self.replay!r}")
        if not 0 <= self.event_loss < 1:
            raise InvalidArgumentError(f"event_loss must be in [0, 1), got {self.event_loss!r}")
        for name in ("event_delay_s", "detect_s", "restart_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise InvalidArgumentError(f"{name} must be finite and ≥ 0, got {getattr(self, name)!r}")
        if self.mtbf_s is not None and not 0 < self.mtbf_s < math.inf:
            raise InvalidArgumentError(f"mtbf_s must be None or finite and > 0, got {self.mtbf_s!r}")


@dataclass
class ClusterRequest:
    """One client request as the client saw it, across every replica that served it."""

    request_id: str
    arrival_s: float
    prompt_len: int
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)  # the client's stream
    first_token_s: float | None = None
    finished_s: float | None = None
    attempts: int = 0  # submissions: 1 + migrations
    replica: int | None = None  # serving it now

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


@dataclass
class ClusterResult:
    """What a simulated cluster run measured (virtual seconds unless named wall)."""

    setup: ClusterSetup
    requests: list[ClusterRequest]  # in arrival order
    # Per replica, modelled step time within the arrival window (first to last arrival: the
    # steady state, without the drain of the last long outputs), and over the whole run.
    busy_s: list[float]
    busy_whole_run_s: list[float]
    served: list[int]  # per replica: requests routed to it (migrations included)
    window_tokens: int  # tokens streamed to clients within the arrival window
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    failures: int
    migrations: int
    lost_messages: int
    replays: int  # gaps healed from a publisher's replay buffer
    snapshots: int  # gaps healed from a snapshot
    route_wall_s: float  # wall time spent in Router.route
    routes: int
    # At the end, once every message in flight has landed: live replicas whose router index
    # equals their engine's blocks, and those whose latest batches were lost unseen (the router
    # is behind and cannot know it until the next batch). The rest (live, not behind, not in
    # sync) would be a router bug.
    index_live: int
    index_in_sync: int
    index_behind: int

    def summary(self) -> dict[str, object]:
        """The headline figures: hit rate, throughput, TTFT percentiles, load imbalance."""
        done = [r for r in self.requests if r.finished_s is not None]
        start = min(r.arrival_s for r in self.requests)
        end = max(r.finished_s for r in done)  # type: ignore[type-var]
        ttft = np.array([r.ttft for r in done if r.ttft is not None])
        first, last = self.requests[0].arrival_s, self.requests[-1].arrival_s
        return {
            "policy": self.setup.policy,
            "replicas": self.setup.replicas,
            "requests": len(self.requests),
            "completed": len(done),
            "duration_s": end - start,
            # Completed requests over first arrival to last finish (includes the drain), and
            # tokens streamed per second within the arrival window (the steady state).
            "throughput_requests_per_s": len(done) / (end - start),
            "throughput_tokens_per_s": sum(len(r.token_ids) for r in done) / (end - start),
            "window_tokens_per_s": self.window_tokens / (last - first) if last > first else 0.0,
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "prefix_hit_rate": self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0,
            # max/mean over replicas (1.0 is perfect balance): of busy time within the arrival
            # window, over the whole run, and of requests routed.
            "load_imbalance": _imbalance(self.busy_s),
            "load_imbalance_whole_run": _imbalance(self.busy_whole_run_s),
            "request_imbalance": _imbalance(self.served),
            "failures": self.failures,
            "migrations": self.migrations,
            "lost_messages": self.lost_messages,
            "replays": self.replays,
            "snapshots": self.snapshots,
            "route_us_per_request": 1e6 * self.route_wall_s / self.routes if self.routes else 0.0,
            "index_live": self.index_live,
            "index_in_sync": self.index_in_sync,
            "index_behind": self.index_behind,
        }


class _Replica:
    """One engine incarnation's state (its feed's ``epoch`` counts its starts)."""

    def __init__(self, index: int, router: Router) -> None:
        self.index = index
        self.name = f"replica-{index}"
        self.feed = ReplicaFeed(router, self.name)
        self.alive = False
        self.stepping = False  # a step-end event is queued
        self.clock = VirtualClock()
        self.core: EngineCore | None = None
        self.ended: tuple[list[TokenEvent], list[RequestOutput]] = ([], [])  # the running step's results
        self.requests: dict[str, ClusterRequest] = {}  # engine request id → client request


class _Cluster:
    def __init__(self, workload: Workload, setup: ClusterSetup) -> None:
        self.setup = setup
        self.workload = workload
        self.rng = random.Random(setup.seed)
        self.router = Router(
            setup.policy, setup.replica.block_size, queue_weight=setup.queue_weight, kv_weight=setup.kv_weight
        )
        self.heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self.order = itertools.count()
        self.now = 0.0
        self.replicas = [_Replica(i, self.router) for i in range(setup.replicas)]
        self.by_name = {r.name: r for r in self.replicas}
        self.requests = [
            ClusterRequest(r.request_id, r.arrival_s, r.prompt_len, r.max_tokens) for r in workload.requests
        ]
        self.prompts = {r.request_id: r for r in workload.requests}
        self.parked: list[ClusterRequest] = []  # no replica alive
        self.remaining = len(self.requests)
        self.busy_s = [0.0] * setup.replicas
        self.busy_whole_run_s = [0.0] * setup.replicas
        self.window = (self.requests[0].arrival_s, self.requests[-1].arrival_s) if self.requests else (0.0, 0.0)
        self.window_tokens = 0
        self.served = [0] * setup.replicas
        self.prefix = [0, 0]  # queried, hit: of replicas already discarded
        self.failures = self.migrations = self.lost = 0
        self.route_wall_s = 0.0
        self.routes = 0

    # -- the timeline ---------------------------------------------------------------------------

    def at(self, t: float, action: Callable[..., None], *args: object) -> None:
        heapq.heappush(self.heap, (t, next(self.order), action, args))

    def run(self) -> ClusterResult:
        for replica in self.replicas:
            self.start(replica)
        for request in self.requests:
            self.at(request.arrival_s, self.arrive, request)
        while self.remaining:
            self.now, _, action, args = heapq.heappop(self.heap)
            action(*args)
        # Let the messages in flight land (no step, failure or restart happens any more), then
        # compare each live replica's index with its engine's blocks.
        messages = (self.deliver_load, self.deliver_batch, self.answer_resync, self.resynced)
        while self.heap:
            self.now, _, action, args = heapq.heappop(self.heap)
            if action in messages:
                action(*args)
        live = in_sync = behind = 0
        for replica in self.replicas:
            if replica.alive and replica.core is not None:
                live += 1
                if self.router.applied_seq(replica.name) < replica.core.kv_events.last_seq:
                    behind += 1  # its latest batches were lost and no later one revealed the gap
                elif self.router.blocks_of(replica.name) == replica.core.kv_snapshot().blocks:
                    in_sync += 1
            if replica.core is not None:
                self.discard(replica)
        return ClusterResult(
            self.setup,
            self.requests,
            self.busy_s,
            self.busy_whole_run_s,
            self.served,
            self.window_tokens,
            self.prefix[0],
            self.prefix[1],
            self.failures,
            self.migrations,
            self.lost,
            sum(r.feed.replays for r in self.replicas),
            sum(r.feed.snapshots for r in self.replicas),
            self.route_wall_s,
            self.routes,
            live,
            in_sync,
            behind,
        )

    # -- requests -------------------------------------------------------------------------------

    def arrive(self, request: ClusterRequest) -> None:
        self.dispatch(request)

    def dispatch(self, request: ClusterRequest, exclude: tuple[str, ...] = ()) -> None:
        """Routes ``request`` (the rest of it, after the tokens already streamed) and submits it."""
        source = self.prompts[request.request_id]
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True, seed=0)
        prompt, params = continuation(source.prompt_token_ids.tolist(), params, request.token_ids)
        started = time.perf_counter()
        try:
            name = self.router.route(prompt, exclude=exclude)
        except NoReplicaError:
            self.parked.append(request)
            return
        finally:
            self.route_wall_s += time.perf_counter() - started
            self.routes += 1
        replica = self.by_name[name]
        request.attempts += 1
        request.replica = replica.index
        self.served[replica.index] += 1
        engine_id = f"{request.request_id}#{request.attempts}"
        replica.requests[engine_id] = request
        if not replica.alive:
            return  # routed to a replica that died unseen: migrated when its death is detected
        assert replica.core is not None
        replica.core.add_request(engine_id, prompt, params, arrival_time=self.now)
        if not replica.stepping:
            replica.stepping = True
            self.at(self.now, self.step_end, replica, replica.feed.epoch)

    def step_end(self, replica: _Replica, generation: int) -> None:
        """The replica's running step ends now: its results become visible; the next starts."""
        if not self.current(replica, generation):
            return
        events, finished = replica.ended
        replica.ended = ([], [])
        if self.window[0] <= self.now <= self.window[1]:
            self.window_tokens += len(events)
        for event in events:
            request = replica.requests[event.request_id]
            request.token_ids.append(event.token_id)
            if request.first_token_s is None:
                request.first_token_s = self.now
        for output in finished:
            request = replica.requests.pop(output.request_id)
            request.finished_s = self.now
            request.replica = None
            replica.feed.finished(generation)
            self.remaining -= 1
        core = replica.core
        assert core is not None
        self.send(self.deliver_load, replica, generation, replica_load(core))
        if core.has_unfinished():
            replica.clock.now = self.now
            replica.ended = core.step()
            self.busy_whole_run_s[replica.index] += replica.clock.now - self.now
            first, last = self.window
            self.busy_s[replica.index] += max(0.0, min(replica.clock.now, last) - max(self.now, first))
            self.at(replica.clock.now, self.step_end, replica, generation)
        else:
            replica.stepping = False

    # -- KV events and load reports -------------------------------------------------------------

    def send(self, action: Callable[..., None], *args: object) -> None:
        """One lossy message to the router, ``event_delay_s`` from now."""
        if self.setup.event_loss and self.rng.random() < self.setup.event_loss:
            self.lost += 1
            return
        self.at(self.now + self.setup.event_delay_s, action, *args)

    def publish(self, replica: _Replica, generation: int, batch: KvEventBatch) -> None:
        """A publisher's subscriber: the batch leaves the replica at its stamp (its step's end)."""
        if self.setup.event_loss and self.rng.random() < self.setup.event_loss:
            self.lost += 1
            return
        self.at(batch.timestamp + self.setup.event_delay_s, self.deliver_batch, replica, generation, batch)

    def current(self, replica: _Replica, generation: int) -> bool:
        """Whether a message of ``generation`` still concerns a replica the router has."""
        return generation == replica.feed.epoch and replica.alive

    def deliver_load(self, replica: _Replica, generation: int, load: ReplicaLoad) -> None:
        if self.current(replica, generation):
            replica.feed.report(load)

    def deliver_batch(self, replica: _Replica, generation: int, batch: KvEventBatch) -> None:
        if not self.current(replica, generation):
            return
        seq = replica.feed.batches([batch], batch.seq)
        if seq is not None:
            self.at(self.now + self.setup.event_delay_s, self.answer_resync, replica, generation, seq)

    def answer_resync(self, replica: _Replica, generation: int, seq: int) -> None:
        """At the replica: its replay since ``seq``, or a snapshot when the buffer is short."""
        if not self.current(replica, generation):
            return
        core = replica.core
        assert core is not None
        reply = replica_answer(core.kv_events, seq, core.kv_snapshot, self.setup.replay)
        self.at(self.now + self.setup.event_delay_s, self.resynced, replica, generation, reply)

    def resynced(self, replica: _Replica, generation: int, reply) -> None:
        if self.current(replica, generation):
            replica.feed.resynced(reply)

    # -- failures -------------------------------------------------------------------------------

    def start(self, replica: _Replica) -> None:
        """A fresh engine (empty cache, new publisher) joins the router."""
        setup = self.setup.replica
        replica.feed.join(self.now)
        replica.alive = True
        replica.stepping = False
        replica.clock = VirtualClock(self.now)
        generation = replica.feed.epoch
        runner = SimulatedRunner(SimulatedModel(cost=setup.cost), replica.clock, max_model_len=setup.max_model_len)
        config = replace(setup.scheduler_config(enable_prefix_caching=True), emit_kv_events=True)
        replica.core = EngineCore(runner, config, clock=replica.clock)
        replica.core.kv_events.subscribe(lambda batch: self.publish(replica, generation, batch))
        if self.setup.mtbf_s is not None:
            self.at(self.now + self.rng.expovariate(1.0 / self.setup.mtbf_s), self.fail, replica, generation)
        parked, self.parked = self.parked, []
        for request in parked:
            self.dispatch(request)

    def fail(self, replica: _Replica, generation: int) -> None:
        if not self.current(replica, generation):
            return
        self.failures += 1
        replica.alive = False
        self.discard(replica)
        self.at(self.now + self.setup.detect_s, self.detected, replica, generation)

    def detected(self, replica: _Replica, generation: int) -> None:
        """The heartbeat deadline passed: the router drops the replica; its requests move."""
        replica.feed.lose(self.now)
        held, replica.requests = list(replica.requests.values()), {}
        for request in held:
            self.migrations += 1
            self.dispatch(request)
        self.at(self.now + self.setup.restart_s, self.start, replica)

    def discard(self, replica: _Replica) -> None:
        """Drops the engine (its running step never ends), keeping its prefix-cache figures."""
        assert replica.core is not None
        stats = replica.core.stats()
        self.prefix[0] += int(stats["prefix_queried_tokens"])
        self.prefix[1] += int(stats["prefix_hit_tokens"])
        replica.core = None
        replica.ended = ([], [])


def _imbalance(values: list[float] | list[int]) -> float:
    mean = float(np.mean(values))
    return float(np.max(values)) / mean if mean > 0 else 1.0


def simulate_cluster(workload: Workload, setup: ClusterSetup) -> ClusterResult:
    """Runs ``workload`` through a simulated cluster until every request has finished."""
    return _Cluster(workload, setup).run()
