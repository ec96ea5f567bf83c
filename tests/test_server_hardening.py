"""The server's liveness and connections under hostile or unlucky clients (issue 23): /health
tells the truth once the engine has closed, /metrics' load gauges are live, idle connections are
timed out and capped, and a body still arriving at SIGTERM is a 503.

In process (FastAPI's TestClient) where the app alone is under test; a `pagedkv serve` subprocess
on 127.0.0.1 where uvicorn's connection handling is.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from pagedkv.engine import Engine, EngineClosedError
from pagedkv.model.sampling import SamplingParams
from pagedkv.server import build_app

MODEL = "tiny-served"


def gauge(text: str, name: str) -> float:
    """The value of an unlabelled-but-for-model gauge in a Prometheus exposition."""
    (line,) = [line for line in text.splitlines() if line.startswith(f"{name}{{")]
    return float(line.split()[-1])


def test_health_is_a_503_once_the_model_failed_or_the_engine_shut_down():
    """Item 9: it answered 200 "ok" while every request got a 503."""
    engine = Engine.from_pretrained("tiny", num_blocks=16)

    def broken(*args, **kwargs):
        raise RuntimeError("the model broke")

    with TestClient(build_app(engine, MODEL)) as http:
        assert http.get("/health").status_code == 200
        engine.core.runner.model.forward = broken
        with pytest.raises(EngineClosedError):
            engine.submit("hi", SamplingParams(max_tokens=2)).result()
        response = http.get("/health")
        assert response.status_code == 503 and response.json()["status"] == "closed"
    engine.shutdown()
    stopped = Engine.from_pretrained("tiny", num_blocks=16)
    stopped.shutdown()
    with TestClient(build_app(stopped, MODEL)) as http:
        assert http.get("/health").status_code == 503


def test_the_load_gauges_are_live_after_an_abort_while_idle():
    """Item 13: after requests were aborted (clients gone), /metrics kept the last step's values
    forever, /health saying 0."""
    engine = Engine.from_pretrained("tiny", num_blocks=64)
    with TestClient(build_app(engine, MODEL)) as http:
        handles = [engine.submit(f"long {i}", SamplingParams(max_tokens=500, ignore_eos=True)) for i in range(3)]
        for handle in handles:
            next(iter(handle))  # each has a token: a step has counted it running
        for handle in handles:
            handle.abort()
        for handle in handles:
            handle.result()  # ended (aborted); no step has run since
        text = http.get("/metrics").text
        assert gauge(text, "pagedkv:num_requests_running") == 0
        assert gauge(text, "pagedkv:num_requests_waiting") == 0
        assert http.get("/health").json()["num_running"] == 0
    engine.shutdown()
