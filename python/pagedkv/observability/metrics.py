"""Prometheus metrics of an engine, named after the field's conventions with a ``pagedkv:`` prefix
(vLLM exports the same quantities as ``vllm:...``).

Each :class:`EngineMetrics` owns its own registry, so several engines in one process (tests,
benchmarks) never collide; :meth:`EngineMetrics.serve` exposes it at ``/metrics`` over HTTP
(:class:`~pagedkv.observability.metrics_http.MetricsServer`: bounded threads, idle connections timed out) until
:meth:`EngineMetrics.close`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pagedkv.errors import PagedKVError
from pagedkv.observability.metrics_http import MetricsServer

__all__ = ["GRAMMAR_COUNTERS", "EngineMetrics"]

# Latency buckets (seconds) spanning a tiny CPU model's milliseconds to a loaded server's minutes.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EngineMetrics:
    """Gauges, counters and histograms of one engine."""

    def __init__(self, model_name: str = "pagedkv") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"pagedkv:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedkv:{name}", doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"pagedkv:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be admitted.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefill).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Requests finished (any reason but an error).")
        self.time_to_first_token_seconds = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", _LATENCY_BUCKETS
        )
        self.time_per_output_token_seconds = histogram(
            "time_per_output_token_seconds", "Mean time between generated tokens of a request.", _TOKEN_LATENCY_BUCKETS
        )
        self.e2e_request_latency_seconds = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", _LATENCY_BUCKETS
        )
        # The disk tier's figures (``Scheduler.stats()``'s ``disk_*`` keys), counted only when the
        # engine has a tier (the keys are absent otherwise).
        self.kv_disk_blocks = gauge("kv_disk_blocks", "KV blocks held by the disk tier.")
        self._disk_counters = {
            key: counter(f"kv_{key}", doc)
            for key, doc in (
                ("disk_hits", "Prompt blocks found only on the disk tier by admission (loaded, or dropped if corrupt)."),
                ("disk_loads", "KV blocks loaded from the disk tier and verified."),
                ("disk_offloads", "KV blocks written to the disk tier on eviction from RAM."),
                ("disk_evictions", "KV blocks evicted from the disk tier to make room."),
                ("disk_bytes_written", "Bytes of K/V written to the disk tier."),
                ("disk_bytes_read", "Bytes of K/V read from the disk tier."),
                ("disk_dropped_corrupt", "Disk-tier blocks whose bytes, tokens or parent did not verify: dropped, recomputed."),
                ("disk_load_misses", "Disk-tier loads that found no block or whose job failed: recomputed."),
            )
        }
        self._last_totals: dict[str, int] = {}
        self._servers: list[MetricsServer] = []

    def follow(self, stats: Callable[[], Mapping[str, float]]) -> None:
        """Makes the load gauges (running, waiting, KV usage) read ``stats()`` (``EngineCore.stats()``'s
        keys) at each scrape: current whatever changed since the last step (requests aborted while
        the engine idles), never the last step's values; NaN once it cannot answer (a failed core).
        The grammar counters (:data:`GRAMMAR_COUNTERS`) are read from it at each scrape too: a
        constraint refused while the engine idles is counted at once."""

        for gauge, key in ((self.num_requests_running, "num_running"), (self.num_requests_waiting, "num_waiting"),
                           (self.kv_cache_usage_perc, "kv_usage")):
            gauge.set_function(_reading(stats, key))
        self.registry.register(_GrammarCounters(stats, self.model_name))

    def follow_groups(self, attention: Sequence[str], usage: Callable[[], Sequence[float]]) -> None:
        """Makes ``pagedkv:kv_cache_group_usage_perc{group, attention}`` read ``usage()`` (the
        fraction of the pool each KV cache group holds, in group order) at each scrape: one series
        per group, ``attention`` naming what it keeps ("full", "sliding:512"); NaN once the core
        cannot answer."""
        gauge = Gauge("pagedkv:kv_cache_group_usage_perc", "Fraction of KV blocks each KV cache group holds (0 to 1).",
                      ["model_name", "group", "attention"], registry=self.registry)

        for index, kind in enumerate(attention):
            gauge.labels(self.model_name, str(index), kind).set_function(_reading(usage, index))

    def record_scheduler(self, stats: Mapping[str, float]) -> None:
        """Updates the counters (and the disk tier's gauge) from ``Scheduler.stats()`` (cumulative
        totals); the load gauges are :meth:`follow`'s."""
        for key, counter in (
            ("prefix_queried_tokens", self.prefix_cache_queries),
            ("prefix_hit_tokens", self.prefix_cache_hits),
            ("preemptions", self.num_preemptions),
            ("prefill_tokens", self.prompt_tokens),
            ("generated_tokens", self.generation_tokens),
            *(self._disk_counters.items() if "disk_blocks" in stats else ()),
        ):
            total = int(stats[key])
            counter.inc(total - self._last_totals.get(key, 0))
            self._last_totals[key] = total
        if "disk_blocks" in stats:
            self.kv_disk_blocks.set(stats["disk_blocks"])

    def record_finished(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float) -> None:
        """Records one finished request's latencies (TTFT/TPOT are None when it produced no token,
        or, for TPOT, only one)."""
        self.request_success.inc()
        if ttft_s is not None:
            self.time_to_first_token_seconds.observe(ttft_s)
        if tpot_s is not None:
            self.time_per_output_token_seconds.observe(tpot_s)
        self.e2e_request_latency_seconds.observe(e2e_s)

    def serve(self, port: int, addr: str = "127.0.0.1", *, timeout: float = 5.0, max_connections: int = 8) -> int:
        """Starts a background HTTP server exposing ``/metrics``; returns the bound port (pass 0
        for any free one). A client gets ``timeout`` seconds to send its request; at most
        ``max_connections`` are served at once."""
        server = MetricsServer(self.registry, port, addr, timeout=timeout, max_connections=max_connections)
        self._servers.append(server)
        return server.port

    def close(self) -> None:
        """Stops every server :meth:`serve` started."""
        while self._servers:
            self._servers.pop().close()

    def text(self) -> str:
        """The exposition text, as ``/metrics`` serves it."""
        return generate_latest(self.registry).decode()


