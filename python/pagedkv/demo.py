"""Demo: the engine serving a few hundred requests of a real trace on the paged KV cache.

Requests take their prompt and output lengths from the shipped Azure conversation trace (scaled to
the tiny model), share one of a few system prompts, and arrive over time at the trace's own
pace (compressed). A live display shows running / waiting requests, KV usage and tokens per
second; a summary of throughput, latency, memory and prefix caching follows.

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

from pagedkv.cli import model_source, non_negative_int, port, positive_int, seconds
from pagedkv.engine import Engine, RequestHandle
from pagedkv.engine_core import RequestOutput
from pagedkv.errors import InvalidArgumentError
from pagedkv.model import SamplingParams
from pagedkv.traces import load_trace

Workload = list[tuple[float, list[int], int]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", type=model_source, default="tiny", help="Hugging Face Llama checkpoint dir, or 'tiny' (random weights)"
    )
    parser.add_argument("--requests", type=positive_int, default=300)
    parser.add_argument("--arrival-span", type=seconds, default=30.0, help="seconds over which requests arrive")
    parser.add_argument("--num-blocks", type=positive_int, default=256, help="KV blocks (16 tokens each)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=48)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=1024)
    parser.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument(
        "--metrics-port", type=port, default=None, help="serve Prometheus /metrics on this port (0: any free one)"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)


def _workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """(arrival offset s, prompt token ids, output tokens) per request."""
    rng = random.Random(args.seed)
    token = lambda: rng.randrange(3, vocab_size)  # noqa: E731 (ids 0-2 are special)
    system_prompts = [[token() for _ in range(rng.choice([48, 96, 160]))] for _ in range(4)]
    trace = load_trace(limit=args.requests)
    span = max(trace[-1].arrival_s, 1e-9)
    workload = []
    for request in trace:
        user = [token() for _ in range(min(256, max(4, request.prompt_tokens // 8)))]
        prompt = rng.choice(system_prompts) + user if rng.random() < 0.7 else user
        workload.append((request.arrival_s / span * args.arrival_span, prompt, min(96, max(4, request.output_tokens // 4))))
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
            for index, (offset, prompt, max_tokens) in enumerate(self.workload):
                if self._stopping.wait(max(0.0, self.start_time + offset - time.perf_counter())):
                    return
                params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=index, ignore_eos=True)
                try:
                    self.handles.append(self.engine.submit(prompt, params))
                except InvalidArgumentError as error:  # the flags made a request the engine cannot take
                    raise InvalidArgumentError(f"request {index} ({len(prompt)} prompt tokens) refused: {error}") from error
        except BaseException as error:  # handed to the main thread, which re-raises it
            self.error = error

    def stop(self) -> None:
        """Submits nothing more (a submit blocked on a full queue ends when the engine shuts down)."""
        self._stopping.set()


def run(args: argparse.Namespace) -> int:
    console = Console()
    engine = Engine.from_pretrained(
        args.model,
        seed=args.seed,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_dtype=args.kv_dtype,
    )
    try:
        return _serve(args, engine, console)
    finally:
        engine.shutdown(drain=False)
        engine.metrics.close()


def _serve(args: argparse.Namespace, engine: Engine, console: Console) -> int:
    if args.model == "tiny":
        console.print(
            "[bold]pagedkv demo[/] on the built-in [bold]tiny[/] Llama (4 layers, GQA 8:2) with [yellow]random weights[/]:"
            " its text is noise, the serving is real. Point it at a Hugging Face Llama-family checkpoint with"
            " [bold]--model DIR[/] (config.json + *.safetensors [+ tokenizer.json])."
        )
    if args.metrics_port is not None:
        port = engine.metrics.serve(args.metrics_port)
        console.print(f"Prometheus metrics at http://127.0.0.1:{port}/metrics")

    workload = _workload(args, engine.model.config.vocab_size)
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
    _summary(console, outputs, engine.stats(), usage_samples, elapsed)
    return 0


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
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
