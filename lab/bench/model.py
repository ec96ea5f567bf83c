"""A real model end to end: pagedkv on SmolLM2-135M (or Gemma 3 270M, ``--model``) beside llama.cpp
and transformers.

For pagedkv (``EngineCore`` stepped here, greedy, eos ignored, prefix caching off and random
prompts so that nothing is shared) it measures single-request decode tokens/s, prompt tokens/s on
a 512-token prompt, and aggregate decode tokens/s at 4, 16 and 32 concurrent requests of 40-token
prompts generating 64 tokens. Decode rates count decode steps only (a step that prefills is left
out), as llama.cpp's ``S_TG`` does. Each figure is set against the machine's limit measured in the
same rounds: read bandwidth (the median of readings taken before and after every figure, as the
host's swings within seconds) ÷ the bytes of weights a decode step reads (times the batch, capped
by the FMA peak ÷ the FLOPs of a decoded token), and the FMA peak ÷ the FLOPs of a prompt token.

Peers, when built by ``make peers`` (``--peers``, or automatically when ``.peers/`` exists):
llama.cpp's ``llama-bench`` (pp512, tg64) and ``llama-batched-bench`` (``-npp 40 -ntg 64 -npl
4,16,32``) on the same GGUF at Q4_1, F16 and F32, and transformers' ``generate`` in float32 on 1
thread and on torch's default (scripts/bench_transformers.py in the peers venv, one persistent
process each), and for SmolLM2 vLLM's CPU build offline in bfloat16 (``--vllm-dtype``;
scripts/bench_vllm.py in .venv-vllm, from ``make peers-vllm``). Every round runs each contender
once, in a rotated order; the report gives medians over rounds, the load average of the machine at
each figure, and pagedkv's ratio to each peer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import pagedkv
import pagedkv._core as _core
from pagedkv.cli import comma_list, positive_int
from pagedkv.engine import EngineConfig, EngineCore, PagedModelRunner
from pagedkv.loaders import load_model
from pagedkv.loaders.registry import locate_registered
from pagedkv.models import DEFAULT_WEIGHT_DTYPE, WEIGHT_DTYPES, LlamaConfig, LlamaModel
from pagedkv.sampling import SamplingParams

from . import http

MODELS = ("smollm2-135m", "gemma3-270m")
PROMPT_TOKENS = 512
BATCH_PROMPT_TOKENS = 40
NEW_TOKENS = 64

REPO = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON only on stdout (the table goes to stderr)")
    parser.add_argument("--model", default=MODELS[0], choices=MODELS,
                        help="the registry model (default smollm2-135m; gemma3-270m's peer is llama.cpp on its Q4_K_M file)")
    parser.add_argument("--weight-dtype", default=DEFAULT_WEIGHT_DTYPE, choices=WEIGHT_DTYPES,
                        help=f"storage of pagedkv's projections (default {DEFAULT_WEIGHT_DTYPE})")
    parser.add_argument("--quick", action="store_true", help="one round, batches 4 and 16 only, no peers unless --peers")
    parser.add_argument("--samples", type=positive_int, default=None, help="rounds (default 3, quick 1)")
    parser.add_argument("--batches", type=comma_list(positive_int), default=None, help="concurrent requests (default 4,16,32)")
    peers = parser.add_mutually_exclusive_group()
    peers.add_argument("--peers", action="store_true", default=None, help="run the peers (needs `make peers`)")
    peers.add_argument("--no-peers", dest="peers", action="store_false", help="pagedkv only")
    parser.add_argument("--peers-dir", type=Path, default=REPO / ".peers", help="what `make peers` built (default .peers/)")
    parser.add_argument("--peers-venv", type=Path, default=REPO / ".venv-peers", help="the venv with torch and transformers")
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm",
                        help="vLLM's venv, from `make peers` (default .venv-vllm/; a peer when it exists)")
    parser.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default="bfloat16", help="what vLLM computes in")
    parser.add_argument("--plot", type=Path, default=None, help="draw tokens/s against concurrent sequences to this PNG")


# ---- the machine's limits -------------------------------------------------------------------


def prompt_flops_per_token(config: LlamaConfig, prompt_tokens: int) -> float:
    """FLOPs per token of a prompt: the layers' matrix products (2 per weight; the output
    projection runs for the last token only) plus causal attention at the mean context."""
    return 2.0 * _matrix_params(config, with_lm_head=False) + _attention_flops(config, (prompt_tokens + 1) / 2)


def decode_flops_per_token(config: LlamaConfig, context: float) -> float:
    """FLOPs of one decoded token: every matrix product, the output projection included, and
    attention over ``context`` tokens."""
    return 2.0 * _matrix_params(config, with_lm_head=True) + _attention_flops(config, context)


def _attention_flops(config: LlamaConfig, context: float) -> float:
    """QK^T and PV: 4·head_dim per (query head, attended key), in every layer."""
    return 4.0 * config.num_heads * config.head_dim * context * config.num_layers


def _matrix_params(config: LlamaConfig, with_lm_head: bool) -> int:
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * per_layer + (c.vocab_size * c.hidden_size if with_lm_head else 0)


# ---- pagedkv --------------------------------------------------------------------------------


@dataclass
class Rates:
    decode: float  # tokens/s over decode steps only
    prompt: float  # prompt tokens/s over prefill steps only


def pagedkv_rates(model: LlamaModel, n: int, prompt_tokens: int, new_tokens: int, rng: np.random.Generator) -> Rates:
    """``n`` requests of random ``prompt_tokens``-token prompts generating ``new_tokens`` each."""
    # Pages per request: the fewest that hold one whole request (a hybrid cache, Gemma 3's,
    # spends pages on each of its groups), found by bisection on the spec's capacity.
    spec, need = model.kv_spec(), prompt_tokens + new_tokens + 16
    low, high = 0, 1
    while spec.capacity_tokens(high, 16, 2048) < need:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if spec.capacity_tokens(middle, 16, 2048) >= need else (middle, high)
    blocks = n * high
    config = EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=max(n, 1),
                          max_num_batched_tokens=max(2048, n * prompt_tokens), enable_prefix_caching=False)
    core = EngineCore(PagedModelRunner(model), config)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(n):
        core.add_request(f"r{i}", rng.integers(3, model.config.vocab_size, prompt_tokens).tolist(), params)
    decode_s = prefill_s = 0.0
    decoded = prefilled = 0
    while core.has_unfinished():
        start = time.perf_counter()
        events, _ = core.step()
        seconds = time.perf_counter() - start
        stats = core.last_step.stats
        if stats["num_prefill_tokens"]:
            prefill_s += seconds
            prefilled += stats["num_prefill_tokens"]
        else:
            decode_s += seconds
            decoded += len(events)
    return Rates(decode=decoded / decode_s if decode_s else float("nan"), prompt=prefilled / prefill_s)


# ---- peers ----------------------------------------------------------------------------------


def _run_json_lines(command: list[str]) -> list[dict]:
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith(("{", "["))]


def peer_files(model: str, peers: Path) -> dict[str, Path]:
    """The GGUF files llama.cpp runs, by precision: SmolLM2's shipped Q4_1 and the F16 / F32 that
    `make peers` requantizes; Gemma 3's shipped Q4_K_M file."""
    if model == "gemma3-270m":
        return {"Q4_K_M": locate_registered(model)}
    return {precision: peers / "models" / f"smollm2-{precision}.gguf" for precision in ("Q4_1", "F16", "F32")}


