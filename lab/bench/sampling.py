"""The sampler (``pagedkv.sampling.sample``, the Rust kernel) against the numpy sampler it
replaced, on the same random logits, one case per line: greedy, temperature, top-p, top-k, min-p,
all filters together, and penalties over a 256-token history per row. Both run in the same process,
interleaved; the median of ``--repeats`` calls is reported, with the machine's load average
(the figures mean little on a loaded machine).

The baseline is the numpy code of main before issue 11 (a full stable argsort and cumulative sum
per row for any top-k/top-p), extended here only as far as the cases need: min-p as a mask after
its softmax, penalties as numpy fancy indexing. It lives in this module alone: the library no
longer has it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from pagedkv.cli import positive_int
from pagedkv.sampling import SamplingParams, TokenHistory, sample

CASES: dict[str, dict] = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "top_k 50": dict(temperature=0.8, top_k=50),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "top_k 50 + top_p 0.95 + min_p 0.05": dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05),
    "penalties + top_p 0.95": dict(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3,
                                   repetition_penalty=1.1),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=positive_int, default=16)
    parser.add_argument("--vocab", type=positive_int, default=49_152)
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 repeats, no baseline for the slow cases")
    parser.add_argument("--json", action="store_true", help="print JSON only")


def baseline(logits: np.ndarray, params: list[SamplingParams], generators, histories) -> np.ndarray:
    """main's numpy sampler (finite rows only), plus min-p and penalties."""
    logits = np.array(logits, dtype=np.float64)
    for r, (p, h) in enumerate(zip(params, histories, strict=True)):
        if h is not None and p.penalized:
            x = logits[r, h.tokens]
            x = np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
            logits[r, h.tokens] = x - p.frequency_penalty * h.counts - p.presence_penalty * (h.counts > 0)
    rows, vocab = logits.shape
    tokens = np.empty(rows, dtype=np.int64)
    temperature = np.array([p.temperature for p in params])
    greedy = temperature == 0
    tokens[greedy] = np.argmax(logits[greedy], axis=1)
    top_k = np.array([p.top_k for p in params])
    top_p = np.array([p.top_p for p in params])
    min_p = np.array([p.min_p for p in params])
    truncated = ~greedy & ((top_k > 0) & (top_k < vocab) | (top_p < 1.0) | (min_p > 0))
    plain = ~greedy & ~truncated
    if plain.any():
        probs = _softmax(logits[plain] / temperature[plain, None])
        tokens[plain] = _draw(probs, [generators[i] for i in np.flatnonzero(plain)])
    if truncated.any():
        scaled = logits[truncated] / temperature[truncated, None]
        order = np.argsort(-scaled, axis=1, kind="stable")
        ranked = np.take_along_axis(scaled, order, axis=1)
        k = np.where(top_k[truncated] > 0, top_k[truncated], vocab)
        ranked[np.arange(vocab)[None, :] >= k[:, None]] = -np.inf
        probs = _softmax(ranked)
        probs[probs < min_p[truncated, None] * probs[:, :1]] = 0.0
        probs /= probs.sum(axis=1, keepdims=True)
        mass_before = np.cumsum(probs, axis=1) - probs
        probs[mass_before >= top_p[truncated, None]] = 0.0
        picked = _draw(probs, [generators[i] for i in np.flatnonzero(truncated)])
        tokens[truncated] = order[np.arange(len(picked)), picked]
    return tokens


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _draw(probs: np.ndarray, generators) -> np.ndarray:
    cdf = np.cumsum(probs, axis=1)
    u = np.array([g.random() for g in generators]) * cdf[:, -1]
    return np.minimum((cdf <= u[:, None]).sum(axis=1), np.argmax(cdf >= cdf[:, -1:], axis=1))


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> int:
    repeats = 3 if args.quick else args.repeats
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((args.rows, args.vocab)) * 3).astype(np.float32)
    generators = [np.random.default_rng(i) for i in range(args.rows)]
    results = []
    for name, kwargs in CASES.items():
        p = SamplingParams(**kwargs)
        params = [p] * args.rows
        histories: list[TokenHistory | None] = [None] * args.rows
        if p.penalized:
            histories = []
            for _ in range(args.rows):
                history = TokenHistory(rng.integers(0, args.vocab, 192).tolist())
                for token in rng.integers(0, args.vocab, 64).tolist():
                    history.append(token)
                histories.append(history)
        sample(logits, params, generators, histories)  # warm the pool
        kernel = _median_ms(lambda params=params, histories=histories: sample(logits, params, generators, histories), repeats)
        slow = args.quick and p.temperature > 0
        numpy_ms = (
            None
            if slow
            else _median_ms(lambda params=params, histories=histories: baseline(logits, params, generators, histories), repeats)
        )
        results.append(
            dict(
                case=name,
                kernel_ms=round(kernel, 3),
                numpy_ms=None if numpy_ms is None else round(numpy_ms, 3),
                speedup=None if numpy_ms is None else round(numpy_ms / kernel, 1),
            )
        )
    report = dict(rows=args.rows, vocab=args.vocab, repeats=repeats, load_average=os.getloadavg(), cases=results)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"sampling {args.rows} × {args.vocab} logits, median of {repeats}; load average {report['load_average']}")
    for r in results:
        base = "—" if r["numpy_ms"] is None else f"{r['numpy_ms']:9.2f} ms"
        print(f"  {r['case']:38s} kernel {r['kernel_ms']:8.3f} ms   numpy {base}   ×{r['speedup'] or '—'}")
    return 0
