"""What an engine tells its operator: Prometheus metrics (:mod:`~pagedkv.observability.metrics`,
served by :mod:`~pagedkv.observability.metrics_http`) and OpenTelemetry request traces
(:mod:`~pagedkv.observability.tracing`, the optional ``tracing`` extra: import it by name).
"""

from __future__ import annotations

from pagedkv.observability.metrics import EngineMetrics

__all__ = ["EngineMetrics"]