def llama_bench(peers: Path, gguf: Path, threads: int) -> dict[str, float]:
    """llama-bench pp512 and tg64, one repetition."""
    rows = _run_json_lines([str(peers / "bin" / "llama-bench"), "-m", str(gguf),
                            "-p", str(PROMPT_TOKENS), "-n", str(NEW_TOKENS), "-r", "1", "-t", str(threads), "-o", "jsonl"])
    out = {}
    for row in rows:
        out["prompt" if row["n_prompt"] else "decode"] = float(row["avg_ts"])
    return out


def llama_batched_bench(peers: Path, gguf: Path, threads: int, batches: tuple[int, ...]) -> dict[str, float]:
    """llama-batched-bench S_TG (aggregate decode tokens/s) at each batch."""
    # Its cache is split evenly between the max(batches) sequences: room for 40 + 64 tokens each.
    context = max(batches) * (BATCH_PROMPT_TOKENS + NEW_TOKENS + 16)
    rows = _run_json_lines(
        [
            str(peers / "bin" / "llama-batched-bench"),
            "-m",
            str(gguf),
            "-c",
            str(context),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            str(BATCH_PROMPT_TOKENS),
            "-ntg",
            str(NEW_TOKENS),
            "-npl",
            ",".join(map(str, batches)),
            "-t",
            str(threads),
            "--output-format",
            "jsonl",
        ]
    )
    return {f"batch_{row['pl']}": float(row["speed_tg"]) for row in rows}


