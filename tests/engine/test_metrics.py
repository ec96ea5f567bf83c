"""The ``/metrics`` server: idle, half-sent and trickling connections are closed within the
timeout while normal scrapes are answered, and the threads serving connections stay bounded."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from pagedkv.errors import InvalidArgumentError
from pagedkv.observability.metrics import EngineMetrics

TIMEOUT = 1.5  # the server's per-connection timeout in these tests


@pytest.fixture
def metrics() -> Iterator[EngineMetrics]:
    metrics = EngineMetrics("test-model")
    metrics.generation_tokens.inc(7)
    yield metrics
    metrics.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def seconds_until_closed(client: socket.socket, started: float, limit: float = 10.0) -> float:
    """Waits for the server to close ``client``; returns the time since ``started``."""
    client.settimeout(limit)
    try:
        while client.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {limit} s")
    finally:
        client.close()
    return time.monotonic() - started


def test_idle_and_partial_connections_are_closed_while_scrapes_are_answered(metrics: EngineMetrics) -> None:
    port = metrics.serve(0, timeout=TIMEOUT, max_connections=4)
    started = time.monotonic()
    idle = connect(port)
    partial = connect(port)
    partial.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: the head never ends

    scrape_start = time.monotonic()
    assert "pagedkv:generation_tokens_total" in scrape(port)
    assert time.monotonic() - scrape_start < TIMEOUT  # answered at once, not after the idle ones expire

    for client in (idle, partial):
        assert TIMEOUT * 0.8 <= seconds_until_closed(client, started) <= TIMEOUT + 5


def test_a_client_trickling_its_request_is_closed_at_the_deadline(metrics: EngineMetrics) -> None:
    # One byte every 0.3 s never lets a per-read timeout of 1.5 s expire; the whole head has 1.5 s.
    port = metrics.serve(0, timeout=TIMEOUT, max_connections=2)
    client = connect(port)
    started = time.monotonic()
    stop = threading.Event()

    def trickle() -> None:
        for byte in b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200:
            if stop.wait(0.3):
                return
            try:
                client.send(bytes([byte]))
            except OSError:
                return

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        assert seconds_until_closed(client, started) <= TIMEOUT + 5
    finally:
        stop.set()
        sender.join(timeout=5)
    assert not sender.is_alive()
    assert "pagedkv:generation_tokens_total" in scrape(port)


def test_connections_beyond_the_pool_do_not_get_threads(metrics: EngineMetrics) -> None:
    before = {t.ident for t in threading.enumerate()}
    timeout = 1.0
    port = metrics.serve(0, timeout=timeout, max_connections=2)
    started = time.monotonic()
    clients = [connect(port) for _ in range(6)]
    time.sleep(0.5)
    new_threads = [t for t in threading.enumerate() if t.ident not in before]
    assert len(new_threads) <= 3, [t.name for t in new_threads]  # the accept loop and a pool of 2
    # Each is closed: at its deadline once it has a slot, or when it waited a whole timeout for one.
    for client in clients:
        seconds_until_closed(client, started, limit=len(clients) * timeout + 5)
    assert "pagedkv:generation_tokens_total" in scrape(port)


def test_close_stops_the_server(metrics: EngineMetrics) -> None:
    port = metrics.serve(0, timeout=TIMEOUT)
    assert "pagedkv:generation_tokens_total" in scrape(port)
    metrics.close()
    with pytest.raises(OSError):
        scrape(port)


def test_bad_server_limits_are_refused(metrics: EngineMetrics) -> None:
    with pytest.raises(InvalidArgumentError):
        metrics.serve(0, timeout=0)
    with pytest.raises(InvalidArgumentError):
        metrics.serve(0, max_connections=0)
