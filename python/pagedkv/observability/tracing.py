"""OpenTelemetry traces of requests: one trace per request, built from the engine's step facts.

A request's root span ``"request"`` opens at its arrival and ends when its output is final. Its
events, in order: ``queued``; ``admitted`` (``pagedkv.prefix_hit_tokens``); one ``prefill_chunk``
per step computing prompt tokens (``pagedkv.chunk_tokens``, ``pagedkv.chunk_start``); ``first_token``;
``preempted`` / ``resumed`` (with its hit) as often as they happen; ``finished``. The admission
facts come from the scheduler (:attr:`pagedkv.SchedulerOutput.events`), the chunks from the step's
rows, the times from the engine's clock.

Invariants:

- Off costs nothing per token: an engine built without a tracer makes one ``is None`` test per
  step, per request added and per request end; OpenTelemetry is imported only by :func:`configure`.
- Times are the engine's clock mapped to wall time by one offset taken when the core binds the
  tracer (:meth:`RequestTracer.observe`), so a span's times are ordered as the engine saw them
  (perf_counter drift against the wall clock is far below a step).
- A request's span is ended exactly once, by the core's end of the request (finish, abort, failure);
  the observer's table holds exactly the spans not yet ended, under its own lock (``abort`` may end
  a request from another thread while the worker steps).
- ``trace_headers`` are read with the W3C Trace Context propagator (``traceparent``,
  ``tracestate``; header names in any case): the request's span is a child of that context.

The SDK and its exporters are the well-kept standard for this; nothing here re-implements them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from pagedkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from pagedkv._core import SchedulerOutput
    from pagedkv.engine import RequestOutput
    from pagedkv.sampling import SamplingParams

__all__ = ["RequestTracer", "configure"]

# Attribute names: OpenTelemetry's gen_ai semantic conventions where one exists.
REQUEST_ID = "gen_ai.request.id"
PROMPT_TOKENS = "gen_ai.usage.input_tokens"
MAX_TOKENS = "gen_ai.request.max_tokens"
N = "gen_ai.request.choice.count"
FINISH_REASONS = "gen_ai.response.finish_reasons"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_TOKENS = "pagedkv.cached_tokens"
PREFIX_HIT_TOKENS = "pagedkv.prefix_hit_tokens"
CHUNK_TOKENS = "pagedkv.chunk_tokens"
CHUNK_START = "pagedkv.chunk_start"


class RequestTracer:
    """Makes request spans with an OpenTelemetry tracer provider (see :func:`configure`)."""

    def __init__(self, provider: Any) -> None:
        """``provider``: an ``opentelemetry.sdk.trace.TracerProvider`` with its span processors."""
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("pagedkv")
        self.propagator = TraceContextTextMapPropagator()

    def observe(self, clock: Callable[[], float]) -> _RequestObserver:
        """The observer an engine core calls, its clock (seconds) mapped to wall time now."""
        return _RequestObserver(self, time.time_ns() - round(clock() * 1e9))

    def shutdown(self) -> None:
        """Exports what is pending and stops the exporters."""
        self.provider.shutdown()


def configure(otlp_endpoint: str | None = None, exporter: SpanExporter | None = None) -> RequestTracer | None:
    """A tracer exporting to ``otlp_endpoint`` (OTLP over HTTP, e.g. ``http://localhost:4318/v1/traces``,
    batched) and/or to ``exporter`` (each span as it ends, e.g. the SDK's ``InMemorySpanExporter``);
    None, tracing off, when given neither. Raises :class:`InvalidArgumentError` when the
    ``tracing`` extra (or, for an endpoint, the ``otlp`` extra) is not installed."""
    if otlp_endpoint is None and exporter is None:
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        if otlp_endpoint is not None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as error:
        extra = "otlp" if otlp_endpoint is not None else "tracing"
        raise InvalidArgumentError(f"tracing needs pagedkv's {extra!r} extra ({error.name} is not installed)") from None

    provider = TracerProvider(resource=Resource.create({"service.name": "pagedkv"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if otlp_endpoint is not None:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return RequestTracer(provider)


class _Live:
    """A request's open span and what its later events need."""

    __slots__ = ("span", "prompt_len", "first_token")

    def __init__(self, span: Any, prompt_len: int) -> None:
        self.span = span
        self.prompt_len = prompt_len
        self.first_token = False


class _RequestObserver:
    """One engine core's request spans; its hooks take times of the core's clock (seconds)."""

    def __init__(self, tracer: RequestTracer, offset_ns: int) -> None:
        self.tracer = tracer
        self.offset_ns = offset_ns
        self.lock = threading.Lock()
        self.live: dict[str, _Live] = {}

    def wall_ns(self, t: float) -> int:
        return self.offset_ns + round(t * 1e9)

    def queued(self, output: RequestOutput, params: SamplingParams, trace_headers: Mapping[str, str] | None) -> None:
        """Opens the span of a request just added (at its arrival time)."""
        context = None
        if trace_headers is not None:
            context = self.tracer.propagator.extract({k.lower(): v for k, v in trace_headers.items()})
        start = self.wall_ns(output.metrics.arrival_time)
        attributes = {
            REQUEST_ID: output.request_id,
            PROMPT_TOKENS: len(output.prompt_token_ids),
            MAX_TOKENS: params.max_tokens,
            N: params.n,
        }
        span = self.tracer.tracer.start_span("request", context=context, attributes=attributes, start_time=start)
        span.add_event("queued", timestamp=start)
        with self.lock:
            self.live[output.request_id] = _Live(span, len(output.prompt_token_ids))

    def step(self, step: SchedulerOutput, produced_ids: list[str], started: float, now: float) -> None:
        """Records a step scheduled at ``started`` whose tokens (of ``produced_ids``) came at ``now``."""
        at, done = self.wall_ns(started), self.wall_ns(now)
        with self.lock:
            for request_id, _, kind, hit in step.events:
                live = self.live.get(request_id)
                if live is not None:
                    attributes = {} if kind == "preempted" else {PREFIX_HIT_TOKENS: hit}
                    live.span.add_event(kind, attributes, timestamp=at)
            if step.num_seqs:
                starts = step.query_start_loc.tolist()
                for i, (request_id, context_len) in enumerate(zip(step.request_ids, step.context_lens.tolist(), strict=True)):
                    live = self.live.get(request_id)
                    tokens = starts[i + 1] - starts[i]
                    if live is not None and context_len - tokens < live.prompt_len:
                        attributes = {CHUNK_TOKENS: tokens, CHUNK_START: context_len - tokens}
                        live.span.add_event("prefill_chunk", attributes, timestamp=at)
            for request_id in produced_ids:
                live = self.live.get(request_id)
                if live is not None and not live.first_token:
                    live.first_token = True
                    live.span.add_event("first_token", timestamp=done)

    def finished(self, output: RequestOutput) -> None:
        """Ends the span of a request whose output is final."""
        with self.lock:
            live = self.live.pop(output.request_id, None)
        if live is None:
            return
        from opentelemetry.trace import Status, StatusCode

        reasons = [c.finish_reason or "abort" for c in output.outputs]
        end = self.wall_ns(output.metrics.finished_time or output.metrics.arrival_time)
        span = live.span
        span.set_attributes(
            {
                FINISH_REASONS: reasons,
                OUTPUT_TOKENS: sum(len(c.token_ids) for c in output.outputs),
                CACHED_TOKENS: output.num_cached_tokens,
            }
        )
        if output.error is not None:
            span.set_status(Status(StatusCode.ERROR, output.error))
        span.add_event("finished", {FINISH_REASONS: reasons}, timestamp=end)
        span.end(end_time=end)
