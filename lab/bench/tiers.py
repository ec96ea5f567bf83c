"""KV tier benchmark: RAM-only LRU, RAM-only SLRU and RAM + disk on a multi-turn workload, warm
restart against cold start, and the load-versus-recompute crossover (issue 13).

Workload (:func:`build_sessions`): the conversation trace's requests grouped into chat sessions.
Turn ``k`` of a session sends the whole conversation so far: turn ``k-1``'s prompt, then a reply
(the trace's generated length), then a new user message (the trace's context length); so each
turn's prompt starts with the previous one and the shared prefix grows. ``--concurrency`` sessions
run at once in a closed loop (a session sends its next turn when the previous one has ended), and
the RAM pool (``--num-blocks``) holds fewer blocks than the sessions' histories, so between two
turns of a session its blocks are evicted by the others': RAM-only recomputes them, RAM + disk
loads them back.

Every variant runs the same requests in the same closed-loop order on the same model (real
compute, wall clock, greedy) through :class:`~pagedkv.engine.EngineCore` stepped here, one
thread. Reported per variant: prefix hit rate (prompt tokens served from cache, RAM or disk),
TTFT p50/p99, output tokens/s, and the disk tier's figures. Then the restart: the RAM + disk
engine is closed (its tier flushed), and the first ``--restart-requests`` requests of the workload
are replayed on a fresh engine reopening that directory (warm) and on one with an empty directory
(cold). The crossover: the TTFT of a prompt of N blocks prefilled from nothing, against the same
prompt whose blocks are only on disk (evicted from RAM, loaded back), for N in ``--crossover-blocks``.

Targets of the issue, measured and reported (not enforced): RAM + disk cuts TTFT p50 by ≥ 2×
against RAM-only; a warm restart serves its first requests ≥ 3× faster than a cold start.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pagedkv.cli import byte_size, comma_list, model_source, non_negative_int, positive_float, positive_int, trace_source
from pagedkv.engine import EngineConfig, EngineCore, PagedModelRunner, RequestOutput
from pagedkv.errors import InvalidArgumentError
from pagedkv.loaders import load_model
from pagedkv.loaders.identity import WeightsDigest, kv_identity
from pagedkv.models import LlamaModel
from pagedkv.sampling import SamplingParams
from pagedkv.traces import SHIPPED_TRACES, TraceRequest, load_trace

TARGET_TTFT_P50_SPEEDUP = 2.0
TARGET_WARM_RESTART_SPEEDUP = 3.0

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Session:
    """One conversation: each turn's whole prompt (each starts with the one before) and output length."""

    prompts: list[list[int]]
    max_tokens: list[int]


def build_sessions(
    trace: Sequence[TraceRequest],
    *,
    sessions: int,
    turns: int,
    length_scale: float,
    max_prompt_len: int,
    vocab: tuple[int, int],
    seed: int = 0,
) -> list[Session]:
    """``sessions`` sessions of ``turns`` turns from consecutive trace requests (one per turn):
    turn ``k`` appends, to turn ``k-1``'s prompt, a reply of that request's output length and a
    user message of this request's prompt length, both times ``length_scale`` and at least one
    token; tokens are seeded pseudo-random in ``vocab`` (so sessions share nothing). A session
    stops growing once its prompt would pass ``max_prompt_len``. Outputs: the trace's, scaled,
    at most 32 tokens (TTFT is the measure)."""
    if len(trace) < sessions * turns:
        raise InvalidArgumentError(f"the trace has {len(trace)} requests; {sessions} sessions x {turns} turns need more")
    rng = np.random.default_rng(seed)
    out = []
    for s in range(sessions):
        prompts: list[list[int]] = []
        max_tokens: list[int] = []
        history: list[int] = []
        for t in range(turns):
            request = trace[s * turns + t]
            reply = 0 if t == 0 else max(1, round(trace[s * turns + t - 1].output_tokens * length_scale))
            message = max(1, round(request.prompt_tokens * length_scale))
            grown = history + rng.integers(*vocab, size=reply + message).tolist()
            if prompts and len(grown) > max_prompt_len:
                break
            history = grown[:max_prompt_len]
            prompts.append(history)
            max_tokens.append(max(1, min(32, round(request.output_tokens * length_scale))))
        out.append(Session(prompts, max_tokens))
    return out


