"""Gemma 3's hybrid KV cache (one full group of 3 layers; sliding groups carving their pages into
blocks of 8 tokens of 6 layers) vs a uniform cache keeping every layer's K/V for every token, at
the same KV byte budget; and the hybrid cache with one block size for every group.

The scheduler runs alone (no model: the figures are the cache's, not the kernels'), on Gemma 3
270M's layout read from its GGUF: 18 layers of one 256-wide K/V head, five local layers (window
512) to each global one, float16 K/V, blocks of 16 tokens. Both caches get the same bytes, so the
uniform one has a sixth of the pages (each page 18 layers instead of 3).

- ``bytes_per_sequence``: K/V bytes one sequence holds once it has ``context`` tokens (after its
  prefill, at its first decode step), hybrid vs uniform, for each context.
- ``concurrency``: sequences of a long prompt running at once in a fixed budget (peak of the
  running batch while as many requests as could ever fit wait).
- ``prefix_hits``: requests sharing a system prompt shorter than the window, then a longer one:
  the prefix-hit rate of each cache at the same budget.
- ``fragmentation``: slots allocated but not read, per kind of group, for pages of 8 to 64 tokens,
  the sliding groups' blocks the page's size or carved smaller (per-group block sizes).

``python -m lab bench kv-groups [--json]``; the figures are deterministic (no timing).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from pagedkv import KvSpec, Scheduler
from pagedkv.cli import comma_list, positive_int
from pagedkv.loaders.gguf import config_from_gguf
from pagedkv.loaders.gguf_file import read_gguf
from pagedkv.loaders.registry import locate_registered
from pagedkv.models.gemma3 import Gemma3Config

BLOCK_SIZE = 16
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# The goals (hybrid ÷ uniform bytes at 8k and 32k, and the concurrency ratio at 8k).
TARGET_BYTES_RATIO = {8192: 0.25, 32768: 0.12}
TARGET_CONCURRENCY_RATIO = 3.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", type=comma_list(positive_int), default=(1024, 8192, 32768))
    parser.add_argument("--budget-mib", type=positive_int, default=1024, help="KV bytes of each cache (MiB)")
    parser.add_argument("--concurrency-context", type=positive_int, default=8192, help="prompt tokens of each request")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    parser.add_argument("--kv-dtype", default="float16", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--throughput", action="store_true",
                        help="also serve a long-context workload with the real model, hybrid vs uniform (minutes)")
    parser.add_argument("--requests", type=positive_int, default=8, help="--throughput: requests, all at once")
    parser.add_argument("--prompt-tokens", type=positive_int, default=3072, help="--throughput: tokens of each prompt")
    parser.add_argument("--output-tokens", type=positive_int, default=256, help="--throughput: tokens each generates")
    parser.add_argument("--uniform-sequences", type=positive_int, default=2,
                        help="--throughput: the KV budget, in whole sequences of the uniform cache")
    parser.add_argument("--plot", default=None, help="also draw the figures to this PNG")
    parser.add_argument("--json", action="store_true", help="print JSON only")


def gemma3_config() -> Gemma3Config:
    """Gemma 3 270M's config, from the registered GGUF's metadata (no weights read)."""
    config = config_from_gguf(read_gguf(locate_registered("gemma3-270m")))
    assert isinstance(config, Gemma3Config)
    return config


def uniform(spec: KvSpec) -> KvSpec:
    """The same layers, all kept whole: one group of every layer."""
    first = spec.layers[0]
    return KvSpec.uniform(spec.num_layers, first.num_kv_heads, first.head_dim, spec.dtype)


def page_bytes(scheduler: Scheduler) -> int:
    """Bytes of one page: a block of every layer of one group (as many token-layers in every
    group: one carving its pages has more layers of fewer tokens), K and V."""
    groups = scheduler.kv_groups
    token_layers = max(len(g.layers) * g.block_size for g in groups)
    layer = groups[0].layer
    spec = scheduler.kv_spec
    assert spec is not None
    return 2 * token_layers * layer.num_kv_heads * layer.head_dim * DTYPE_BYTES[spec.dtype]


@dataclass
class Cache:
    """A scheduler over ``num_blocks`` pages of ``page_bytes`` each."""

    scheduler: Scheduler
    num_blocks: int
    page_bytes: int

    def used_bytes(self) -> int:
        return round(self.scheduler.stats()["kv_usage"] * self.num_blocks) * self.page_bytes


def cache_for(spec: KvSpec, budget_bytes: int, args: argparse.Namespace, **options: object) -> Cache:
    """A scheduler whose pages of ``spec``'s layout fill ``budget_bytes``."""
    size = page_bytes(Scheduler(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=16, kv_spec=spec))
    num_blocks = budget_bytes // size
    scheduler = Scheduler(num_blocks=num_blocks, block_size=BLOCK_SIZE, kv_spec=spec,
                          max_num_batched_tokens=args.max_num_batched_tokens, **options)  # type: ignore[arg-type]
    return Cache(scheduler, num_blocks, size)


