"""Request traces for benchmarks and the demo: the shipped Azure LLM inference traces (see
``pagedkv/data/README.md`` for their attribution) as arrival offsets and token lengths."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

from pagedkv.errors import InvalidArgumentError

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
    trace (``"conv"``, the default, or ``"code"``); returns at most ``limit`` requests (None: all)
    in arrival order. A malformed file raises :class:`InvalidArgumentError` naming it and the row."""
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise InvalidArgumentError(f"limit must be None or an integer ≥ 0, got {limit!r}")
    name = "conv" if path is None else str(path)
    source = resources.files("pagedkv") / "data" / SHIPPED_TRACES[name] if name in SHIPPED_TRACES else Path(name)
    requests: list[TraceRequest] = []
    start: datetime | None = None
    try:
        with source.open(newline="") as handle:
            for row_number, row in enumerate(csv.DictReader(handle), start=2):
                if limit is not None and len(requests) >= limit:
                    break
                try:
                    # Timestamps carry 7 fractional digits; datetime takes at most 6.
                    stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
                    prompt_tokens, output_tokens = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                    start = start or stamp
                    arrival_s = (stamp - start).total_seconds()  # TypeError: naive and aware stamps mixed
                except (KeyError, TypeError, ValueError) as error:
                    raise InvalidArgumentError(
                        f"{name}: row {row_number}: expected TIMESTAMP,ContextTokens,GeneratedTokens ({error})"
                    ) from None
                if requests and arrival_s < requests[-1].arrival_s:
                    raise InvalidArgumentError(f"{name}: row {row_number}: timestamp earlier than the row before")
                requests.append(TraceRequest(arrival_s, prompt_tokens=max(1, prompt_tokens), output_tokens=max(1, output_tokens)))
    except UnicodeDecodeError as error:
        raise InvalidArgumentError(f"{name}: not a text CSV ({error})") from None
    return requests