@dataclass
class Served:
    """One request as the closed loop saw it."""

    session: int
    turn: int
    prompt_len: int
    output: RequestOutput


def replay(
    core: EngineCore, sessions: Sequence[Session], concurrency: int, limit: int | None = None
) -> tuple[list[Served], float]:
    """Runs the sessions' turns in a closed loop, ``concurrency`` sessions at once (in order), each
    turn queued when its session's previous one ends; stops after ``limit`` requests (None: all).
    Returns the requests in the order they were queued, and the wall seconds taken."""
    pending = list(range(len(sessions)))[::-1]  # sessions not started, next last
    active: dict[str, Served] = {}
    served: list[Served] = []
    started = time.perf_counter()

    def queue(session: int, turn: int) -> None:
        if limit is not None and len(served) >= limit:
            return
        s = sessions[session]
        request_id = f"s{session}t{turn}"
        params = SamplingParams(max_tokens=s.max_tokens[turn], temperature=0.0, ignore_eos=True)
        output = core.add_request(request_id, s.prompts[turn], params)
        item = Served(session, turn, len(s.prompts[turn]), output)
        active[request_id] = item
        served.append(item)

    while pending and len(active) < concurrency:
        queue(pending.pop(), 0)
    while active:
        _, ended = core.step()
        for output in ended:
            item = active.pop(output.request_id)
            if item.turn + 1 < len(sessions[item.session].prompts):
                queue(item.session, item.turn + 1)
            elif pending:
                queue(pending.pop(), 0)
    return served, time.perf_counter() - started


def summarize(served: Sequence[Served], seconds: float, stats: dict[str, float]) -> dict[str, object]:
    """Hit rate, TTFT percentiles, throughput and the tier's figures of one replay on a fresh core
    (``stats``: its totals). The hit rate counts prompt tokens served from RAM or loaded from disk
    (a dropped load is recomputed: not a hit) over the prompt tokens looked up."""
    ttfts = np.array([s.output.metrics.ttft for s in served if s.output.metrics.ttft is not None])
    generated = sum(len(s.output.token_ids) for s in served)
    loaded = stats.get("disk_hit_tokens", 0) - stats.get("disk_loads_dropped", 0) * BLOCK_SIZE
    queried = stats["prefix_queried_tokens"]
    return {
        "requests": len(served),
        "prompt_tokens": sum(s.prompt_len for s in served),
        "prefix_hit_rate": (stats["prefix_hit_tokens"] + loaded) / queried if queried else 0.0,
        "ram_hit_rate": stats["prefix_hit_tokens"] / queried if queried else 0.0,
        "ttft_p50_s": float(np.percentile(ttfts, 50)) if len(ttfts) else None,
        "ttft_p99_s": float(np.percentile(ttfts, 99)) if len(ttfts) else None,
        "ttft_mean_s": float(ttfts.mean()) if len(ttfts) else None,
        "output_tokens_per_s": generated / seconds if seconds else 0.0,
        "seconds": seconds,
        "disk": {k: v for k, v in stats.items() if k.startswith("disk_")},
    }


