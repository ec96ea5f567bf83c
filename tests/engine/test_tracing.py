"""Request traces (pagedkv.observability.tracing) through the SDK's in-memory exporter, and the prefix hit the
core reports as RequestOutput.num_cached_tokens: one request's events in order with their
attributes, preemption then resumption, W3C traceparent propagation, and nothing when off."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pagedkv import SamplingParams
from pagedkv.engine import Engine, EngineConfig, EngineCore, PagedModelRunner
from pagedkv.loaders import load_tokenizer
from pagedkv.models import LlamaModel
from pagedkv.observability import tracing

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_core(weights, tracer=None, **config) -> EngineCore:
    config = EngineConfig(**{"num_blocks": 32, "block_size": 4, **config})
    runner = PagedModelRunner(LlamaModel(weights))
    return EngineCore(runner, config, tracer=tracer)


def run(core: EngineCore, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not core.has_unfinished():
            return
        core.step()
    raise AssertionError("requests left")


def events(span) -> list[tuple[str, dict]]:
    return [(e.name, dict(e.attributes)) for e in span.events]


def test_a_repeated_prompt_reports_its_cached_full_blocks(weights):
    core = make_core(weights)
    prompt = list(range(1, 11))
    first = core.add_request("a", prompt, SamplingParams(max_tokens=2, **GREEDY))
    run(core)
    second = core.add_request("b", prompt, SamplingParams(max_tokens=2, **GREEDY))
    run(core)
    assert first.num_cached_tokens == 0
    # 10 prompt tokens in blocks of 4: the two full blocks (the last token is always computed).
    assert second.num_cached_tokens == 8


def test_one_request_has_its_events_in_order_with_their_attributes(weights):
    exporter = InMemorySpanExporter()
    core = make_core(weights, tracer=tracing.configure(exporter=exporter), long_prefill_token_threshold=4)
    prompt = list(range(1, 11))
    core.add_request("warm", prompt, SamplingParams(max_tokens=1, **GREEDY))
    run(core)
    output = core.add_request("r", prompt + [20, 21], SamplingParams(max_tokens=3, **GREEDY))
    run(core)
    spans = {s.attributes[tracing.REQUEST_ID]: s for s in exporter.get_finished_spans()}
    span = spans["r"]
    assert span.name == "request"
    # 12 prompt tokens, 8 cached: one chunk of the last 4, then the first token.
    assert events(span) == [
        ("queued", {}),
        ("admitted", {tracing.PREFIX_HIT_TOKENS: 8}),
        ("prefill_chunk", {tracing.CHUNK_TOKENS: 4, tracing.CHUNK_START: 8}),
        ("first_token", {}),
        ("finished", {tracing.FINISH_REASONS: ("length",)}),
    ]
    times = [e.timestamp for e in span.events]
    assert times == sorted(times) and span.start_time == times[0] and span.end_time == times[-1]
    assert dict(span.attributes) == {
        tracing.REQUEST_ID: "r",
        tracing.PROMPT_TOKENS: 12,
        tracing.MAX_TOKENS: 3,
        tracing.N: 1,
        tracing.FINISH_REASONS: ("length",),
        tracing.OUTPUT_TOKENS: 3,
        tracing.CACHED_TOKENS: 8,
    }
    assert output.num_cached_tokens == 8
    # The warm-up's 10 tokens ran in chunks of 4: three chunk events.
    chunks = [a for name, a in events(spans["warm"]) if name == "prefill_chunk"]
    assert [(a[tracing.CHUNK_START], a[tracing.CHUNK_TOKENS]) for a in chunks] == [(0, 4), (4, 4), (8, 2)]


def test_a_preempted_request_shows_preempted_then_resumed(weights):
    exporter = InMemorySpanExporter()
    # 6 blocks of 4, no admission headroom: both 7-token prompts are admitted, and growing to 17
    # tokens (5 blocks each) preempts the one admitted last.
    core = make_core(weights, tracer=tracing.configure(exporter=exporter), num_blocks=6, admission_lookahead_tokens=None)
    for request_id in "ab":
        core.add_request(request_id, [3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=10, **GREEDY))
    run(core)
    assert core.stats()["preemptions"] > 0
    spans = {s.attributes[tracing.REQUEST_ID]: s for s in exporter.get_finished_spans()}
    names = [name for name, _ in events(spans["b"])]
    assert names[:4] == ["queued", "admitted", "prefill_chunk", "first_token"]
    assert "preempted" in names and names[-1] == "finished"
    after = names[names.index("preempted") :]
    assert after[:2] == ["preempted", "resumed"]
    assert names.count("preempted") == names.count("resumed")
    assert "preempted" not in [name for name, _ in events(spans["a"])]


def test_traceparent_makes_the_request_a_child_of_the_caller(weights):
    exporter = InMemorySpanExporter()
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"Traceparent": f"00-{trace_id}-{parent_id}-01", "content-type": "application/json"}
    tokenizer = load_tokenizer(None, weights.config.vocab_size)
    engine = Engine(LlamaModel(weights), tokenizer, EngineConfig(num_blocks=32), tracer=tracing.configure(exporter=exporter))
    with engine:
        engine.submit([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY), trace_headers=headers).result(timeout=60)
        engine.submit([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY)).result(timeout=60)
    child, root = exporter.get_finished_spans()
    assert child.context.trace_id == int(trace_id, 16)
    assert child.parent is not None and child.parent.span_id == int(parent_id, 16)
    assert root.parent is None and root.context.trace_id != int(trace_id, 16)


def test_without_a_tracer_nothing_is_traced(weights):
    assert tracing.configure() is None
    exporter = InMemorySpanExporter()
    tracing.configure(exporter=exporter)  # a tracer no engine uses
    core = make_core(weights)
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, **GREEDY), trace_headers={"traceparent": "garbage"})
    run(core)
    assert core._tracer is None
    assert exporter.get_finished_spans() == ()
