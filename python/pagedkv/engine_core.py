"""The synchronous heart of an engine: one call of :meth:`EngineCore.step` runs one iteration of
continuous batching (schedule → model → sample → update) and reports what each request produced.

It owns the :class:`pagedkv.Scheduler`, a model runner and each request's sampling state; it is not
thread-safe (the threaded :class:`pagedkv.Engine` calls it from its worker only). Time comes from
an injectable clock, so a simulated model can run on virtual time with the same bookkeeping.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from pagedkv._core import KVCache, Scheduler
from pagedkv.errors import InvalidArgumentError
from pagedkv.model.sampling import SamplingParams, sample
from pagedkv.model.simulated import SimulatedModel
from pagedkv.model.step import ModelStep

__all__ = [
    "CompletionOutput",
    "EngineCore",
    "ModelRunner",
    "PagedModelRunner",
    "RequestMetrics",
    "RequestOutput",
    "EngineConfig",
    "SimulatedRunner",
    "TokenEvent",
    "VirtualClock",
]


@dataclass(frozen=True)
class EngineConfig:
    """Memory and batching limits of an engine."""

    num_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's maximum position, capped by the cache
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    # Admission headroom: admit a waiting request only if the running sequences (and it) can still
    # finish their prompts and grow this many tokens each; None admits whenever the first chunk
    # fits now (memory fills, and growth then preempts the request just admitted). See Scheduler.
    admission_lookahead_tokens: int | None = 32
    kv_dtype: str = "float32"


@dataclass
class RequestMetrics:
    """Timestamps of one request (seconds of the engine's clock) and what they imply."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.finished_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to last token."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""


@dataclass
class RequestOutput:
    """A request's prompt and samples so far (all of them once ``finished``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    prompt: str | None = None
    finished: bool = False

    @property
    def text(self) -> str:
        """Text of the first sample."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """Tokens of the first sample."""
        return self.outputs[0].token_ids


@dataclass(frozen=True)
class TokenEvent:
    """One token produced by a step, for streaming."""

    request_id: str
    index: int
    token_id: int
    finish_reason: str | None


class ModelRunner(Protocol):
    """Turns a scheduled step into one sampled token per sample row."""

    vocab_size: int
    max_model_len: int

    def run(self, step: ModelStep, params: Sequence[SamplingParams], generators: Sequence[np.random.Generator]) -> np.ndarray:
        """Tokens (int64) for ``step.logits_indices``, row r drawn under ``params[r]``."""
        ...


class VirtualClock:
    """A clock that only moves when told: simulated runs measure latency in modelled seconds."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class PagedModelRunner:
    """A model computing logits over a paged :class:`KVCache` (e.g. :class:`pagedkv.LlamaModel`)."""

    def __init__(self, model, num_blocks: int, block_size: int, kv_dtype: str = "float32") -> None:
        self.model = model
        self.kv_cache: KVCache = model.new_kv_cache(num_blocks, block_size, kv_dtype)
        self.vocab_size = model.config.vocab_size
        self.max_model_len = model.config.max_position_embeddings

    def run(self, step: ModelStep, params: Sequence[SamplingParams], generators: Sequence[np.random.Generator]) -> np.ndarray:
        logits = self.model.forward(step, self.kv_cache)
        return sample(logits, params, generators)


class SimulatedRunner:
    """A :class:`SimulatedModel`: no arithmetic; each step advances ``clock`` by the modelled time."""

    def __init__(self, model: SimulatedModel, clock: VirtualClock, max_model_len: int = 1 << 20) -> None:
        self.model = model
        self.clock = clock
        self.vocab_size = model.vocab_size
        self.max_model_len = max_model_len

    def run(self, step: ModelStep, params: Sequence[SamplingParams], generators: Sequence[np.random.Generator]) -> np.ndarray:
        self.clock.advance(self.model.step_seconds(step))
        return self.model.sample(step)


@dataclass
class _Request:
    params: SamplingParams
    generators: list[np.random.Generator]
    output: RequestOutput


class EngineCore:
    """Scheduler + model runner + per-request state, stepped by the caller."""

    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig = EngineConfig(),
        eos_token_id: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.runner = runner
        self.config = config
        self.clock = clock
        self.max_model_len = config.max_model_len or min(runner.max_model_len, config.num_blocks * config.block_size)
        self.scheduler = Scheduler(
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            policy=config.policy,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            eos_token_ids=None if eos_token_id is None else [eos_token_id],
            admission_lookahead_tokens=config.admission_lookahead_tokens,
        )
        self._requests: dict[str, _Request] = {}
        # The scheduler's output of the latest step (its arrays and per-step ``stats``), None
        # before the first: what benchmarks and tracing read about a step.
        self.last_step: ModelStep | None = None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        """Queues a request; raises a :class:`pagedkv.PagedKVError` (changing nothing) if the
        scheduler refuses it. Returns its (empty) output record."""
        arrival = self.clock() if arrival_time is None else arrival_time
        out_of_vocab = [t for t in prompt_token_ids if not 0 <= int(t) < self.runner.vocab_size]
        if out_of_vocab:
            raise InvalidArgumentError(f"prompt token ids {out_of_vocab[:5]} outside the vocabulary of {self.runner.vocab_size}")
        self.scheduler.add_request(
            request_id,
            list(prompt_token_ids),
            max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            n=params.n,
            priority=priority,
            arrival_time=arrival,
            cache_salt=cache_salt,
        )
        output = RequestOutput(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            outputs=[CompletionOutput(index=i) for i in range(params.n)],
            metrics=RequestMetrics(arrival_time=arrival),
            prompt=prompt,
        )
        generators = [params.make_generator(i) for i in range(params.n)]
        self._requests[request_id] = _Request(params, generators, output)
        return output

    def abort(self, request_id: str) -> RequestOutput:
        """Stops a request in any state, freeing its blocks; returns its final output."""
        self.scheduler.abort(request_id)
        request = self._requests.pop(request_id)
        for completion in request.output.outputs:
            completion.finish_reason = completion.finish_reason or "abort"
        self._finish(request.output)
        return request.output

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[list[TokenEvent], list[RequestOutput]]:
        """Runs one iteration; returns the tokens produced and the requests that finished."""
        step = self.scheduler.schedule()
        self.last_step = step
        if step.num_scheduled_tokens == 0:
            return [], []
        requests = [self._requests[rid] for rid in step.sample_request_ids]
        params = [r.params for r in requests]
        generators = [r.generators[i] for r, i in zip(requests, step.sample_seq_indices.tolist())]
        tokens = self.runner.run(step, params, generators)
        now = self.clock()
        update = self.scheduler.update(step, tokens)
        events = []
        for request_id, index, token, reason in zip(
            update.request_ids, update.seq_indices.tolist(), update.token_ids.tolist(), update.finish_reasons
        ):
            request = self._requests[request_id]
            completion = request.output.outputs[index]
            completion.token_ids.append(token)
            completion.finish_reason = reason
            metrics = request.output.metrics
            metrics.first_token_time = metrics.first_token_time or now
            metrics.num_output_tokens += 1
            events.append(TokenEvent(request_id, index, token, reason))
        finished = []
        for request_id in update.finished_request_ids:
            output = self._requests.pop(request_id).output
            self._finish(output, now)
            finished.append(output)
        return events, finished

    def _finish(self, output: RequestOutput, now: float | None = None) -> None:
        output.finished = True
        output.metrics.finished_time = self.clock() if now is None else now

    def stats(self) -> dict[str, float]:
        """The scheduler's cumulative stats."""
        return self.scheduler.stats()