class _Bench:
    """The model, loaded once, and the engine cores the variants run on."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        digest = WeightsDigest()
        self.model: LlamaModel
        self.model, _ = load_model(args.model, seed=args.seed, digest=digest)
        self.base = EngineConfig(
            num_blocks=args.num_blocks,
            block_size=BLOCK_SIZE,
            max_num_seqs=args.concurrency,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_dtype=args.kv_dtype,
            # Clean blocks kept ahead of need with the tier: one full step's allocation (its token
            # budget in blocks and a decode block per sequence), so steps rarely evict a cached
            # block unsaved (the scheduler's default caps this at a sixteenth of the pool).
            offload_watermark_blocks=min(args.num_blocks, args.max_num_batched_tokens // BLOCK_SIZE + args.concurrency)
            if args.offload_watermark is None
            else args.offload_watermark,
        )
        self.identity = kv_identity(self.model.config, digest.hexdigest(), self.model.weight_dtype, args.kv_dtype, BLOCK_SIZE)

    def core(self, config: EngineConfig) -> EngineCore:
        runner = PagedModelRunner(self.model, config.kv_dtype)
        return EngineCore(runner, config, eos_token_ids=self.model.config.eos_token_ids, model_identity=self.identity)

    def disk(self, directory: Path, **changes: object) -> EngineConfig:
        return replace(self.base, kv_disk_path=directory, kv_disk_bytes=self.args.kv_disk_bytes, **changes)


def _speedup(slow: object, fast: object) -> float | None:
    return slow / fast if isinstance(slow, float) and isinstance(fast, float) and fast > 0 else None


def _variants(bench: _Bench, sessions: list[Session], directory: Path, progress: Callable[[str], None]) -> dict[str, dict]:
    """The three variants side by side, each run on a fresh core once per round, in an order
    rotated every round (so a drift of the machine's load falls on each alike); each scalar is
    the median over the rounds. The disk variant's tiers go in subdirectories of ``directory``;
    the last one is left in ``directory / "tier"`` for the restart."""
    configs = {
        "ram_lru": replace(bench.base, eviction_policy="lru"),
        "ram_slru": replace(bench.base, eviction_policy="slru"),
        "ram_disk": replace(bench.base, eviction_policy="slru"),  # its directory: per round
    }
    names = list(configs)
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in names}
    for r in range(bench.args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            progress(f"round {r + 1}: {name}")
            config = configs[name]
            if name == "ram_disk":
                tier = directory / "tier"
                if tier.exists():
                    shutil.rmtree(tier)  # each round starts cold; the last one stays for the restart
                config = bench.disk(tier, eviction_policy="slru")
            core = bench.core(config)
            try:
                served, seconds = replay(core, sessions, bench.args.concurrency)
                runs[name].append(summarize(served, seconds, core.stats()))
            finally:
                core.close()
    return {name: _median(results) for name, results in runs.items()}


def _median(results: list[dict[str, object]]) -> dict[str, object]:
    """The median of each numeric figure over rounds; the rest (the tier's figures) from the last."""
    out = dict(results[-1])
    for key, value in out.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(np.median([r[key] for r in results]))  # type: ignore[misc]
    return out | {"rounds": len(results)}


def _restart(bench: _Bench, sessions: list[Session], directory: Path, progress: Callable[[str], None]) -> dict[str, object]:
    """The first requests of the workload on a reopened tier (warm) and on an empty one (cold)."""
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="pagedkv-cold-") as cold_dir:
        for name, path in (("cold", Path(cold_dir)), ("warm", directory)):
            progress(f"restart {name}")
            core = bench.core(bench.disk(path))
            try:
                served, seconds = replay(core, sessions, bench.args.concurrency, limit=bench.args.restart_requests)
                out[name] = summarize(served, seconds, core.stats()) | {"opened": core.disk_tier}
            finally:
                core.close()
    return out


def _crossover(bench: _Bench, progress: Callable[[str], None]) -> dict[str, object]:
    """TTFT of an N-block prompt recomputed from nothing vs loaded from disk, per N (the median of
    ``--crossover-repeats`` fresh prompts each), and the lines fitted through them: a load is
    worth it from the N where the lines cross (none: at every N measured, or at none)."""
    rng = np.random.default_rng(bench.args.seed + 1)
    vocab = (3, bench.model.config.vocab_size)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rows = []
    for n in bench.args.crossover_blocks:
        progress(f"crossover {n} blocks")
        # Room for one such prompt and a little more, every released block offloaded at once
        # (the watermark is the whole pool): two fillers of its size then leave the prompt's
        # blocks on disk only.
        config = replace(bench.disk(Path("")), num_blocks=n + 4, max_num_seqs=1, offload_watermark_blocks=n + 4)
        recompute, loaded, loads = [], [], 0
        with tempfile.TemporaryDirectory(prefix="pagedkv-crossover-") as directory:
            core = bench.core(replace(config, kv_disk_path=directory))
            try:
                for r in range(bench.args.crossover_repeats):
                    prompt = rng.integers(*vocab, size=n * BLOCK_SIZE + 1).tolist()  # N blocks, then the token computed
                    recompute.append(_ttft(core, f"cold{r}", prompt, params))
                    for i in range(2):  # two fillers of the pool's size: every block of the prompt is evicted
                        _ttft(core, f"filler{r}-{i}", rng.integers(*vocab, size=n * BLOCK_SIZE + 1).tolist(), params)
                    core.step()  # an empty step: its poll offloads the last filler's blocks
                    core.scheduler.flush_disk_tier()  # every store committed: the loads queue behind none
                    before = core.stats()["disk_loads"]
                    loaded.append(_ttft(core, f"again{r}", prompt, params))
                    loads += core.stats()["disk_loads"] - before
            finally:
                core.close()
        rows.append({"blocks": n, "recompute_ttft_s": float(np.median(recompute)), "disk_load_ttft_s": float(np.median(loaded)),
                     "disk_loads": loads, "repeats": len(recompute)})
    out: dict[str, object] = {"rows": rows}
    if len(rows) >= 2:
        blocks = [r["blocks"] for r in rows]
        re_slope, re_base = np.polyfit(blocks, [r["recompute_ttft_s"] for r in rows], 1)
        load_slope, load_base = np.polyfit(blocks, [r["disk_load_ttft_s"] for r in rows], 1)
        crossing = (load_base - re_base) / (re_slope - load_slope) if re_slope != load_slope else None
        out |= {
            "recompute_ms_per_block": 1e3 * re_slope,
            "load_ms_per_block": 1e3 * load_slope,
            "fixed_ms": {"recompute": 1e3 * re_base, "load": 1e3 * load_base},
            "crossover_blocks": crossing,
            "load_faster_at_every_n": all(r["disk_load_ttft_s"] < r["recompute_ttft_s"] for r in rows),
        }
    return out


def _ttft(core: EngineCore, request_id: str, prompt: list[int], params: SamplingParams) -> float:
    output = core.add_request(request_id, prompt, params)
    while not output.finished:
        core.step()
    assert output.metrics.ttft is not None
    return output.metrics.ttft


# --quick: a configuration that checks the benchmark runs (seconds, on the tiny model), not a measurement.
QUICK = {
    "model": "tiny",
    "sessions": 6,
    "turns": 3,
    "concurrency": 2,
    "length_scale": 0.1,
    "num_blocks": 48,
    "restart_requests": 6,
    "rounds": 1,
    "crossover_blocks": (1, 4),
    "crossover_repeats": 1,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    parser.add_argument("--quick", action="store_true", help=f"a tiny run that checks the benchmark works: {QUICK}")
    parser.add_argument("--model", type=model_source, default="smollm2-135m", help="'smollm2-135m' (real compute) or 'tiny'")
    parser.add_argument("--trace", type=trace_source(list(SHIPPED_TRACES)), default="conv")
    # Defaults sized for SmolLM2 on 2 cores (~425 prompt tokens/s): 16 sessions of 4 turns growing to
    # ~1000 tokens, a working set of ~1000 blocks over a 256-block RAM pool; a RAM-only round
    # prefills ~40k tokens (about 100 s), the whole run takes about 15 minutes.
    parser.add_argument("--sessions", type=positive_int, default=16)
    parser.add_argument("--turns", type=positive_int, default=4)
    parser.add_argument("--concurrency", type=positive_int, default=4, help="sessions at once (closed loop)")
    parser.add_argument("--length-scale", type=positive_float, default=0.25, help="multiplies the trace's lengths")
    parser.add_argument("--max-prompt-len", type=positive_int, default=2048)
    parser.add_argument("--num-blocks", type=positive_int, default=256, help="RAM pool (16-token blocks), below the working set")
    parser.add_argument("--kv-disk-bytes", type=byte_size, default=4 << 30, help="disk tier capacity (default 4G)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    parser.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--offload-watermark", type=positive_int, default=None,
                        help="clean blocks kept ahead by offloading (default: one step's budget in blocks + concurrency)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds of the three variants (medians reported)")
    parser.add_argument("--restart-requests", type=positive_int, default=50, help="requests timed after a restart")
    parser.add_argument("--crossover-blocks", type=comma_list(positive_int), default=(1, 4, 16, 64))
    parser.add_argument("--crossover-repeats", type=positive_int, default=3)
    parser.add_argument("--seed", type=non_negative_int, default=0)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args = argparse.Namespace(**(vars(args) | QUICK))
    progress = (lambda _: None) if args.json else (lambda stage: print(f"[bench tiers] {stage}", flush=True))
    bench = _Bench(args)
    trace = load_trace(args.trace, limit=args.sessions * args.turns)
    sessions = build_sessions(
        trace,
        sessions=args.sessions,
        turns=args.turns,
        length_scale=args.length_scale,
        # Room to generate, in the model's positions and in a RAM pool the prompt must fit alone.
        max_prompt_len=min(args.max_prompt_len, bench.model.config.max_position_embeddings, args.num_blocks * BLOCK_SIZE) - 64,
        vocab=(3, bench.model.config.vocab_size),
        seed=args.seed,
    )
    working_set = sum(len(s.prompts[-1]) // BLOCK_SIZE for s in sessions)
    with tempfile.TemporaryDirectory(prefix="pagedkv-tier-") as directory:
        variants = _variants(bench, sessions, Path(directory), progress)
        restart = _restart(bench, sessions, Path(directory) / "tier", progress)
    crossover = _crossover(bench, progress)
    best_ram = min(
        (variants[k]["ttft_p50_s"] for k in ("ram_lru", "ram_slru")), key=lambda v: v if isinstance(v, float) else float("inf")
    )
    ttft_speedup = _speedup(best_ram, variants["ram_disk"]["ttft_p50_s"])
    warm_speedup = _speedup(restart["cold"]["ttft_mean_s"], restart["warm"]["ttft_mean_s"])  # type: ignore[index]
    report = {
        "command": "python -m lab bench tiers " + " ".join(_argv(args)),
        "model": args.model,
        "workload": {
            "trace": str(args.trace),
            "sessions": len(sessions),
            "requests": sum(len(s.prompts) for s in sessions),
            "working_set_blocks": working_set,
            "ram_blocks": args.num_blocks,
        },
        "variants": variants,
        "restart": restart,
        "crossover": crossover,
        "targets": {
            "ttft_p50_speedup_vs_best_ram_only": ttft_speedup,
            "ttft_p50_target": TARGET_TTFT_P50_SPEEDUP,
            "ttft_p50_met": ttft_speedup is not None and ttft_speedup >= TARGET_TTFT_P50_SPEEDUP,
            "warm_restart_ttft_mean_speedup": warm_speedup,
            "warm_restart_target": TARGET_WARM_RESTART_SPEEDUP,
            "warm_restart_met": warm_speedup is not None and warm_speedup >= TARGET_WARM_RESTART_SPEEDUP,
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0


def _argv(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce this run."""
    skip = {"json", "quick", "run", "usage_parser", "command", "bench"}
    out = []
    for key, value in vars(args).items():
        if key in skip or value is None:
            continue
        text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        out.append(f"--{key.replace('_', '-')} {text}")
    return out


def _print(report: dict) -> None:
    def ms(value: object) -> str:
        return f"{1e3 * value:9.1f}" if isinstance(value, float) else f"{'-':>9}"

    print(f"\n{report['command']}\n{report['workload']}")
    print(f"{'variant':<10} {'hit rate':>8} {'TTFT p50 ms':>12} {'p99 ms':>9} {'tok/s':>8}")
    for name, r in report["variants"].items():
        row = f"{r['prefix_hit_rate']:8.3f} {ms(r['ttft_p50_s']):>12} {ms(r['ttft_p99_s'])} {r['output_tokens_per_s']:8.1f}"
        print(f"{name:<10} {row}")
    for name, r in report["restart"].items():
        ttft = f"TTFT mean {ms(r['ttft_mean_s'])} ms, p50 {ms(r['ttft_p50_s'])} ms"
        print(f"restart {name:<5}: {ttft}, hit rate {r['prefix_hit_rate']:.3f}")
    for row in report["crossover"]["rows"]:
        print(f"crossover {row['blocks']:4d} blocks: TTFT recompute {ms(row['recompute_ttft_s'])} ms,"
              f" disk load {ms(row['disk_load_ttft_s'])} ms ({row['disk_loads']} blocks loaded)")
    c = report["crossover"]
    if "crossover_blocks" in c:
        print(f"per block: recompute {c['recompute_ms_per_block']:.3f} ms, load {c['load_ms_per_block']:.3f} ms;"
              f" lines cross at {c['crossover_blocks']} blocks; load faster at every N: {c['load_faster_at_every_n']}")
    t = report["targets"]
    print(f"targets: TTFT p50 speedup {t['ttft_p50_speedup_vs_best_ram_only']} (≥ {t['ttft_p50_target']}: {t['ttft_p50_met']}),"
          f" warm restart {t['warm_restart_ttft_mean_speedup']} (≥ {t['warm_restart_target']}: {t['warm_restart_met']})")
