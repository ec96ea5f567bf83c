"""The server's liveness and connections under hostile or unlucky clients (issue 23): /health
tells the truth once the engine has closed, /metrics' load gauges are live, idle connections are
timed out and capped, and a body still arriving at SIGTERM is a 503.

In process (FastAPI's TestClient) where the app alone is under test; a `pagedkv serve` subprocess
on 127.0.0.1 where uvicorn's connection handling is.
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedkv.engine import Engine, EngineClosedError
from pagedkv.sampling import SamplingParams
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


def test_a_body_past_the_limit_is_a_413_whether_its_length_is_declared_or_not():
    """Item 3: no limit before; a 20 MB prompt stalled every client ~5 s."""
    engine = Engine.from_pretrained("tiny", num_blocks=16)
    with TestClient(build_app(engine, MODEL, max_request_bytes=4096)) as http:
        body = json.dumps({"model": MODEL, "prompt": "x" * 5000, "max_tokens": 2}).encode()
        declared = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        chunked = http.post("/v1/completions", content=iter([body[:3000], body[3000:]]),
                            headers={"content-type": "application/json"})
        for response in (declared, chunked):
            assert response.status_code == 413, response.text
            assert "exceeds 4096 bytes" in response.json()["error"]["message"]
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 100, "max_tokens": 2}).status_code == 200
    engine.shutdown()


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(monkeypatch):
    """Item 3: it was tokenized (in the event loop's thread) before its length was checked."""
    engine = Engine.from_pretrained("tiny", num_blocks=16)  # 256 positions, one byte per token
    encoded: list[int] = []
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or encode(text, **kw))
    with TestClient(build_app(engine, MODEL)) as http:
        too_long = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 257, "max_tokens": 2})
        assert too_long.status_code == 400 and "cannot fit max_model_len" in too_long.json()["error"]["message"]
        assert encoded == []
    engine.shutdown()


def test_a_prompt_being_encoded_holds_no_other_client(monkeypatch):
    """Item 3: tokenizing and rendering ran in the event loop's thread, every client waiting."""
    engine = Engine.from_pretrained("tiny", num_blocks=64)
    encoding, release = threading.Event(), threading.Event()
    encode = engine.tokenizer.encode

    def held(text: str, add_special_tokens: bool = True) -> list[int]:
        if text.startswith("held"):
            encoding.set()
            release.wait(60)
        return encode(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(engine.tokenizer, "encode", held)
    results: dict[str, httpx.Response] = {}
    with TestClient(build_app(engine, MODEL)) as http:
        body = {"model": MODEL, "prompt": "held prompt", "max_tokens": 2}
        slow = threading.Thread(target=lambda: results.update(slow=http.post("/v1/completions", json=body)))
        slow.start()
        assert encoding.wait(60)
        others = threading.Thread(target=lambda: results.update(
            health=http.get("/health"),
            other=http.post("/v1/completions", json={**body, "prompt": "another prompt"})))
        others.start()
        others.join(60)  # a hang guard: they are answered while the first prompt is still held
        answered_while_held = "health" in results and "other" in results
        release.set()
        slow.join(60)
        others.join(60)
    engine.shutdown()
    assert answered_while_held
    assert results["health"].status_code == results["other"].status_code == results["slow"].status_code == 200


@pytest.mark.parametrize("template, match", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "longer than"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
])
def test_a_template_that_loops_or_fails_is_a_400(template, match):
    """Items 4 and 11: a looping template froze every endpoint; a runtime error was a plain-text 500."""
    engine = Engine.from_pretrained("tiny", num_blocks=16)
    engine.tokenizer.chat_template = template
    with TestClient(build_app(engine, MODEL)) as http:
        response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 400 and re.search(match, response.json()["error"]["message"]), response.text
        assert http.get("/health").status_code == 200
    engine.shutdown()


# ---- a `pagedkv serve` subprocess ------------------------------------------------------------------


class Served:
    """`python -m pagedkv serve` of the tiny model on a free port of 127.0.0.1, with ``flags`` and at
    most ``nofile`` open files; :meth:`stop` always ends it."""

    def __init__(self, tmp: Path, *flags: str, nofile: int | None = None) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        command = [sys.executable, "-m", "pagedkv", "serve", "--model", "tiny", "--served-model-name", MODEL,
                   "--port", str(self.port), "--num-blocks", "64", *flags]

        def limit_files() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        with self.log.open("w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit_files,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        until(lambda: self.answers_health(), "the server up")

    def answers_health(self) -> bool:
        assert self.process.poll() is None, self.log.read_text()
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def until(condition, what: str, timeout: float = 60.0) -> None:
    """A hang guard: waits for ``condition`` (the assertion is on the state it waits for)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.05)


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (at end of file), without waiting; what it sent
    before is read and dropped."""
    try:
        while select.select([sock], [], [], 0)[0]:
            if sock.recv(65536) == b"":
                return True
    except ConnectionResetError:
        return True
    return False


def test_a_connection_that_sends_no_complete_request_head_is_closed(tmp_path):
    """Item 10: a connection that never sent a byte (or half a head) was kept forever."""
    server = Served(tmp_path, "--head-timeout", "0.5")
    try:
        silent, partial, served = server.connect(), server.connect(), server.connect()
        partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        served.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, then idle
        assert served.recv(12) == b"HTTP/1.1 200"
        for sock in (silent, partial, served):
            until(lambda sock=sock: closed_by_peer(sock), "an idle connection closed")
            sock.close()
        assert server.answers_health()
    finally:
        server.stop()


def test_connections_past_the_cap_are_closed_and_never_exhaust_the_descriptors(tmp_path):
    """Item 10: idle connections exhausted the file descriptors, accept() then failed in a loop
    logging a traceback per attempt, and /health stopped answering. With 256 files the cap is
    256 - 64 = 192: of 300 idle connections, the server keeps 192 and closes the rest at once."""
    server = Served(tmp_path, "--head-timeout", "600", nofile=256)
    idle: list[socket.socket] = []
    try:
        idle = [server.connect() for _ in range(300)]
        until(lambda: sum(map(closed_by_peer, idle)) == 300 - 192, "the connections past the cap closed")
        kept = [sock for sock in idle if not closed_by_peer(sock)]
        assert len(kept) == 192
        for sock in kept[:10]:  # room under the cap again
            sock.close()
        until(server.answers_health, "/health answering")
        log = server.log.read_text()
        assert "Traceback" not in log and len(log.splitlines()) < 10, log[-3000:]
    finally:
        for sock in idle:
            sock.close()
        server.stop()


def test_a_body_still_arriving_at_sigterm_is_a_503(tmp_path):
    """Item 22: uvicorn cancelled it at the end of the graceful shutdown: a plain-text 500."""
    server = Served(tmp_path, "--shutdown-timeout", "0")
    try:
        body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
        with server.connect() as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
            server.process.send_signal(signal.SIGTERM)
            sock.settimeout(60)
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
        head, _, payload = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), response
        assert json.loads(payload)["error"]["type"] == "ServiceUnavailableError"
        assert server.process.wait(timeout=60) == 0
    finally:
        server.stop()