class ScriptPeer:
    """A peer script speaking JSON lines (scripts/bench_transformers.py, scripts/bench_vllm.py):
    loaded once, its first line describes it, then one round of figures per request."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        # The next JSON object line: a library may print its own lines to stdout (vLLM does).
        while (line := self.process.stdout.readline()) and not line.startswith("{"):
            pass
        if not line:
            raise RuntimeError(f"the peer {self.process.args[1]} exited ({self.process.wait()})")
        return json.loads(line)

    def round(self) -> dict[str, float]:
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        """Ends the script (end of input), killed if it has not exited within a minute."""
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def transformers_peer(venv: Path, gguf: Path, threads: int, batches: tuple[int, ...]) -> ScriptPeer:
    """transformers' ``generate`` in float32 on ``threads`` torch threads (0: torch's default)."""
    return ScriptPeer([str(venv / "bin" / "python"), str(REPO / "scripts" / "bench_transformers.py"), "--gguf", str(gguf),
                       "--threads", str(threads), "--batches", ",".join(map(str, batches))])


def vllm_peer(args: argparse.Namespace, batches: tuple[int, ...]) -> ScriptPeer:
    """vLLM's CPU build offline (scripts/bench_vllm.py), with the CPU settings `bench http` gives
    its server (KV space for the largest batch, threads bound to this process's cores)."""
    settings = argparse.Namespace(vllm_venv=args.vllm_venv, vllm_dtype=args.vllm_dtype, model=args.model,
                                  peers_dir=args.peers_dir, threads=pagedkv.get_num_threads())
    python, directory = http.vllm_paths(settings)
    # Its logs to stderr: stdout carries the JSON lines.
    env = http.vllm_env(settings, max(PROMPT_TOKENS, max(batches) * (BATCH_PROMPT_TOKENS + NEW_TOKENS)) + 16)
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    return ScriptPeer([str(python), str(REPO / "scripts" / "bench_vllm.py"), "--model", str(directory),
                       "--dtype", args.vllm_dtype, "--batches", ",".join(map(str, batches))], env)


# ---- the run --------------------------------------------------------------------------------


def _load() -> float:
    return os.getloadavg()[0]


def run(args) -> int:
    samples = args.samples or (1 if args.quick else 3)
    batches = args.batches or ((4, 16) if args.quick else (4, 16, 32))
    use_peers = args.peers if args.peers is not None else (not args.quick and (args.peers_dir / "bin").is_dir())
    table = sys.stderr if args.json else sys.stdout
    threads = pagedkv.get_num_threads()

    model, _ = load_model(args.model, weight_dtype=args.weight_dtype)
    config = model.config
    weight_dtype = model.weight_dtype  # the precision the products read
    decode_bytes = model.projection_nbytes
    prompt_flops = prompt_flops_per_token(config, PROMPT_TOKENS)
    probe = pagedkv.ReadBandwidthProbe(256 * MIB)
    rng = np.random.default_rng(0)
    pagedkv_rates(model, 2, 16, 4, rng)  # warm-up: pages the weights in, starts the pools

    # contender -> figure -> [(value, load average)]
    figures: dict[str, dict[str, list[tuple[float, float]]]] = {}

    def record(contender: str, values: dict[str, float]) -> None:
        load = _load()
        for key, value in values.items():
            figures.setdefault(contender, {}).setdefault(key, []).append((value, load))
        print(
            f"  {contender}: " + ", ".join(f"{k} {v:.1f}" for k, v in values.items()) + f" (load {load:.1f})",
            file=sys.stderr,
            flush=True,
        )

    def pagedkv_round() -> None:
        # The host's bandwidth swings within seconds (15-64 GB/s seen): read before and after
        # every figure, and the round's limit is the median of those readings.
        readings = [probe.sweep()]

        def measured(rate: float) -> float:
            readings.append(probe.sweep())
            return rate

        values = {
            "decode": measured(pagedkv_rates(model, 1, BATCH_PROMPT_TOKENS, NEW_TOKENS, rng).decode),
            "prompt": measured(pagedkv_rates(model, 1, PROMPT_TOKENS, 1, rng).prompt),
        }
        for n in batches:
            values[f"batch_{n}"] = measured(pagedkv_rates(model, n, BATCH_PROMPT_TOKENS, NEW_TOKENS, rng).decode)
        record("limits", {"bandwidth_gbps": statistics.median(readings), "fma_peak_gflops": _core.measure_fma_peak()})
        record(f"pagedkv {weight_dtype}", values)

    contenders: list[tuple[str, Callable[[], None]]] = [("pagedkv", pagedkv_round)]
    peers_info: dict[str, object] = {}
    script_peers: list[ScriptPeer] = []

    def add_script_peer(name: str, peer: ScriptPeer) -> None:
        script_peers.append(peer)
        peers_info[name] = peer.info
        contenders.append((name, lambda: record(name, peer.round())))

    try:
        if use_peers:
            peers = args.peers_dir
            peers_info["llama.cpp"] = (peers / "version.txt").read_text().strip() if (peers / "version.txt").exists() else None
            for precision, path in peer_files(args.model, peers).items():

                def llama_round(precision=precision, path=path) -> None:
                    record(
                        f"llama.cpp {precision}",
                        {**llama_bench(peers, path, threads), **llama_batched_bench(peers, path, threads, batches)},
                    )

                contenders.append((f"llama.cpp {precision}", llama_round))
            gguf = locate_registered(args.model)
            # transformers reads SmolLM2's GGUF (scripts/bench_transformers.py); Gemma 3 has no such peer.
            for torch_threads in ((1, 0) if args.model == MODELS[0] else ()):
                peer = transformers_peer(args.peers_venv, gguf, torch_threads, batches)
                add_script_peer(f"transformers f32 {peer.info['threads']}t", peer)
            # vLLM serves SmolLM2 converted to a Hugging Face directory (`make peers-vllm`).
            if args.model == MODELS[0] and (args.vllm_venv / "bin" / "python").exists():
                add_script_peer(f"vllm {args.vllm_dtype}", vllm_peer(args, batches))
        for sample in range(samples):
            shift = sample % len(contenders)
            for name, measure in contenders[shift:] + contenders[:shift]:
                print(f"round {sample + 1}/{samples}: {name} (load {_load():.1f})", file=sys.stderr, flush=True)
                measure()
    finally:
        for peer in script_peers:
            peer.close()

    medians = {
        c: {
            k: {
                "median": statistics.median(v for v, _ in vals),
                "load_avg": statistics.median(load for _, load in vals),
                "samples": len(vals),
            }
            for k, vals in figs.items()
        }
        for c, figs in figures.items()
    }
    bandwidth = medians["limits"]["bandwidth_gbps"]["median"] * 1e9
    fma = medians["limits"]["fma_peak_gflops"]["median"] * 1e9
    ours = medians[f"pagedkv {weight_dtype}"]
    # A decode step reads the weights once for all its n tokens: n × bandwidth ÷ weight bytes,
    # until the FMA peak binds (at the mean context of a 40 + 64 token request).
    decode_flops = decode_flops_per_token(config, BATCH_PROMPT_TOKENS + NEW_TOKENS / 2)
    limits = {"decode": bandwidth / decode_bytes, "prompt": fma / prompt_flops}
    limits.update({f"batch_{n}": min(n * bandwidth / decode_bytes, fma / decode_flops) for n in batches})
    for key, figure in ours.items():
        figure["fraction_of_limit"] = figure["median"] / limits[key]
        figure["ratios"] = {
            peer: figure["median"] / figs[key]["median"]
            for peer, figs in medians.items()
            if peer not in ("limits", f"pagedkv {weight_dtype}") and key in figs
        }
    report = {
        "model": args.model,
        "weight_dtype": weight_dtype,
        "threads": threads,
        "samples": samples,
        "decode_weight_bytes": decode_bytes,
        "prompt_flops_per_token": prompt_flops,
        "decode_flops_per_token": decode_flops,
        "limits_tokens_per_s": limits,
        "peers": peers_info,
        "figures": medians,
    }
    _print_table(report, table)
    if args.plot is not None:
        plot_concurrency(report, args.plot)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    return 0


def plot_concurrency(report: dict, path: Path) -> None:
    """Decode tokens/s against concurrent sequences (1 = single-stream decode, then each batch),
    one line per contender, from a report of :func:`run` (or its saved JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(figsize=(6.5, 4.2))
    concurrencies: set[int] = set()
    for contender, figures in report["figures"].items():
        if contender == "limits":
            continue
        points = sorted((1 if key == "decode" else int(key.removeprefix("batch_")), value["median"])
                        for key, value in figures.items() if key == "decode" or key.startswith("batch_"))
        concurrencies.update(n for n, _ in points)
        bold = contender.startswith("pagedkv")
        axes.plot(*zip(*points, strict=True), marker="o", linewidth=2.5 if bold else 1.2, label=contender)
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted(concurrencies), [str(n) for n in sorted(concurrencies)])
    axes.set_xlabel("concurrent sequences")
    axes.set_ylabel("decode tokens/s")
    axes.set_title(f"{report['model']}, {report['threads']} threads, medians of {report['samples']} rounds")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_table(report: dict, file) -> None:
    figures = report["figures"]
    keys = list(figures[f"pagedkv {report['weight_dtype']}"])
    limits = figures["limits"]
    print(
        f"{report['model']}, {report['threads']} threads, medians of {report['samples']} round(s); "
        f"bandwidth {limits['bandwidth_gbps']['median']:.1f} GB/s, FMA peak {limits['fma_peak_gflops']['median']:.0f} GFLOP/s "
        f"(load {limits['bandwidth_gbps']['load_avg']:.1f})",
        file=file,
    )
    print(f"{'contender':24}" + "".join(f"{k:>18}" for k in keys) + "   tokens/s (load avg)", file=file)
    for contender, figs in figures.items():
        if contender == "limits":
            continue
        cells = [f"{figs[k]['median']:9.1f} ({figs[k]['load_avg']:4.1f})" if k in figs else "" for k in keys]
        print(f"{contender:24}" + "".join(f"{c:>18}" for c in cells), file=file)
    ours = figures[f"pagedkv {report['weight_dtype']}"]
    print(f"{'pagedkv / limit':24}" + "".join(f"{ours[k]['fraction_of_limit']:>18.2f}" for k in keys), file=file)
    peers = sorted({p for k in keys for p in ours[k]["ratios"]})
    for peer in peers:
        cells = [f"{ours[k]['ratios'][peer]:.2f}" if peer in ours[k]["ratios"] else "" for k in keys]
        print(f"{'pagedkv / ' + peer:24}"[:24] + "".join(f"{c:>18}" for c in cells), file=file)