# Structured outputs' counters: ``EngineCore.stats()`` key → (metric name, help). Sums of seconds
# beside their counts give the mean compile and mask times (rate(sum) / rate(count)).
GRAMMAR_COUNTERS: Mapping[str, tuple[str, str]] = {
    "grammar_compiles": ("grammar_compiles", "Structured-output constraints compiled (cache misses)."),
    "grammar_compile_seconds": ("grammar_compile_seconds", "Seconds spent compiling constraints."),
    "grammar_cache_hits": ("grammar_cache_hits", "Constraints found compiled in the grammar cache."),
    "grammar_rejected": ("grammar_rejected", "Constraints refused: they do not compile or match nothing (a 400)."),
    "grammar_mask_steps": ("grammar_mask_steps", "Steps that computed grammar masks."),
    "grammar_mask_rows": ("grammar_mask_rows", "Grammar masks computed (one per constrained row per step)."),
    "grammar_mask_seconds": ("grammar_mask_seconds", "Seconds spent computing grammar masks, summed over rows (CPU time)."),
    "grammar_mask_wait_seconds": ("grammar_mask_wait_seconds",
                                  "Seconds steps waited for grammar masks after the forward pass (the part not hidden)."),
}


class _GrammarCounters(Collector):
    """The grammar counters, read from the engine's stats at each scrape (their one owner)."""

    def __init__(self, stats: Callable[[], Mapping[str, float]], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(f"pagedkv:{name}", doc, labels=["model_name"]) for name, doc in GRAMMAR_COUNTERS.values()]

    def collect(self) -> Iterator[CounterMetricFamily]:
        try:
            stats = self._stats()
        except PagedKVError:
            return  # a failed core: nothing to read
        for key, (name, doc) in GRAMMAR_COUNTERS.items():
            family = CounterMetricFamily(f"pagedkv:{name}", doc, labels=["model_name"])
            family.add_metric([self._model_name], float(stats.get(key, 0.0)))
            yield family


def _reading(source: Callable[[], Mapping[str, float]] | Callable[[], Sequence[float]], key: str | int) -> Callable[[], float]:
    """A gauge's reading of ``source()[key]`` at scrape time, NaN once the core cannot answer (a
    failed core raises a :class:`PagedKVError`)."""

    def read() -> float:
        try:
            return float(source()[key])  # type: ignore[index]
        except PagedKVError:
            return math.nan

    return read
