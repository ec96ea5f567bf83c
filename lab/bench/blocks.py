"""Block manager vs the seed's pure-Python page allocator on the same trace-driven workload.

Continuous batching without a model: up to ``--max-running`` sequences live at once; each step
appends one token to every running sequence; a sequence is freed after its output length and the
next trace request is admitted. Both implementations see the identical sequence of calls; the
ratio of their wall times (median of ``--repeats`` interleaved runs) is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Protocol

from lab.bench.seed_reference import SeedPageAllocator
from pagedkv._core import BlockManager
from pagedkv.cli import positive_int
from pagedkv.traces import load_trace


class Allocator(Protocol):
    def allocate(self, seq_id: int, tokens: list[int]) -> object: ...
    def free(self, seq_id: int) -> None: ...


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=positive_int, default=400, help="trace requests to replay")
    parser.add_argument("--max-running", type=positive_int, default=64)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--json", action="store_true", help="print JSON only")


def replay(allocator: Allocator, append: Callable[[int, int], object], lengths: list[tuple[int, int]], max_running: int) -> int:
    """Runs the workload; returns the number of allocator calls made."""
    pending = list(enumerate(lengths))[::-1]
    running: dict[int, int] = {}  # seq id -> tokens still to generate
    calls = 0
    while pending or running:
        while pending and len(running) < max_running:
            seq, (prompt, output) = pending.pop()
            allocator.allocate(seq, list(range(seq * 7, seq * 7 + prompt)))
            running[seq] = output
            calls += 1
        for seq in list(running):
            append(seq, seq)
            calls += 1
            running[seq] -= 1
            if running[seq] == 0:
                del running[seq]
                allocator.free(seq)
                calls += 1
    return calls


def run(args: argparse.Namespace) -> int:
    trace = load_trace(limit=args.requests)
    lengths = [(r.prompt_tokens, r.output_tokens) for r in trace]
    peak_tokens = sum(sorted(p + o for p, o in lengths)[-args.max_running :])
    num_blocks = peak_tokens // args.block_size + 2 * args.max_running

    def ours() -> int:
        manager = BlockManager(num_blocks, args.block_size, enable_prefix_caching=True)
        one = [0]

        def append(seq: int, token: int) -> None:
            one[0] = token
            manager.append(seq, one)

        return replay(manager, append, lengths, args.max_running)

    def seed() -> int:
        allocator = SeedPageAllocator(num_blocks, args.block_size)
        return replay(allocator, allocator.append, lengths, args.max_running)

    times: dict[str, list[float]] = {"pagedkv": [], "seed_python": []}
    calls = 0
    for _ in range(args.repeats):
        for name, fn in (("pagedkv", ours), ("seed_python", seed)):
            start = time.perf_counter()
            calls = fn()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    result = {
        "requests": len(lengths),
        "calls": calls,
        "num_blocks": num_blocks,
        "block_size": args.block_size,
        "pagedkv_seconds_median": medians["pagedkv"],
        "seed_python_seconds_median": medians["seed_python"],
        "pagedkv_ns_per_call": medians["pagedkv"] / calls * 1e9,
        "seed_python_ns_per_call": medians["seed_python"] / calls * 1e9,
        "speedup_vs_seed_python": medians["seed_python"] / medians["pagedkv"],
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value:.4g}" if isinstance(value, float) else f"{key:28s} {value}")
    return 0
