"""Request traces for benchmarks and the demo: the shipped Azure LLM inference traces (see
``pagedkv/data/README.md`` for their attribution) as arrival offsets and token lengths."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

__all__ = ["TraceRequest", "load_trace", "CONV_TRACE", "CODE_TRACE", "SHIPPED_TRACES"]

CONV_TRACE = "azure_llm_inference_conv_2023.csv"
CODE_TRACE = "azure_llm_inference_code_2023.csv"
SHIPPED_TRACES = {"conv": CONV_TRACE, "code": CODE_TRACE}


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float  # seconds since the first request
    prompt_tokens: int
    output_tokens: int


def load_trace(path: str | Path | None = None, limit: int | None = None) -> list[TraceRequest]:
    """Reads a ``TIMESTAMP,ContextTokens,GeneratedTokens`` CSV: a file, or the name of a shipped
    trace (``"conv"``, the default, or ``"code"``); returns at most ``limit`` requests in arrival order."""
    name = "conv" if path is None else str(path)
    source = resources.files("pagedkv") / "data" / SHIPPED_TRACES[name] if name in SHIPPED_TRACES else Path(path)
    requests: list[TraceRequest] = []
    start: datetime | None = None
    with source.open(newline="") as handle:
        for row in csv.DictReader(handle):
            # Timestamps carry 7 fractional digits; datetime takes at most 6.
            stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
            start = start or stamp
            requests.append(
                TraceRequest(
                    arrival_s=(stamp - start).total_seconds(),
                    prompt_tokens=max(1, int(row["ContextTokens"])),
                    output_tokens=max(1, int(row["GeneratedTokens"])),
                )
            )
            if limit is not None and len(requests) >= limit:
                break
    return requests
