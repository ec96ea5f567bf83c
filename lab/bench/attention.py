"""Paged attention: decode near the memory-bandwidth limit, paged vs contiguous, prefill GFLOP/s.

Each case times, interleaved round by round, paged decode over a shuffled block table and over a
sequential one, the same loop over contiguous K/V (``ContiguousKV``) and a read-only sweep of
memory (``ReadBandwidthProbe``) on the same threads: every figure is compared with what the
machine gave in the same minutes. A numpy baseline on contiguous float32 K/V is timed after them
(its BLAS threads spin after each call and would slow whatever ran next). The median of the
samples is reported.

So that K/V come from memory rather than from the 32 MiB L3, every variant holds several
"layers" of K/V, at least ``--kv-mib`` in all, and consecutive calls walk through them like the
layers of a model step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

import pagedkv
import pagedkv._core as _core
from pagedkv.cli import comma_list, one_of, positive_int

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
MIB = 1 << 20
# Skip a case whose K/V for one layer exceed this: three copies (paged, contiguous, numpy) live at once.
MAX_LAYER_BYTES = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON only on stdout (the table goes to stderr)")
    parser.add_argument("--quick", action="store_true", help="a few representative cases, fewer samples")
    parser.add_argument("--samples", type=positive_int, default=None, help="timed rounds per case (default 5, quick 3)")
    parser.add_argument("--threads", type=positive_int, default=None, help="attention threads (default: pagedkv's)")
    parser.add_argument("--kv-mib", type=positive_int, default=256, help="K/V held per variant, across layers (MiB)")
    parser.add_argument(
        "--dtypes", type=comma_list(one_of(list(DTYPE_BYTES))), default=",".join(DTYPE_BYTES), help="comma-separated K/V dtypes"
    )


def _median_time(run: Callable[[int], object], layers: int) -> float:
    """Seconds per call of one round: every layer once."""
    start = time.perf_counter()
    for layer in range(layers):
        run(layer)
    return (time.perf_counter() - start) / layers


def _numpy_decode(keys: np.ndarray, values: np.ndarray, query: np.ndarray, scale: float) -> np.ndarray:
    """Dense decode attention: keys/values [batch, kv_heads, context, d], query [batch, heads, d]."""
    batch, kv_heads, _, d = keys.shape
    q = query.reshape(batch, kv_heads, -1, d)
    scores = np.matmul(q, keys.swapaxes(-1, -2)) * scale
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return np.matmul(scores, values).reshape(batch, -1, d)


def _numpy_prefill(keys: np.ndarray, values: np.ndarray, query: np.ndarray, scale: float) -> np.ndarray:
    """Dense causal prefill of the last n positions: keys/values [1, kv_heads, context, d], query [n, heads, d]."""
    _, kv_heads, context, d = keys.shape
    n = query.shape[0]
    q = query.reshape(n, kv_heads, -1, d).transpose(1, 2, 0, 3).reshape(kv_heads, -1, d)  # [kvh, g*n, d]
    scores = np.matmul(q, keys[0].swapaxes(-1, -2)) * scale  # [kvh, g*n, context]
    positions = np.tile(context - n + np.arange(n), q.shape[1] // n)
    scores[:, np.arange(context)[None, :] > positions[:, None]] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return np.matmul(scores, values[0])


class Case:
    """One shape: the variants' data, built once, and their timings."""

    def __init__(self, kind, dtype, batch, context, new_tokens, block_size, kv_bytes_target, rng):
        self.kind, self.dtype, self.batch, self.context = kind, dtype, batch, context
        self.new_tokens, self.block_size = new_tokens, block_size
        self.layer_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE_BYTES[dtype]
        self.layers = max(1, -(-kv_bytes_target // self.layer_bytes))
        blocks_per_seq = -(-context // block_size)
        num_blocks = batch * blocks_per_seq
        self.cache = pagedkv.KVCache(self.layers, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype)
        self.cache.fill_random(1)
        self.tables = {
            "sequential": np.arange(num_blocks, dtype=np.int32).reshape(batch, blocks_per_seq),
            "shuffled": rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq),
        }
        self.contiguous = [
            pagedkv.ContiguousKV(batch, NUM_KV_HEADS, context, HEAD_DIM, dtype, seed=layer) for layer in range(self.layers)
        ]
        shape = (batch, NUM_KV_HEADS, context, HEAD_DIM)
        self.numpy_kv = []
        for _ in range(self.layers):
            keys, values = np.empty(shape, np.float32), np.empty(shape, np.float32)
            rng.random(out=keys, dtype=np.float32)
            rng.random(out=values, dtype=np.float32)
            self.numpy_kv.append((keys, values))
        queries = batch * new_tokens
        self.query = rng.standard_normal((queries, NUM_HEADS, HEAD_DIM)).astype(np.float32)
        self.context_lens = np.full(batch, context, np.int32)
        self.query_start_loc = (np.arange(batch + 1) * new_tokens).astype(np.int32)
        self.scale = 1 / np.sqrt(HEAD_DIM)

    def runners(self) -> dict[str, Callable[[int], object]]:
        cache, q, cl, qsl = self.cache, self.query, self.context_lens, self.query_start_loc
        runners: dict[str, Callable[[int], object]] = {}
        for layout in ("shuffled", "sequential") if self.kind == "decode" else ("shuffled",):
            table = self.tables[layout]
            runners[layout] = lambda layer, table=table: cache.attention(layer, q, table, cl, qsl)
        bs = self.block_size
        runners["contiguous"] = lambda layer: self.contiguous[layer].attention(q, cl, qsl, block_size=bs)
        numpy_attention = _numpy_decode if self.kind == "decode" else _numpy_prefill
        runners["numpy"] = lambda layer: numpy_attention(*self.numpy_kv[layer], q, self.scale)
        return runners

    def flops(self) -> float:
        """Useful FLOPs: 4·d per (query row, attended key), QK^T and PV, causal keys only."""
        keys_attended = sum(self.context - self.new_tokens + j + 1 for j in range(self.new_tokens))
        return 4.0 * HEAD_DIM * NUM_HEADS * self.batch * keys_attended

    def kv_bytes(self) -> int:
        return self.layer_bytes


def _measure(case: Case, probe, samples: int) -> dict[str, list[float]]:
    runners = case.runners()
    numpy_runner = runners.pop("numpy")
    names = list(runners)
    for name in names:  # warm-up: page in, build the pool, fault the output buffers
        _median_time(runners[name], case.layers)
    times: dict[str, list[float]] = {name: [] for name in names}
    times["bandwidth"] = []
    if case.kind == "prefill":
        times["fma_peak"] = []
    for sample in range(samples):
        # Interleave, rotating the order so no variant always follows the same one.
        for name in names[sample % len(names) :] + names[: sample % len(names)]:
            times[name].append(_median_time(runners[name], case.layers))
        times["bandwidth"].append(probe.sweep())
        if case.kind == "prefill":
            times["fma_peak"].append(_core.measure_fma_peak())
    # numpy last, on its own: its BLAS worker threads keep spinning for a while after each call
    # and would take the cores from whichever variant ran next.
    _median_time(numpy_runner, case.layers)
    times["numpy"] = [_median_time(numpy_runner, case.layers) for _ in range(samples)]
    return times


def _cases(args) -> list[tuple]:
    dtypes = args.dtypes
    if args.quick:
        decode = [(b, c) for b, c in [(1, 2048), (16, 2048), (4, 8192)]]
        block_sizes, prefill = [8, 16, 64, 128], [(128, 0), (512, 2048)]
    else:
        decode = [(b, c) for b in (1, 4, 16, 64) for c in (512, 2048, 8192)]
        # 8: the blocks of sliding-window groups carving their pages (`KvSpec.sliding_block_size`).
        block_sizes, prefill = [8, 16, 64, 128], [(n, p) for n in (128, 512, 2048) for p in (0, 2048)]
    out = []
    for dtype in dtypes:
        for bs in block_sizes:
            for batch, context in decode:
                out.append(("decode", dtype, batch, context, 1, bs))
        for n, prefix in prefill:
            out.append(("prefill", dtype, 1, prefix + n, n, 16))
    return out


def _call_overhead(samples: int) -> dict:
    """Python call of one small layer (batch 1, context 128) vs the same kernel timed in Rust."""
    rng = np.random.default_rng(0)
    cache = pagedkv.KVCache(1, 8, 16, NUM_KV_HEADS, HEAD_DIM, "float32")
    cache.fill_random(2)
    query = rng.standard_normal((1, NUM_HEADS, HEAD_DIM)).astype(np.float32)
    args = (0, query, np.arange(8, dtype=np.int32).reshape(1, 8), np.array([128], np.int32), np.array([0, 1], np.int32))
    iterations = 2000
    python_times, kernel_times = [], []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(iterations):
            cache.attention(*args)
        python_times.append((time.perf_counter() - start) / iterations)
        kernel_times.append(_core.attention_kernel_seconds(cache, *args, iterations=iterations))
    python_s, kernel_s = statistics.median(python_times), statistics.median(kernel_times)
    return {
        "batch": 1,
        "context": 128,
        "python_seconds": python_s,
        "kernel_seconds": kernel_s,
        "overhead_us": (python_s - kernel_s) * 1e6,
    }


def run(args) -> int:
    if args.threads is not None:
        pagedkv.set_num_threads(args.threads)
    samples = args.samples or (3 if args.quick else 5)
    rng = np.random.default_rng(0)
    probe = pagedkv.ReadBandwidthProbe(max(args.kv_mib, 64) * MIB)
    kv_target = args.kv_mib * MIB
    table = sys.stderr if args.json else sys.stdout
    results = []
    for kind, dtype, batch, context, new_tokens, bs in _cases(args):
        layer_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * DTYPE_BYTES[dtype]
        if layer_bytes > MAX_LAYER_BYTES:
            continue
        # Prefill is compute-bound: one layer, no need to push its K/V out of the cache.
        case = Case(kind, dtype, batch, context, new_tokens, bs, kv_target if kind == "decode" else 0, rng)
        times = _measure(case, probe, samples)
        bandwidth = statistics.median(times["bandwidth"])
        numpy_s = statistics.median(times["numpy"])
        contiguous_s = statistics.median(times["contiguous"])
        fma_peak = statistics.median(times["fma_peak"]) if kind == "prefill" else None
        layouts = [name for name in times if name not in ("numpy", "bandwidth", "fma_peak")]
        for layout in layouts:
            seconds = statistics.median(times[layout])
            kv_gbps = case.kv_bytes() / seconds / 1e9
            results.append(
                {
                    "kind": kind,
                    "dtype": dtype,
                    "batch": batch,
                    "context": context,
                    "new_tokens": new_tokens,
                    "block_size": bs,
                    "layout": layout,
                    "seconds_median": seconds,
                    "samples": len(times[layout]),
                    "kv_gbps": kv_gbps,
                    "bandwidth_gbps": bandwidth,
                    "fraction_of_bandwidth": kv_gbps / bandwidth,
                    "paged_over_contiguous": seconds / contiguous_s if layout != "contiguous" else None,
                    "gflops": case.flops() / seconds / 1e9,
                    "fma_peak_gflops": fma_peak,
                    "fraction_of_fma_peak": case.flops() / seconds / 1e9 / fma_peak if fma_peak else None,
                    "numpy_seconds_median": numpy_s,
                    "speedup_vs_numpy": numpy_s / seconds,
                    "kv_bytes_per_layer": case.kv_bytes(),
                    "layers_rotated": case.layers,
                }
            )
        _print_row(results[-len(layouts) :], header=len(results) == len(layouts), file=table)
        del case
    report = {
        "threads": pagedkv.get_num_threads(),
        "kernel": pagedkv.available_kernels()[0],
        "numpy_dtype": "float32",
        "call_overhead": _call_overhead(samples),
        "cases": results,
    }
    overhead = report["call_overhead"]
    print(
        f"call overhead (batch 1, context 128): python {overhead['python_seconds'] * 1e6:.1f} us, "
        f"kernel {overhead['kernel_seconds'] * 1e6:.1f} us, overhead {overhead['overhead_us']:.1f} us",
        file=table,
    )
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    return 0


def _print_row(rows: list[dict], header: bool, file) -> None:
    if header:
        print(
            f"{'kind':8}{'dtype':10}{'batch':>6}{'ctx':>6}{'new':>6}{'bs':>5} {'layout':11}{'ms':>9}"
            f"{'KV GB/s':>9}{'BW GB/s':>9}{'frac':>6}{'p/c':>6}{'GFLOP/s':>9}{'%peak':>6}{'xnumpy':>8}",
            file=file,
        )
    for r in rows:
        ratio = "" if r["paged_over_contiguous"] is None else f"{r['paged_over_contiguous']:.2f}"
        peak = "" if r["fraction_of_fma_peak"] is None else f"{100 * r['fraction_of_fma_peak']:.0f}"
        print(
            f"{r['kind']:8}{r['dtype']:10}{r['batch']:>6}{r['context']:>6}{r['new_tokens']:>6}{r['block_size']:>5} "
            f"{r['layout']:11}{r['seconds_median'] * 1e3:>9.3f}{r['kv_gbps']:>9.1f}{r['bandwidth_gbps']:>9.1f}"
            f"{r['fraction_of_bandwidth']:>6.2f}{ratio:>6}{r['gflops']:>9.1f}{peak:>6}{r['speedup_vs_numpy']:>8.1f}",
            file=file,
            flush=True,
        )
