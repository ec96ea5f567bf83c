"""Summaries of a replay: throughput, latency percentiles, KV utilization, and a text table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from lab.serving.replay import ReplayResult

__all__ = ["PolicySummary", "format_table", "summarize"]


@dataclass(frozen=True)
class PolicySummary:
    """The figures of one policy on one workload (seconds on the replay clock)."""

    name: str
    workload: str
    requests: int
    duration_s: float  # first arrival to last finish
    throughput_requests_per_s: float
    throughput_tokens_per_s: float  # generated tokens
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    kv_utilization: float  # live tokens / reserved slots, time-averaged over busy steps
    kv_reserved_fraction: float  # reserved slots / KV capacity, time-averaged over busy steps
    peak_running: int
    prefill_tokens: int
    prompt_tokens: int
    generated_tokens: int
    prefix_hit_rate: float
    preemptions: int
    steps: int

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(result: ReplayResult, workload: str) -> PolicySummary:
    """Figures of a finished replay."""
    metrics = [r.metrics for r in result.requests]
    ttft = [m.ttft for m in metrics if m.ttft is not None]
    tpot = [m.tpot for m in metrics if m.tpot is not None]
    e2e = [m.e2e_latency for m in metrics if m.e2e_latency is not None]
    first_arrival = min(m.arrival_time for m in metrics)
    last_finish = max(m.finished_time for m in metrics if m.finished_time is not None)
    duration = last_finish - first_arrival
    generated = sum(m.num_output_tokens for m in metrics)
    busy = [s for s in result.steps if s.reserved_slots > 0]
    busy_time = sum(s.duration_s for s in busy)
    utilization = sum(s.live_tokens / s.reserved_slots * s.duration_s for s in busy) / busy_time if busy_time else 0.0
    reserved = sum(s.reserved_slots / result.kv_capacity_slots * s.duration_s for s in busy) / busy_time if busy_time else 0.0
    totals = result.totals
    return PolicySummary(
        name=result.policy,
        workload=workload,
        requests=len(metrics),
        duration_s=duration,
        throughput_requests_per_s=len(metrics) / duration,
        throughput_tokens_per_s=generated / duration,
        ttft_p50_s=_percentile(ttft, 50),
        ttft_p99_s=_percentile(ttft, 99),
        tpot_p50_s=_percentile(tpot, 50),
        tpot_p99_s=_percentile(tpot, 99),
        e2e_p50_s=_percentile(e2e, 50),
        e2e_p99_s=_percentile(e2e, 99),
        kv_utilization=utilization,
        kv_reserved_fraction=reserved,
        peak_running=max((s.num_running for s in result.steps), default=0),
        prefill_tokens=totals.prefill_tokens,
        prompt_tokens=sum(r.prompt_len for r in result.requests),
        generated_tokens=generated,
        prefix_hit_rate=totals.prefix_hit_tokens / totals.prefix_queried_tokens if totals.prefix_queried_tokens else 0.0,
        preemptions=totals.preemptions,
        steps=len(result.steps),
    )


_COLUMNS = (
    ("policy", "name", "{}"),
    ("workload", "workload", "{}"),
    ("req/s", "throughput_requests_per_s", "{:.2f}"),
    ("out tok/s", "throughput_tokens_per_s", "{:.0f}"),
    ("TTFT p50", "ttft_p50_s", "{:.2f}s"),
    ("TTFT p99", "ttft_p99_s", "{:.2f}s"),
    ("TPOT p50", "tpot_p50_s", "{:.1e}s"),
    ("TPOT p99", "tpot_p99_s", "{:.1e}s"),
    ("e2e p50", "e2e_p50_s", "{:.1f}s"),
    ("e2e p99", "e2e_p99_s", "{:.1f}s"),
    ("KV util", "kv_utilization", "{:.3f}"),
    ("peak run", "peak_running", "{}"),
    ("prefix hit", "prefix_hit_rate", "{:.3f}"),
    ("preempt", "preemptions", "{}"),
    ("prefill tok", "prefill_tokens", "{}"),
)


def format_table(summaries: Sequence[PolicySummary]) -> str:
    """A plain-text table, one row per summary."""
    rows = [[header for header, _, _ in _COLUMNS]]
    for s in summaries:
        rows.append([fmt.format(getattr(s, key)) for _, key, fmt in _COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
