"""The replay driver: feeds a workload's requests to a serving policy at their arrival times and
records what every step did and when every request finished.

A policy is any :class:`ServingPolicy`: the paged engine (:class:`PagedPolicy`, wrapping an
:class:`~pagedkv.engine.EngineCore`) or a reservation baseline
(:mod:`lab.serving.reservation`). Time comes from a :class:`ReplayClock`: simulated seconds
(:class:`SimulatedTime`, advanced by the model's cost per step and jumped forward over idle gaps)
or wall seconds (:class:`WallTime`, which sleeps over idle gaps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from lab.serving.workload import ServingRequest
from pagedkv.engine import EngineCore, RequestMetrics, VirtualClock
from pagedkv.sampling import SamplingParams

__all__ = [
    "FinishedRequest",
    "PagedPolicy",
    "PolicyTotals",
    "ReplayClock",
    "ReplayResult",
    "ServingPolicy",
    "SimulatedTime",
    "StepRecord",
    "WallTime",
    "replay",
]


class ReplayClock(Protocol):
    """Seconds since the replay started, and a way to let time pass while nothing runs."""

    def __call__(self) -> float: ...

    def wait_until(self, t: float) -> None: ...


class SimulatedTime(VirtualClock):
    """Virtual seconds: a model's cost advances it; idle gaps are skipped."""

    def wait_until(self, t: float) -> None:
        self.now = max(self.now, t)


class WallTime:
    """Wall seconds since construction; idle gaps are slept through."""

    def __init__(self) -> None:
        self._start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self._start

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self()))


@dataclass(frozen=True)
class StepRecord:
    """What one step of a policy did, with KV memory in token slots.

    ``reserved_slots`` are slots set aside for running requests (whole max-length reservations,
    or whole blocks); ``live_tokens`` are those holding K/V of a request still running.
    """

    start_s: float
    duration_s: float
    num_running: int
    scheduled_tokens: int
    prefill_tokens: int
    reserved_slots: int
    live_tokens: int


@dataclass(frozen=True)
class FinishedRequest:
    """A request that finished during a replay."""

    request_id: str
    prompt_len: int
    metrics: RequestMetrics


@dataclass(frozen=True)
class PolicyTotals:
    """Cumulative figures a policy reports at the end of a replay."""

    prefill_tokens: int  # prompt tokens computed, recomputation after preemption included
    preemptions: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int


class ServingPolicy(Protocol):
    """A serving policy the replay driver can feed."""

    name: str
    kv_capacity_slots: int  # KV memory of the policy, in token slots

    def add_request(self, request: ServingRequest) -> None:
        """Queues a request that has arrived (``request.arrival_s`` on the replay clock)."""

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""

    def step(self) -> tuple[StepRecord, list[tuple[str, RequestMetrics]]]:
        """Runs one iteration; returns its record and the (id, metrics) of requests that finished."""

    def totals(self) -> PolicyTotals:
        """Figures accumulated since the policy was made."""


@dataclass
class ReplayResult:
    """Everything a replay measured."""

    policy: str
    kv_capacity_slots: int
    steps: list[StepRecord]
    requests: list[FinishedRequest]  # in finishing order
    totals: PolicyTotals


def replay(
    policy: ServingPolicy,
    requests: Sequence[ServingRequest],
    clock: ReplayClock,
    on_progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Runs ``requests`` (in arrival order) through ``policy`` until all have finished.

    Before each step every request that has arrived by then is queued; when nothing is queued or
    running, the clock waits for the next arrival. ``on_progress(n)`` is called with the number of
    requests that finished in each step.
    """
    prompt_len_of = {r.request_id: r.prompt_len for r in requests}
    steps: list[StepRecord] = []
    done: list[FinishedRequest] = []
    next_arrival = 0
    while next_arrival < len(requests) or policy.has_unfinished():
        if not policy.has_unfinished():
            clock.wait_until(requests[next_arrival].arrival_s)
        now = clock()
        while next_arrival < len(requests) and requests[next_arrival].arrival_s <= now:
            policy.add_request(requests[next_arrival])
            next_arrival += 1
        record, finished = policy.step()
        steps.append(record)
        done.extend(FinishedRequest(rid, prompt_len_of[rid], metrics) for rid, metrics in finished)
        if on_progress is not None and finished:
            on_progress(len(finished))
    return ReplayResult(policy.name, policy.kv_capacity_slots, steps, done, policy.totals())


class PagedPolicy:
    """pagedkv's continuous batching over paged KV memory: an :class:`EngineCore` (its Rust
    scheduler, with or without prefix caching) and whatever runner it holds."""

    def __init__(self, name: str, core: EngineCore, clock: ReplayClock, temperature: float = 0.0) -> None:
        self.name = name
        self.core = core
        self.clock = clock
        self.temperature = temperature
        self.block_size = core.config.block_size
        self.kv_capacity_slots = core.config.num_blocks * core.config.block_size
        # Slots written per running request, as of the last step that scheduled it.
        self._context_len: dict[str, int] = {}

    def add_request(self, request: ServingRequest) -> None:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=self.temperature, ignore_eos=True, seed=0)
        self.core.add_request(request.request_id, request.prompt_token_ids, params, arrival_time=request.arrival_s)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> tuple[StepRecord, list[tuple[str, RequestMetrics]]]:
        start = self.clock()
        _events, finished = self.core.step()
        step = self.core.last_step
        if step is None or step.stats["num_scheduled_tokens"] == 0:
            raise RuntimeError(f"{self.name}: the scheduler scheduled nothing while requests are unfinished")
        for request_id, context_len in zip(step.request_ids, step.context_lens.tolist(), strict=True):
            self._context_len[request_id] = context_len
        # Every block in use is full except the last of each running sequence (no forks here),
        # so the unwritten slots are the tails of those last blocks. A preempted sequence keeps
        # its entry until it is scheduled again: its gap is counted though its blocks are free,
        # which can only understate the utilization.
        reserved = round(step.stats["kv_usage"] * self.kv_capacity_slots)
        tail_gaps = sum(-n % self.block_size for n in self._context_len.values())
        stats = step.stats
        record = StepRecord(
            start_s=start,
            duration_s=self.clock() - start,
            num_running=stats["num_running"],
            scheduled_tokens=stats["num_scheduled_tokens"],
            prefill_tokens=stats["num_prefill_tokens"],
            reserved_slots=reserved,
            live_tokens=reserved - tail_gaps,
        )
        for output in finished:
            self._context_len.pop(output.request_id, None)
        return record, [(o.request_id, o.metrics) for o in finished]

    def totals(self) -> PolicyTotals:
        stats = self.core.stats()
        return PolicyTotals(
            prefill_tokens=int(stats["prefill_tokens"]),
            preemptions=int(stats["preemptions"]),
            prefix_queried_tokens=int(stats["prefix_queried_tokens"]),
            prefix_hit_tokens=int(stats["prefix_hit_tokens"]),
        )
