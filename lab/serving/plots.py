"""PNG plots of a serving benchmark (matplotlib, Agg backend): KV memory over time, latency CDFs,
the rate sweep, and a one-glance summary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402

from lab.serving.replay import ReplayResult  # noqa: E402
from lab.serving.report import PolicySummary  # noqa: E402

__all__ = ["write_all"]

_COLORS = {
    "static-reservation": "#d62728",
    "continuous-reservation": "#ff7f0e",
    "paged": "#1f77b4",
    "paged-prefix-cache": "#2ca02c",
}


def _label(summary_or_name: PolicySummary | str, workload: str | None = None) -> str:
    if isinstance(summary_or_name, PolicySummary):
        name, workload = summary_or_name.name, summary_or_name.workload
    else:
        name = summary_or_name
    return f"{name} ({workload})" if workload == "shared-prefix" else name


def kv_usage_over_time(results: Sequence[ReplayResult], summaries: Sequence[PolicySummary], caption: str, path: Path) -> Path:
    """One panel per policy: KV slots reserved and KV slots holding live tokens, over time."""
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.3 * len(results) + 1), sharex=True, sharey=True)
    for ax, result, summary in zip(np.atleast_1d(axes), results, summaries, strict=True):
        t = np.array([s.start_s for s in result.steps] + [result.steps[-1].start_s + result.steps[-1].duration_s])
        reserved = np.array([s.reserved_slots for s in result.steps] + [0]) / result.kv_capacity_slots
        live = np.array([s.live_tokens for s in result.steps] + [0]) / result.kv_capacity_slots
        color = _COLORS.get(result.policy, "gray")
        ax.fill_between(t, reserved, step="post", color=color, alpha=0.25, linewidth=0, label="reserved for running requests")
        ax.step(t, live, where="post", color=color, linewidth=0.8, label="holding live K/V tokens")
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("fraction of\nKV memory")
        ax.set_title(
            f"{_label(summary)}: {summary.kv_utilization:.1%} of reserved slots hold live tokens (time average), "
            f"peak {summary.peak_running} sequences",
            fontsize=10,
        )
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[-1].set_xlabel("time since the first arrival (simulated seconds)")
    fig.suptitle(f"KV cache memory over time, same memory for every policy\n{caption}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_cdfs(results: Sequence[ReplayResult], summaries: Sequence[PolicySummary], caption: str, path: Path) -> Path:
    """Empirical CDFs of time to first token and end-to-end latency, one line per policy."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for metric, ax, title in (
        ("ttft", axes[0], "Time to first token"),
        ("e2e_latency", axes[1], "End-to-end latency (arrival to last token)"),
    ):
        for result, summary in zip(results, summaries, strict=True):
            values = np.sort([getattr(r.metrics, metric) for r in result.requests])
            values = np.maximum(values, 1e-3)  # log axis
            ax.step(
                values,
                np.arange(1, len(values) + 1) / len(values),
                where="post",
                color=_COLORS.get(result.policy, "gray"),
                label=_label(summary),
            )
        ax.set_xscale("log")
        ax.set_xlabel("seconds (simulated, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"Latency distributions (further left is better)\n{caption}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rate_sweep(points: Sequence[Mapping[str, object]], caption: str, path: Path) -> Path:
    """Throughput and p99 latency against the offered Poisson rate, one line per policy."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    policies = list(dict.fromkeys(str(p["policy"]) for p in points))
    for policy in policies:
        mine = sorted((p for p in points if p["policy"] == policy), key=lambda p: float(p["rate_requests_per_s"]))
        rates = [float(p["rate_requests_per_s"]) for p in mine]
        label = _label(policy, str(mine[0]["workload"]))
        color = _COLORS.get(policy, "gray")
        axes[0].plot(rates, [float(p["throughput_requests_per_s"]) for p in mine], "o-", color=color, label=label)
        axes[1].plot(rates, [float(p["e2e_p99_s"]) for p in mine], "o-", color=color, label=label)
    top = max(float(p["rate_requests_per_s"]) for p in points)
    axes[0].plot([0, top], [0, top], ":", color="gray", label="served = offered")
    axes[0].set_ylabel("completed requests / s")
    axes[0].set_title("Throughput: flattens where a policy saturates")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("p99 end-to-end latency (s, log scale)")
    axes[1].set_title("Tail latency: explodes past saturation")
    for ax in axes:
        ax.set_xlabel("offered load (Poisson requests / s)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"Request-rate sweep\n{caption}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(summaries: Sequence[PolicySummary], caption: str, path: Path) -> Path:
    """Bars: share of reserved KV memory holding live tokens, throughput, peak batch size."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
    labels = [_label(s).replace("-", "\n", 1).replace(" (", "\n(") for s in summaries]
    colors = [_COLORS.get(s.name, "gray") for s in summaries]
    panels = (
        ("kv_utilization", "Reserved KV slots holding live tokens", "fraction (time average)", "{:.0%}"),
        ("throughput_tokens_per_s", "Throughput at saturation", "generated tokens / s", "{:.0f}"),
        ("peak_running", "Largest running batch", "concurrent sequences", "{}"),
    )
    for ax, (key, title, ylabel, fmt) in zip(axes, panels, strict=True):
        values = [getattr(s, key) for s in summaries]
        bars = ax.bar(range(len(values)), values, color=colors)
        for bar, value in zip(bars, values, strict=True):
            ax.annotate(
                fmt.format(value), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=9
            )
        ax.set_xticks(range(len(values)), labels, fontsize=7.5)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"What paging buys at the same KV memory\n{caption}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(
    directory: Path,
    results: Sequence[ReplayResult],
    summaries: Sequence[PolicySummary],
    sweep: Sequence[Mapping[str, object]],
    caption: str,
    sweep_caption: str,
) -> list[Path]:
    """Writes every plot into ``directory`` (created if needed); returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = [
        summary(summaries, caption, directory / "serve_summary.png"),
        kv_usage_over_time(results, summaries, caption, directory / "serve_kv_usage.png"),
        latency_cdfs(results, summaries, caption, directory / "serve_latency_cdf.png"),
    ]
    if sweep:
        paths.append(rate_sweep(sweep, sweep_caption, directory / "serve_sweep.png"))
    return paths