def step(scheduler: Scheduler) -> None:
    """One step, sampling token 1 for every sample."""
    out = scheduler.schedule()
    scheduler.update(out, [1] * len(out.logits_indices))


def bytes_per_sequence(spec: KvSpec, context: int, args: argparse.Namespace) -> int:
    """K/V bytes one sequence of ``context`` tokens holds at its first decode step (its second
    token)."""
    # Room for the one sequence whatever the layout: every layer of its tokens and of a chunk.
    layer = spec.layers[0]
    token_bytes = 2 * spec.num_layers * layer.num_kv_heads * layer.head_dim * DTYPE_BYTES[spec.dtype]
    budget = (context + args.max_num_batched_tokens + 2 * BLOCK_SIZE) * token_bytes
    cache = cache_for(spec, budget, args, enable_prefix_caching=False)
    s = cache.scheduler
    s.add_request("r", [7 + i % 1000 for i in range(context)], max_tokens=4)
    # Its first decode step, when the sliding groups have released what the last chunk read.
    while s.stats()["generated_tokens"] < 2:
        step(s)
    return cache.used_bytes()


def concurrency(spec: KvSpec, args: argparse.Namespace) -> dict[str, float | int]:
    """Peak running sequences of ``--concurrency-context``-token prompts in the budget, until every
    request was admitted: each generates 1024 tokens, so the peak is what memory holds (a step
    prefills one chunk, so short-lived sequences would bound it by their lifetime instead)."""
    budget = args.budget_mib << 20
    cache = cache_for(spec, budget, args, max_num_seqs=1024, enable_prefix_caching=False)
    s = cache.scheduler
    requests = cache.num_blocks * BLOCK_SIZE // args.concurrency_context + 8  # more than could ever fit
    for r in range(requests):
        prompt = [(r * 7919 + i) % 30000 + 3 for i in range(args.concurrency_context)]
        s.add_request(f"r{r}", prompt, max_tokens=1024)
    peak, steps = 0, 0
    while s.num_waiting:
        step(s)
        steps += 1
        peak = max(peak, s.num_running)
    return {"num_blocks": cache.num_blocks, "page_bytes": cache.page_bytes, "peak_running": peak, "steps": steps}


def prefix_hits(spec: KvSpec, shared: int, budget_mib: int, args: argparse.Namespace) -> float:
    """Prefix-hit rate of 32 requests sharing a ``shared``-token system prompt then 1,024 tokens
    of their own, 4 at a time, in ``budget_mib`` MiB (a small budget evicts between them)."""
    s = cache_for(spec, budget_mib << 20, args, max_num_seqs=4).scheduler
    system = [(i * 31) % 30000 + 3 for i in range(shared)]
    for r in range(32):
        s.add_request(f"r{r}", system + [(r * 13 + i) % 30000 + 3 for i in range(1024)], max_tokens=16)
    while s.has_unfinished():
        step(s)
    return float(s.stats()["prefix_hit_rate"])


def throughput(args: argparse.Namespace) -> dict[str, object]:
    """Gemma 3 270M serving ``--requests`` prompts at once at one KV budget (``--uniform-sequences``
    whole sequences of the uniform cache), hybrid vs uniform: wall time, output tokens/s, peak
    running batch, and whether the greedy tokens agree."""
    import time

    import numpy as np

    from pagedkv.engine import Engine, EngineConfig
    from pagedkv.loaders.registry import load_model
    from pagedkv.sampling import SamplingParams

    model, tokenizer = load_model("gemma3-270m")
    spec = model.kv_spec(args.kv_dtype)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(10, 200_000, args.prompt_tokens))) for _ in range(args.requests)]
    per_sequence = (args.prompt_tokens + args.output_tokens) // BLOCK_SIZE + 1  # blocks of every layer
    probe = cache_for(uniform(spec), 1 << 30, args)
    budget = args.uniform_sequences * per_sequence * probe.page_bytes
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    results: dict[str, dict] = {}
    tokens: dict[str, list[list[int]]] = {}
    for name, hybrid in (("uniform", False), ("hybrid", True)):
        pages = budget // page_bytes(Scheduler(num_blocks=16, block_size=BLOCK_SIZE, max_model_len=16,
                                               kv_spec=spec if hybrid else uniform(spec)))
        config = EngineConfig(num_blocks=pages, block_size=BLOCK_SIZE, kv_dtype=args.kv_dtype,
                              max_num_batched_tokens=args.max_num_batched_tokens, hybrid_kv_cache=hybrid,
                              enable_prefix_caching=False)
        engine = Engine(model, tokenizer, config)
        try:
            start = time.perf_counter()
            handles = [engine.submit(p, params) for p in prompts]
            outputs = [h.result(timeout=3600) for h in handles]
            wall = time.perf_counter() - start
            stats = engine.stats()
        finally:
            engine.shutdown(timeout=60)
        tokens[name] = [o.outputs[0].token_ids for o in outputs]
        generated = sum(len(t) for t in tokens[name])
        results[name] = {"num_blocks": pages, "wall_s": round(wall, 2), "output_tokens_per_s": round(generated / wall, 2),
                         "peak_running": stats["peak_running"], "preemptions": stats["preemptions"]}
    ratio = results["hybrid"]["output_tokens_per_s"] / results["uniform"]["output_tokens_per_s"]
    return {"requests": args.requests, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "kv_budget_mib": round(budget / 2**20, 1), **results, "ratio": round(ratio, 3), "target": 2.0,
            "met": ratio >= 2.0, "greedy_tokens_equal": tokens["hybrid"] == tokens["uniform"]}


