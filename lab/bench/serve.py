"""Serving benchmark: static batching, Orca-style continuous batching (both with max-length KV
reservations), paged continuous batching, and paged with prefix caching, at the same KV memory.

Each policy replays the same trace requests on the same simulated cost model (a 7B model on an
A100-class GPU, :class:`~pagedkv.models.simulated.StepCostModel`) and its own virtual clock; the
paged policies run pagedkv's Rust scheduler for real. By default the trace's own arrival times are
replayed: the first 2000 conversation requests arrive at about 4.7 requests/s, more than any of
the four policies sustains with 65,536 token slots of KV, so the run measures each policy's
capacity (throughput) and the queueing it causes (latency). ``--sweep`` varies a Poisson rate to
show where each saturates. A short slice also runs on the real tiny model (wall clock).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lab.serving.replay import ReplayResult
from lab.serving.report import PolicySummary, format_table, summarize
from lab.serving.simulation import PAGED, PAGED_PREFIX, POLICIES, STATIC, ServingSetup, simulate
from lab.serving.workload import SystemPrompts, Workload, build_workload, ideal_prefill_tokens
from pagedkv.cli import comma_list, non_negative_int, output_dir, positive_float, positive_int, trace_source
from pagedkv.errors import InvalidArgumentError
from pagedkv.traces import SHIPPED_TRACES, load_trace

# Targets of the issue, reported (not enforced).
TARGET_KV_UTILIZATION = 0.96
TARGET_THROUGHPUT_OVER_STATIC = 2.0

QUICK_REQUESTS = 60
QUICK_SWEEP_RATES = (1.0, 4.0)
DEFAULT_SWEEP_RATES = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    parser.add_argument(
        "--trace",
        type=trace_source(list(SHIPPED_TRACES)),
        default="conv",
        help="'conv', 'code' or a CSV path (TIMESTAMP,ContextTokens,GeneratedTokens)",
    )
    parser.add_argument("--requests", type=positive_int, default=2000, help="trace requests to replay (from the start)")
    parser.add_argument(
        "--rate",
        type=positive_float,
        default=None,
        help="Poisson arrivals at this many requests/s (default: replay the trace's arrival times)",
    )
    parser.add_argument("--sweep", action="store_true", help="also sweep Poisson request rates")
    parser.add_argument(
        "--sweep-rates", type=comma_list(positive_float), default=DEFAULT_SWEEP_RATES, help="comma-separated requests/s"
    )
    parser.add_argument("--sweep-requests", type=positive_int, default=600, help="requests per sweep point")
    parser.add_argument("--plot", type=output_dir, default=None, metavar="DIR", help="write PNG plots into DIR")
    parser.add_argument(
        "--quick", action="store_true", help=f"a fast smoke run ({QUICK_REQUESTS} requests, a 2-point sweep if --sweep)"
    )
    parser.add_argument("--num-blocks", type=positive_int, default=4096, help="KV memory in blocks (the same for every policy)")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument(
        "--max-model-len", type=positive_int, default=8192, help="longest sequence, and each reservation of the baselines"
    )
    parser.add_argument("--max-num-seqs", type=positive_int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument(
        "--system-prompts", type=positive_int, default=8, help="shared system prompts of the prefix-caching variant"
    )
    parser.add_argument("--real-requests", type=non_negative_int, default=24, help="requests of the tiny-model run (0 to skip)")
    parser.add_argument("--seed", type=non_negative_int, default=0)


class _Progress:
    """Rich progress bars on stderr, one per replay."""

    def __init__(self) -> None:
        self._progress = Progress(
            TextColumn("{task.description:<44}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )

    def __enter__(self) -> _Progress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def task(self, description: str, total: int) -> Callable[[int], None]:
        task_id = self._progress.add_task(description, total=total)
        return lambda n: self._progress.advance(task_id, n)


@dataclass
class _Comparison:
    """Every policy on the trace workload and on its shared-system-prompt variant."""

    base: Workload
    shared: Workload
    results: dict[tuple[str, str], ReplayResult]  # keyed (workload name, policy)
    summaries: dict[tuple[str, str], PolicySummary]

    def headline(self) -> list[tuple[str, str]]:
        """Policies 1–3 on the trace, policy 4 on the shared-prefix variant."""
        return [(self.shared.name if name == PAGED_PREFIX else self.base.name, name) for name in POLICIES]


def _compare(
    args: argparse.Namespace,
    setup: ServingSetup,
    count: int,
    rate: float | None,
    progress: _Progress,
    label: str,
    headline_only: bool = False,
) -> _Comparison:
    """Runs policies 1–3 on the trace and all four on the shared-prefix variant (same lengths and
    arrivals plus a system prompt each; only policy 4 there if ``headline_only``); prefix caching
    has nothing to share on the trace alone."""
    trace = load_trace(args.trace, limit=count)
    if not trace:
        raise InvalidArgumentError(f"--trace {args.trace}: no requests")
    base = build_workload(trace, max_model_len=setup.max_model_len, rate=rate, seed=args.seed)
    shared = build_workload(
        trace,
        max_model_len=setup.max_model_len,
        rate=rate,
        seed=args.seed,
        system_prompts=SystemPrompts(count=args.system_prompts),
    )
    comparison = _Comparison(base, shared, {}, {})
    runs = [(base, name) for name in POLICIES if name != PAGED_PREFIX]
    runs += [(shared, name) for name in POLICIES if name == PAGED_PREFIX or not headline_only]
    for workload, name in runs:
        report = progress.task(f"{label}{name} / {workload.name}", len(workload.requests))
        result = simulate(name, workload, setup, report)
        comparison.results[workload.name, name] = result
        comparison.summaries[workload.name, name] = summarize(result, workload.name)
    return comparison


def _sweep(args: argparse.Namespace, setup: ServingSetup, progress: _Progress) -> list[dict[str, object]]:
    """Throughput and p99 latency of each policy at each Poisson rate."""
    rates = QUICK_SWEEP_RATES if args.quick else args.sweep_rates
    count = QUICK_REQUESTS if args.quick else args.sweep_requests
    points = []
    for rate in rates:
        comparison = _compare(args, setup, count, rate, progress, f"sweep {rate:g}/s: ", headline_only=True)
        for workload, name in comparison.headline():
            s = comparison.summaries[workload, name]
            points.append(
                {
                    "rate_requests_per_s": rate,
                    "policy": name,
                    "workload": workload,
                    "throughput_requests_per_s": s.throughput_requests_per_s,
                    "throughput_tokens_per_s": s.throughput_tokens_per_s,
                    "ttft_p99_s": s.ttft_p99_s,
                    "e2e_p99_s": s.e2e_p99_s,
                    "tpot_p99_s": s.tpot_p99_s,
                }
            )
    return points


def _real_model(args: argparse.Namespace, progress: _Progress) -> dict[str, object]:
    """Policies 3 and 4 on the real tiny model (wall clock): trace lengths scaled by 1/8, system
    prompts likewise, every request arriving at once."""
    from lab.serving.replay import PagedPolicy, WallTime, replay
    from pagedkv.engine import EngineCore, PagedModelRunner
    from pagedkv.models import LlamaConfig, LlamaModel
    from pagedkv.models.weights import LlamaWeights

    count = min(args.real_requests, 8) if args.quick else args.real_requests
    config = LlamaConfig.tiny()
    model = LlamaModel(LlamaWeights.random(config, seed=args.seed))
    setup = ServingSetup(
        num_blocks=256, block_size=args.block_size, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=512
    )
    trace = load_trace(args.trace, limit=count)
    common = dict(
        max_model_len=setup.max_model_len, rate=math.inf, length_scale=1 / 8, vocab=(3, config.vocab_size), seed=args.seed
    )
    workloads = {
        PAGED: build_workload(trace, **common),
        PAGED_PREFIX: build_workload(trace, system_prompts=SystemPrompts(count=2), **common),
    }
    summaries = []
    for name, workload in workloads.items():
        clock = WallTime()
        runner = PagedModelRunner(model)
        core = EngineCore(runner, setup.scheduler_config(enable_prefix_caching=name == PAGED_PREFIX), clock=clock)
        report = progress.task(f"tiny model: {name} / {workload.name}", len(workload.requests))
        result = replay(PagedPolicy(name, core, clock), workload.requests, clock, report)
        summaries.append(summarize(result, workload.name).to_dict())
    return {
        "model": "tiny (4 layers, hidden 256, random weights)",
        "clock": "wall",
        "length_scale": 1 / 8,
        "arrivals": "all at once",
        "num_blocks": setup.num_blocks,
        "block_size": setup.block_size,
        "policies": summaries,
    }


def run(args: argparse.Namespace) -> int:
    setup = ServingSetup(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    count = QUICK_REQUESTS if args.quick else args.requests
    with _Progress() as progress:
        main = _compare(args, setup, count, args.rate, progress, "")
        sweep = _sweep(args, setup, progress) if args.sweep else []
        real = _real_model(args, progress) if args.real_requests > 0 else None
    report = _report(args, setup, main, sweep, real)
    if args.plot is not None:
        from lab.serving import plots

        headline = main.headline()
        memory = f"KV {setup.kv_capacity_slots:,} token slots, max_model_len {setup.max_model_len}; simulated 7B/A100 cost model"
        arrivals = (
            f"Poisson {args.rate:g} req/s" if args.rate else f"replayed arrivals, {main.base.offered_rate:.1f} req/s offered"
        )
        paths = plots.write_all(
            args.plot,
            [main.results[k] for k in headline],
            [main.summaries[k] for k in headline],
            sweep,
            caption=f"{args.trace} trace, {len(main.base.requests)} requests, {arrivals}; {memory}",
            sweep_caption=f"{args.trace} trace lengths, {QUICK_REQUESTS if args.quick else args.sweep_requests} requests "
            f"per point; {memory}",
        )
        report["plots"] = [str(p) for p in paths]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report, main)
    return 0


def _report(
    args: argparse.Namespace, setup: ServingSetup, main: _Comparison, sweep: list, real: dict | None
) -> dict[str, object]:
    summaries = main.summaries
    headline = [summaries[key] for key in main.headline()]
    by_name = {s.name: s for s in headline}
    shared = main.shared
    ideal = ideal_prefill_tokens(shared.requests, setup.block_size)
    prefix = by_name[PAGED_PREFIX]
    paged_over_static = by_name[PAGED].throughput_tokens_per_s / by_name[STATIC].throughput_tokens_per_s
    return {
        "config": {
            "trace": args.trace,
            "requests": len(main.base.requests),
            "arrivals": f"poisson {args.rate} req/s" if args.rate else "replayed trace timestamps",
            "offered_rate_requests_per_s": main.base.offered_rate,
            "truncated_prompts": main.base.truncated_prompts,
            "num_blocks": setup.num_blocks,
            "block_size": setup.block_size,
            "kv_capacity_tokens": setup.kv_capacity_slots,
            "max_model_len": setup.max_model_len,
            "max_num_seqs": setup.max_num_seqs,
            "max_num_batched_tokens": setup.max_num_batched_tokens,
            "cost_model": vars(setup.cost) | {"clock": "simulated"},
            "system_prompts": args.system_prompts,
        },
        "policies": [s.to_dict() for s in headline],
        "shared_prefix_workload": [summaries[shared.name, name].to_dict() for name in POLICIES],
        "paged_throughput_over_static": paged_over_static,
        "paged_throughput_over_continuous_reservation": by_name[PAGED].throughput_tokens_per_s
        / by_name["continuous-reservation"].throughput_tokens_per_s,
        "prefix_caching": {
            "ideal_prefill_tokens": ideal,
            "prefill_tokens": prefix.prefill_tokens,
            "prefill_tokens_without_prefix_caching": summaries[shared.name, PAGED].prefill_tokens,
            "prompt_tokens": prefix.prompt_tokens,
            "within_ideal": prefix.prefill_tokens <= ideal,
            "preemptions": prefix.preemptions,
        },
        "targets": {
            "paged_kv_utilization_at_least_0.96": by_name[PAGED].kv_utilization >= TARGET_KV_UTILIZATION,
            "paged_throughput_at_least_2x_static": paged_over_static >= TARGET_THROUGHPUT_OVER_STATIC,
            "prefix_prefill_within_block_granular_ideal": prefix.prefill_tokens <= ideal,
        },
        "sweep": sweep,
        "real_model": real,
    }


def _print_report(report: dict, main: _Comparison) -> None:
    out = sys.stdout
    config = report["config"]
    print(
        f"{config['trace']} trace, {config['requests']} requests, {config['arrivals']} "
        f"({config['offered_rate_requests_per_s']:.2f} req/s offered); KV {config['kv_capacity_tokens']:,} token slots "
        f"({config['num_blocks']} × {config['block_size']}), max_model_len {config['max_model_len']}, simulated clock",
        file=out,
    )
    print("\nHeadline (policy 4 on the shared-system-prompt variant):", file=out)
    print(format_table([main.summaries[k] for k in main.headline()]), file=out)
    print("\nAll policies on the shared-system-prompt variant:", file=out)
    print(format_table([main.summaries[main.shared.name, name] for name in POLICIES]), file=out)
    prefix = report["prefix_caching"]
    print(f"\npaged / static throughput: {report['paged_throughput_over_static']:.2f}×", file=out)
    print(f"paged / continuous-reservation throughput: {report['paged_throughput_over_continuous_reservation']:.2f}×", file=out)
    print(
        f"prefix caching: {prefix['prefill_tokens']:,} prefill tokens computed vs block-granular ideal "
        f"{prefix['ideal_prefill_tokens']:,} ({'within' if prefix['within_ideal'] else 'ABOVE'}; "
        f"{prefix['preemptions']} preemptions); without caching {prefix['prefill_tokens_without_prefix_caching']:,}",
        file=out,
    )
    for target, met in report["targets"].items():
        print(f"target {target}: {'met' if met else 'NOT met'}", file=out)
    for point in report["sweep"]:
        print(
            f"sweep {point['rate_requests_per_s']:5.2f} req/s  {point['policy']:<24} "
            f"{point['throughput_requests_per_s']:5.2f} req/s  "
            f"TTFT p99 {point['ttft_p99_s']:8.2f}s  e2e p99 {point['e2e_p99_s']:8.2f}s",
            file=out,
        )
    if report["real_model"]:
        print("\nReal tiny model (wall clock, lengths × 1/8, all arriving at once):", file=out)
        for s in report["real_model"]["policies"]:
            print(
                f"  {s['name']:<20} {s['throughput_tokens_per_s']:7.1f} out tok/s  TTFT p50 {s['ttft_p50_s']:.3f}s  "
                f"KV util {s['kv_utilization']:.3f}  prefix hit {s['prefix_hit_rate']:.3f}  preemptions {s['preemptions']}",
                file=out,
            )
    for path in report.get("plots", []):
        print(f"plot: {path}", file=out)
