"""Scheduler step time replaying the Azure conversation trace, vs a plain-Python scheduler.

No model runs: each step is ``schedule()`` then ``update()`` with one random token per sample
(a sequence samples when its prompt is computed). Requests arrive at their trace times on a
simulated clock that advances ``--step-ms`` per step (``--speedup`` compresses arrivals to load
the cache harder); each asks for its trace output length (``max_tokens``, no stop token). Prompts
are synthetic tokens: the first ``--system-prompt`` tokens are shared by every request (a common
system prompt, for the prefix cache), the rest are unique per request. The same requests and
sampled tokens go through ``pagedkv.Scheduler`` and through
``lab.bench.reference_scheduler`` (same policy, plain Python) in the same process; only the
two calls are timed (wall clock, fastest of ``--repeats`` interleaved replays).

The reference implements the policy without admission headroom and evicts least recently used
blocks, so the side-by-side comparison runs the Rust scheduler with ``admission_lookahead_tokens=None``
and ``eviction_policy="lru"`` (``reference_agrees`` checks that both made the same decisions);
``us_per_step_default_config`` times the default (headroom, segmented LRU).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from lab.bench.reference_scheduler import ReferenceScheduler
from pagedkv._core import Scheduler
from pagedkv.cli import non_negative_int, positive_float, positive_int
from pagedkv.traces import TraceRequest, load_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=non_negative_int, default=2000, help="trace requests to replay (0: all 19,366)")
    parser.add_argument(
        "--reference-requests", type=positive_int, default=None, help="requests for the Python reference (default: same)"
    )
    parser.add_argument("--num-blocks", type=positive_int, default=4096)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--max-num-seqs", type=positive_int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    parser.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=0)
    parser.add_argument("--system-prompt", type=non_negative_int, default=128, help="tokens shared by every prompt")
    parser.add_argument("--step-ms", type=positive_float, default=20.0, help="simulated model time per step")
    parser.add_argument("--speedup", type=positive_float, default=4.0, help="arrival-time compression")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--repeats", type=positive_int, default=3, help="replays per implementation; the fastest counts")
    parser.add_argument("--json", action="store_true", help="print JSON only")


def prompt_tokens(index: int, length: int, system_prompt: int) -> np.ndarray:
    shared = min(length - 1, system_prompt)
    tokens = np.arange(length, dtype=np.int64)
    tokens[shared:] = 50_000 + (index * 7919 + np.arange(length - shared)) % 1_000_000
    return tokens


def replay(
    make: Callable[[], Any],
    trace: list[TraceRequest],
    args: argparse.Namespace,
    as_list: bool,
) -> dict[str, float]:
    """Runs the trace through one scheduler; returns its figures."""
    scheduler = make()
    rng = np.random.default_rng(args.seed)
    samples = rng.integers(3, 32_000, size=1 << 16, dtype=np.int64)
    sample_at = 0
    step_s = args.step_ms / 1000.0
    clock, next_request, steps, elapsed, generated = 0.0, 0, 0, 0.0, 0
    while next_request < len(trace) or scheduler.has_unfinished():
        if not scheduler.has_unfinished():
            clock = max(clock, trace[next_request].arrival_s / args.speedup)
        while next_request < len(trace) and trace[next_request].arrival_s / args.speedup <= clock:
            r = trace[next_request]
            prompt = prompt_tokens(next_request, r.prompt_tokens, args.system_prompt)
            scheduler.add_request(f"r{next_request}", prompt.tolist() if as_list else prompt, max_tokens=r.output_tokens)
            next_request += 1
        start = time.perf_counter()
        step = scheduler.schedule()
        elapsed += time.perf_counter() - start
        k = step.num_samples
        if sample_at + k > samples.size:
            sample_at = 0
        sampled = samples[sample_at : sample_at + k]
        sample_at += k
        if as_list:
            sampled = sampled.tolist()
        start = time.perf_counter()
        produced = scheduler.update(step, sampled)
        elapsed += time.perf_counter() - start
        generated += len(produced)
        steps += 1
        clock += step_s
    return {"steps": steps, "generated_tokens": generated, "us_per_step": elapsed / steps * 1e6, "scheduler": scheduler}


def run(args: argparse.Namespace) -> int:
    trace = load_trace(limit=args.requests or None)
    reference_trace = trace[: args.reference_requests] if args.reference_requests else trace
    limits = dict(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    # Interleaved repeats, fastest of each: the machine is shared, and noise only adds time.
    rust_runs, python_runs, default_runs = [], [], []
    for _ in range(args.repeats):
        rust_runs.append(replay(lambda: Scheduler(**limits, admission_lookahead_tokens=None, eviction_policy="lru"), trace, args,
                                as_list=False))
        python_runs.append(replay(lambda: ReferenceScheduler(**limits), reference_trace, args, as_list=True))
        default_runs.append(replay(lambda: Scheduler(**limits), trace, args, as_list=False))
    rust = min(rust_runs, key=lambda r: r["us_per_step"])
    default = min(default_runs, key=lambda r: r["us_per_step"])
    python = min(python_runs, key=lambda r: r["us_per_step"])
    stats = rust["scheduler"].stats()
    result = {
        "requests": len(trace),
        "steps": rust["steps"],
        "generated_tokens": rust["generated_tokens"],
        "us_per_step": round(rust["us_per_step"], 2),
        "python_reference_requests": len(reference_trace),
        "python_reference_us_per_step": round(python["us_per_step"], 2),
        "speedup_vs_python_reference": round(python["us_per_step"] / rust["us_per_step"], 1),
        "peak_running": stats["peak_running"],
        "preemptions": stats["preemptions"],
        "prefix_hit_rate": round(stats["prefix_hit_rate"], 4),
        "scheduled_tokens": stats["scheduled_tokens"],
        "us_per_step_default_config": round(default["us_per_step"], 2),
        "preemptions_default_config": default["scheduler"].stats()["preemptions"],
        "repeats": args.repeats,
        "reference_agrees": None,
    }
    if reference_trace is trace:
        ref = python["scheduler"]
        result["reference_agrees"] = (
            python["steps"] == rust["steps"]
            and python["generated_tokens"] == rust["generated_tokens"]
            and ref.preemptions == stats["preemptions"]
            and ref.peak_running == stats["peak_running"]
            and ref.hits == stats["prefix_hit_tokens"]
        )
    if args.json:
        print(json.dumps(result))
    else:
        config = (
            f"{args.num_blocks} blocks x {args.block_size}, max_num_seqs {args.max_num_seqs}, "
            f"budget {args.max_num_batched_tokens}, step {args.step_ms} ms, arrivals x{args.speedup}"
        )
        print(f"scheduler replay of the Azure conversation trace ({config})")
        width = max(map(len, result))
        for key, value in result.items():
            print(f"  {key:<{width}}  {value}")
    return 0
