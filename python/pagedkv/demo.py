"""Demo: the block manager serving a slice of a real request trace.

Requests from the shipped Azure conversation trace share one of a few system prompts, are admitted
while blocks allow, decode one token per step, sometimes fork for parallel sampling, and finish;
then the demo prints what the memory manager did.
"""

from __future__ import annotations

import argparse
import random

from pagedkv import BlockManager, OutOfBlocksError
from pagedkv.traces import load_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    system_prompts = [[rng.randrange(32000) for _ in range(rng.choice([256, 512, 768]))] for _ in range(4)]
    trace = load_trace(limit=args.requests)
    manager = BlockManager(args.num_blocks, args.block_size)
    waiting = list(enumerate(trace))[::-1]
    running: dict[int, int] = {}
    next_fork_id = len(trace)
    steps = peak_usage = refused = 0
    while waiting or running:
        while waiting:
            seq, request = waiting[-1]
            prompt = rng.choice(system_prompts) + [rng.randrange(32000) for _ in range(request.prompt_tokens // 4)]
            try:
                manager.allocate(seq, prompt)
            except OutOfBlocksError:
                refused += 1
                break
            waiting.pop()
            running[seq] = min(request.output_tokens, 256)
            if rng.random() < 0.1:  # parallel sampling: a second sample shares the whole prompt
                manager.fork(seq, next_fork_id)
                running[next_fork_id] = running[seq]
                next_fork_id += 1
        for seq in list(running):
            try:
                manager.append(seq, [rng.randrange(32000)])
                running[seq] -= 1
            except OutOfBlocksError:  # no room to grow: finish early rather than stall the demo
                running[seq] = 0
            if running[seq] == 0:
                del running[seq]
                manager.free(seq)
        steps += 1
        peak_usage = max(peak_usage, manager.stats()["usage"])
    manager.check_invariants()
    stats = manager.stats()
    hit_rate = stats["prefix_hit_tokens"] / max(1, stats["prefix_queried_tokens"])
    print(f"served {len(trace)} trace requests in {steps} decode steps over {args.num_blocks} blocks of {args.block_size} tokens")
    print(f"  peak KV usage          {peak_usage:.1%}")
    print(f"  prefix-cache hit rate  {hit_rate:.1%} of prompt tokens ({stats['prefix_hit_tokens']} tokens)")
    print(f"  copy-on-write copies   {stats['cow_copies']} (parallel-sampling forks)")
    print(f"  evictions              {stats['evictions']}; admissions deferred for memory: {refused}")
    print(f"  after all finished     {stats['used_blocks']} blocks in use, {stats['cached_blocks']} cached, {stats['free_blocks']} clean: nothing leaked")
    return 0
