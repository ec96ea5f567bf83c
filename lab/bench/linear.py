"""Linear layers: ``pagedkv._core.Linear`` at SmolLM2-135M's shapes against the FMA peak, the read
bandwidth and numpy float32, then a whole batch-16 decode step of a SmolLM2-135M-shaped model.

Each case holds enough copies of its weight (``--weight-mib`` in all) that consecutive calls,
walking through them like the layers of a model, read the weights from memory rather than from
the 32 MiB L3. Every sample round times each weight dtype, one read-bandwidth sweep
(``ReadBandwidthProbe``) and the FMA peak (``measure_fma_peak``) on the same threads, so each
figure is compared with what the machine gave in the same seconds; numpy float32 (BLAS capped at
``--numpy-threads``, default 1 as ``LlamaModel`` had it) runs after them, on its own, because BLAS
threads spin after each call and would slow whatever ran next. Medians of the samples are reported, with the load average, since
the machine may be shared.

The model step compares ``LlamaModel`` with each weight dtype against the same model with its
matrix products done by numpy float32 on one BLAS thread (the forward before ``Linear``), on
random weights, 16 sequences decoding at context ``--context``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
from threadpoolctl import threadpool_limits

import pagedkv
import pagedkv._core as _core
from pagedkv.cli import comma_list, one_of, positive_int
from pagedkv.models import CacheStep, LlamaConfig, LlamaModel, LlamaWeights

MIB = 1 << 20
DTYPES = ("float32", "bfloat16", "float16")
# SmolLM2-135M: hidden 576, intermediate 1536, 9 query and 3 KV heads of 64, vocabulary 49152.
SMOLLM2 = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
)
# Projection -> (K, N) of y[M, N] = x[M, K] · W.
SHAPES = {
    "qkv": (576, 576 + 2 * 192),
    "o": (576, 576),
    "gate_up": (576, 2 * 1536),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON only on stdout (the table goes to stderr)")
    parser.add_argument("--quick", action="store_true", help="M = 1 and 16 only, 3 samples, a 4-layer model step")
    parser.add_argument("--samples", type=positive_int, default=None, help="timed rounds per case (default 5, quick 3)")
    parser.add_argument("--threads", type=positive_int, default=None, help="pagedkv threads (default: pagedkv's)")
    parser.add_argument("--weight-mib", type=positive_int, default=96, help="weight copies held per case (MiB of float32)")
    parser.add_argument(
        "--projections", type=comma_list(one_of(list(SHAPES))), default=",".join(SHAPES), help="comma-separated shapes"
    )
    parser.add_argument("--rows", type=comma_list(positive_int), default=(1, 16, 32, 512), help="comma-separated M")
    parser.add_argument(
        "--dtypes", type=comma_list(one_of(list(DTYPES))), default=",".join(DTYPES), help="comma-separated weight dtypes"
    )
    parser.add_argument("--probe-mib", type=positive_int, default=256, help="read-bandwidth probe buffer (MiB; > L3)")
    parser.add_argument("--numpy-threads", type=positive_int, default=1, help="BLAS threads of the numpy baseline")
    parser.add_argument("--context", type=positive_int, default=64, help="tokens per sequence in the model step")
    parser.add_argument("--no-step", action="store_true", help="skip the model step")


def _seconds(run: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls


def _rotating(functions: list[Callable[[], object]]) -> Callable[[], float]:
    """Seconds per call of one pass over ``functions`` (one call each)."""

    def timed() -> float:
        start = time.perf_counter()
        for function in functions:
            function()
        return (time.perf_counter() - start) / len(functions)

    return timed


def _linear_cases(args, samples: int, probe, numpy_threads: int, table) -> list[dict]:
    rng = np.random.default_rng(0)
    results = []
    for name in args.projections:
        k, n = SHAPES[name]
        copies = max(1, -(-args.weight_mib * MIB // (4 * k * n)))
        weights = [rng.standard_normal((k, n), dtype=np.float32) * np.float32(k**-0.5) for _ in range(copies)]
        linears = {dtype: [_core.Linear(w, dtype) for w in weights] for dtype in args.dtypes}
        for m in args.rows:
            x = rng.standard_normal((m, k), dtype=np.float32)
            flops = 2.0 * m * k * n
            runners = {dtype: _rotating([lambda lin=lin, x=x: lin(x) for lin in lins]) for dtype, lins in linears.items()}
            for run in runners.values():  # warm-up: page in, build the pool
                run()
            times: dict[str, list[float]] = {dtype: [] for dtype in runners}
            bandwidth, peak = [], []
            names = list(runners)
            for sample in range(samples):
                for dtype in names[sample % len(names) :] + names[: sample % len(names)]:
                    times[dtype].append(runners[dtype]())
                bandwidth.append(probe.sweep())
                peak.append(_core.measure_fma_peak())
            with threadpool_limits(limits=numpy_threads, user_api="blas"):
                numpy_run = _rotating([lambda w=w, x=x: x @ w for w in weights])
                numpy_run()
                numpy_s = statistics.median(numpy_run() for _ in range(samples))
            bw, fma = statistics.median(bandwidth), statistics.median(peak)
            rows = []
            for dtype, lins in linears.items():
                seconds = statistics.median(times[dtype])
                weight_gbps = lins[0].nbytes / seconds / 1e9
                rows.append(
                    {
                        "projection": name,
                        "k": k,
                        "n": n,
                        "m": m,
                        "dtype": dtype,
                        "seconds_median": seconds,
                        "samples": samples,
                        "gflops": flops / seconds / 1e9,
                        "fma_peak_gflops": fma,
                        "fraction_of_fma_peak": flops / seconds / 1e9 / fma,
                        "weight_gbps": weight_gbps,
                        "bandwidth_gbps": bw,
                        "fraction_of_bandwidth": weight_gbps / bw,
                        "numpy_seconds_median": numpy_s,
                        "numpy_gflops": flops / numpy_s / 1e9,
                        "speedup_vs_numpy": numpy_s / seconds,
                        "weight_copies": copies,
                    }
                )
            _print_rows(rows, header=not results, file=table)
            results.extend(rows)
        del weights, linears
    return results


def _print_rows(rows: list[dict], header: bool, file) -> None:
    if header:
        print(
            f"{'proj':8}{'K':>5}{'N':>6}{'M':>5} {'dtype':9}{'ms':>9}{'GFLOP/s':>9}{'peak':>7}{'%peak':>6}"
            f"{'W GB/s':>8}{'BW':>6}{'%BW':>5}{'np GF/s':>8}{'xnp':>6}",
            file=file,
        )
    for r in rows:
        print(
            f"{r['projection']:8}{r['k']:>5}{r['n']:>6}{r['m']:>5} {r['dtype']:9}{r['seconds_median'] * 1e3:>9.3f}"
            f"{r['gflops']:>9.1f}{r['fma_peak_gflops']:>7.1f}{100 * r['fraction_of_fma_peak']:>6.0f}"
            f"{r['weight_gbps']:>8.1f}{r['bandwidth_gbps']:>6.1f}{100 * r['fraction_of_bandwidth']:>5.0f}"
            f"{r['numpy_gflops']:>8.1f}{r['speedup_vs_numpy']:>6.2f}",
            file=file,
            flush=True,
        )


class _NumpyProjection:
    """``x @ W`` in numpy float32 on a C-ordered ``[in, out]`` copy: the forward before Linear."""

    def __init__(self, linear_weight_t: np.ndarray) -> None:
        self.weight = np.ascontiguousarray(linear_weight_t)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return x @ self.weight


def _numpy_model(weights: LlamaWeights) -> LlamaModel:
    """A LlamaModel whose projections are numpy matrix products (reaching into its fused layers:
    a benchmark baseline only)."""
    model = LlamaModel(weights)
    model._lm_head = _NumpyProjection(weights.lm_head.T)  # type: ignore[assignment]
    model._layers = [
        fused._replace(
            qkv=_NumpyProjection(np.concatenate((layer.q_proj, layer.k_proj, layer.v_proj)).T),
            o=_NumpyProjection(layer.o_proj.T),
            gate_up=_NumpyProjection(np.concatenate((layer.gate_proj, layer.up_proj)).T),
            down=_NumpyProjection(layer.down_proj.T),
        )
        for fused, layer in zip(model._layers, weights.layers, strict=True)
    ]
    return model


def _decode_step(config: LlamaConfig, batch: int, context: int, block_size: int = 16) -> SimpleNamespace:
    """One decode token per sequence at position ``context - 1``; sequence i owns its own blocks."""
    blocks = -(-context // block_size)
    tables = np.arange(batch * blocks, dtype=np.int32).reshape(batch, blocks)
    position = context - 1
    slots = tables[:, position // block_size].astype(np.int64) * block_size + position % block_size
    return SimpleNamespace(
        input_ids=np.arange(3, 3 + batch, dtype=np.int64) % config.vocab_size,
        positions=np.full(batch, position, dtype=np.int64),
        slot_mapping=slots,
        query_start_loc=np.arange(batch + 1, dtype=np.int32),
        context_lens=np.full(batch, context, dtype=np.int32),
        block_tables=tables,
        copy_ops=[],
        logits_indices=np.arange(batch, dtype=np.int64),
    )


def _model_step(args, samples: int, table) -> dict:
    config = SMOLLM2.replace(num_layers=4) if args.quick else SMOLLM2
    weights = LlamaWeights.random(config, seed=0)
    variants: dict[str, LlamaModel] = {"numpy float32 (before)": _numpy_model(weights)}
    for dtype in args.dtypes:
        variants[f"Linear {dtype}"] = LlamaModel(weights, weight_dtype=dtype)
    results = {}
    for batch in (1, 16):
        step = _decode_step(config, batch, args.context)
        caches = {}
        for name, model in variants.items():
            caches[name] = model.new_kv_cache(batch * -(-args.context // 16))
            caches[name].fill_random(1)
            model.forward(CacheStep(step, caches[name]))  # warm-up
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for sample in range(samples):
            for name in names[sample % len(names) :] + names[: sample % len(names)]:
                model, cache = variants[name], caches[name]
                times[name].append(_seconds(lambda model=model, cache=cache, step=step: model.forward(CacheStep(step, cache)), 3))
        before = statistics.median(times[names[0]])
        for name in names:
            seconds = statistics.median(times[name])
            results[f"batch {batch}: {name}"] = {
                "batch": batch,
                "variant": name,
                "seconds_median": seconds,
                "tokens_per_second": batch / seconds,
                "speedup_vs_before": before / seconds,
            }
            print(
                f"decode step batch {batch:>2} ctx {args.context} {name:24}{seconds * 1e3:>9.2f} ms"
                f"{batch / seconds:>9.1f} tok/s{before / seconds:>7.2f}x",
                file=table,
                flush=True,
            )
    return {"layers": config.num_layers, "context": args.context, "variants": results}


def run(args) -> int:
    if args.threads is not None:
        pagedkv.set_num_threads(args.threads)
    if args.quick:
        args.rows = tuple(m for m in args.rows if m <= 16) or args.rows
    samples = args.samples or (3 if args.quick else 5)
    table = sys.stderr if args.json else sys.stdout
    threads = pagedkv.get_num_threads()
    probe = pagedkv.ReadBandwidthProbe(args.probe_mib * MIB)
    load_before = os.getloadavg()
    print(f"threads {threads}, kernel {_core.available_linear_kernels()[0]}, load average {load_before[0]:.2f}", file=table)
    report = {
        "threads": threads,
        "kernel": _core.available_linear_kernels()[0],
        "numpy_dtype": "float32",
        "numpy_blas_threads": args.numpy_threads,
        "load_average_before": load_before,
        "cases": _linear_cases(args, samples, probe, args.numpy_threads, table),
    }
    if not args.no_step:
        report["model_step"] = _model_step(args, samples, table)
    report["load_average_after"] = os.getloadavg()
    print(f"load average after {report['load_average_after'][0]:.2f}", file=table)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    return 0