def fragmentation(spec: KvSpec, block_size: int, sliding_block_size: int,
                  args: argparse.Namespace) -> dict[str, float]:
    """Internal fragmentation of each kind of group in pages of ``block_size`` tokens, the sliding
    groups in blocks of ``sliding_block_size``: slots its held blocks allocate but the step's
    queries do not read, over those they read ("full": every cached token; "sliding": each row's
    window back from its first new token), summed over the steps of the Azure conversation trace's
    first 64 requests (lengths x 4, distinct prompts, no prefix caching) in which every running
    sequence was scheduled; and the mean block-table width."""
    from pagedkv.traces import load_trace

    spec = KvSpec(spec.layers, spec.dtype, sliding_block_size=sliding_block_size)
    s = Scheduler(num_blocks=1 << 16, block_size=block_size, kv_spec=spec, enable_prefix_caching=False,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    for r, request in enumerate(load_trace(limit=64)):
        prompt = [(r * 7919 + i) % 30000 + 3 for i in range(4 * request.prompt_tokens)]
        s.add_request(f"r{r}", prompt, max_tokens=max(1, 4 * request.output_tokens))
    windows = [(g.layer.window, g.block_size) for g in s.kv_groups]
    held = {"full": 0, "sliding": 0}
    read = {"full": 0, "sliding": 0}
    widths = []
    while s.has_unfinished():
        out = s.schedule()
        if len(out.context_lens) == s.num_running and len(out.context_lens):
            ctx = out.context_lens.astype(int)
            new = (out.query_start_loc[1:] - out.query_start_loc[:-1]).astype(int)
            blocks = s.kv_group_blocks
            for (window, size), group_blocks in zip(windows, blocks, strict=True):
                kind = "full" if window is None else "sliding"
                held[kind] += group_blocks * size
                read[kind] += int(ctx.sum() if window is None else (ctx - (ctx - new + 1 - window).clip(0)).sum())
            widths.append(out.block_tables.shape[-1])
        s.update(out, [1] * len(out.logits_indices))
    return {f"{kind}_fragmentation": round(held[kind] / read[kind] - 1, 4) for kind in held if read[kind]} | {
        "mean_table_width": round(sum(widths) / max(1, len(widths)), 1), "groups": len(windows)}


def run(args: argparse.Namespace) -> int:
    hybrid = gemma3_config().kv_spec(args.kv_dtype)
    one_size = KvSpec(hybrid.layers, hybrid.dtype, sliding_block_size=BLOCK_SIZE)
    layouts = {"hybrid": hybrid, "hybrid_one_size": one_size, "uniform": uniform(hybrid)}
    groups = Scheduler(num_blocks=64, block_size=BLOCK_SIZE, max_model_len=16, kv_spec=hybrid).kv_groups
    per_context = []
    for context in args.contexts:
        held = {name: bytes_per_sequence(spec, context, args) for name, spec in layouts.items()}
        ratio = held["hybrid"] / held["uniform"]
        target = TARGET_BYTES_RATIO.get(context)
        per_context.append({"context": context, "hybrid_bytes": held["hybrid"], "uniform_bytes": held["uniform"],
                            "hybrid_one_size_bytes": held["hybrid_one_size"],
                            "one_size_ratio": round(held["hybrid_one_size"] / held["uniform"], 4),
                            "ratio": round(ratio, 4), "target": target,
                            "met": None if target is None else ratio <= target})
    fits = {name: concurrency(spec, args) for name, spec in layouts.items()}
    concurrency_ratio = fits["hybrid"]["peak_running"] / max(1, fits["uniform"]["peak_running"])
    hits = {f"shared_{shared}_in_{budget}_mib": {name: round(prefix_hits(spec, shared, budget, args), 4)
                                                 for name, spec in layouts.items()}
            for shared in (256, 2048) for budget in (args.budget_mib, 64)}
    report = {
        "command": "python -m lab bench kv-groups " + " ".join(
            f"--{k.replace('_', '-')} {','.join(map(str, v)) if isinstance(v, tuple) else v}"
            for k, v in vars(args).items() if k in {"contexts", "budget_mib", "concurrency_context",
                                                     "max_num_batched_tokens", "kv_dtype"}),
        "layout": [{"layers": g.layers, "window": g.layer.window, "block_size": g.block_size} for g in groups],
        "bytes_per_sequence": per_context,
        "concurrency": {"context": args.concurrency_context, "budget_mib": args.budget_mib, **fits,
                        "ratio": round(concurrency_ratio, 2), "target": TARGET_CONCURRENCY_RATIO,
                        "met": concurrency_ratio >= TARGET_CONCURRENCY_RATIO},
        "prefix_hit_rate": hits,
        # Per page size / sliding block size: what the hybrid layout wastes in each kind of group,
        # and its tables' width (the kernel's side of the trade: `bench attention`'s paged rows by
        # block size). One size for all groups, then the sliding groups' pages carved.
        "fragmentation_by_block_size": {f"{bs}/{sliding}": fragmentation(hybrid, bs, sliding, args)
                                        for bs, sliding in ((8, 8), (16, 16), (32, 32), (64, 64),
                                                            (16, 8), (16, 4), (32, 8))},
    }
    if args.throughput:
        report["throughput"] = throughput(args)
        report["command"] += (f" --throughput --requests {args.requests} --prompt-tokens {args.prompt_tokens}"
                              f" --output-tokens {args.output_tokens} --uniform-sequences {args.uniform_sequences}")
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"Gemma 3 270M, {args.kv_dtype} K/V, pages of {BLOCK_SIZE}: {len(groups)} groups "
          f"{[(g.layers, g.layer.window, g.block_size) for g in groups]}")
    for row in per_context:
        print(f"  {row['context']:>6} tokens: hybrid {row['hybrid_bytes'] / 2**20:8.1f} MiB, uniform "
              f"{row['uniform_bytes'] / 2**20:8.1f} MiB, ratio {row['ratio']:.3f} (goal {row['target']}; "
              f"one block size for all groups: {row['one_size_ratio']:.3f})")
    c = report["concurrency"]
    print(f"  {args.concurrency_context}-token prompts in {args.budget_mib} MiB: hybrid "
          f"{c['hybrid']['peak_running']} at once, uniform {c['uniform']['peak_running']}: "
          f"{c['ratio']}x (goal {TARGET_CONCURRENCY_RATIO}x)")
    for name, rates in hits.items():
        print(f"  prefix-hit rate, {name}: hybrid {rates['hybrid']:.3f}, uniform {rates['uniform']:.3f}")
    for sizes, row in report["fragmentation_by_block_size"].items():
        print(f"  pages/sliding blocks {sizes:>5}: fragmentation full {row.get('full_fragmentation')}, sliding "
              f"{row.get('sliding_fragmentation')}; {row['groups']} groups, mean table width {row['mean_table_width']}")
    if "throughput" in report:
        t = report["throughput"]
        print(f"  serving {t['requests']} x {t['prompt_tokens']}-token prompts, {t['output_tokens']} tokens each, in "
              f"{t['kv_budget_mib']} MiB: hybrid {t['hybrid']['output_tokens_per_s']} tok/s (peak batch "
              f"{t['hybrid']['peak_running']}), uniform {t['uniform']['output_tokens_per_s']} tok/s (peak batch "
              f"{t['uniform']['peak_running']}): {t['ratio']}x (goal 2x); greedy tokens equal: {t['greedy_tokens_equal']}")
    return 0


def plot(report: dict, path: str) -> None:
    """Bytes per sequence by context, and sequences that fit, hybrid vs uniform."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["bytes_per_sequence"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(rows))
    for offset, name in ((-0.2, "hybrid"), (0.2, "uniform")):
        left.bar([i + offset for i in x], [r[f"{name}_bytes"] / 2**20 for r in rows], width=0.4, label=name)
    left.set_xticks(list(x), [str(r["context"]) for r in rows])
    left.set_xlabel("context (tokens)")
    left.set_ylabel("K/V per sequence (MiB)")
    left.set_yscale("log")
    left.legend()
    c = report["concurrency"]
    right.bar(["hybrid", "uniform"], [c["hybrid"]["peak_running"], c["uniform"]["peak_running"]])
    right.set_ylabel(f"{c['context']}-token sequences at once in {c['budget_mib']} MiB")
    fig.suptitle("Gemma 3 270M: hybrid KV cache (full + sliding groups) vs uniform")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
