"""The ``/metrics`` HTTP server: prometheus_client's exposition behind a server that no idle, slow
or half-finished client can hold.

Invariants:
- At most ``max_connections`` connections are being served at once, each by one thread of a pool
  of that size; the accept loop takes the next connection only once a slot is free (waiting at
  most ``timeout``, then closing it), so neither threads nor open sockets grow with the clients.
- A connection has ``timeout`` seconds in all to send its request head (at most
  :data:`MAX_HEAD_BYTES`): an idle one, a half-sent one or one trickling bytes is closed when
  they run out. Sending the response is bounded by ``timeout`` too.
- One request per connection (HTTP/1.0, the server closes).
"""

from __future__ import annotations

import io
import socket
import socketserver
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import MetricsHandler

from pagedkv.errors import InvalidArgumentError

__all__ = ["MetricsServer", "MAX_HEAD_BYTES"]

MAX_HEAD_BYTES = 16 * 1024  # request line and headers of a scrape: a few hundred bytes


def _read_head(connection: socket.socket, timeout: float) -> bytes | None:
    """The request head, read within ``timeout`` seconds in all; None if the client is idle, too
    slow, too long-winded or gone."""
    deadline = time.monotonic() + timeout
    head = bytearray()
    while b"\r\n\r\n" not in head and b"\n\n" not in head:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or len(head) > MAX_HEAD_BYTES:
            return None
        connection.settimeout(remaining)
        try:
            chunk = connection.recv(4096)
        except OSError:  # timed out, reset
            return None
        if not chunk:
            return None
        head += chunk
    connection.settimeout(timeout)  # bounds the response's send (sendall's total time)
    return bytes(head)


class _Handler(MetricsHandler):
    """prometheus_client's handler, fed a request head read under a deadline (MetricsServer
    subclasses it per server, setting ``registry`` and ``seconds``)."""

    seconds: float = 5.0  # the connection's timeout

    def handle(self) -> None:
        head = _read_head(self.connection, self.seconds)
        if head is None:
            return
        self.rfile = io.BytesIO(head)
        try:
            self.handle_one_request()
        except OSError:  # the client stopped reading or went away: nothing left to tell it
            pass


class _PooledServer(socketserver.TCPServer):
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[_Handler], max_connections: int, timeout: float) -> None:
        self.address_family = socket.getaddrinfo(address[0], address[1], type=socket.SOCK_STREAM)[0][0]
        self._slots = threading.BoundedSemaphore(max_connections)
        self._wait = timeout
        self._pool = ThreadPoolExecutor(max_connections, thread_name_prefix="pagedkv-metrics")
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        if not self._slots.acquire(timeout=self._wait):
            self.shutdown_request(request)
            return
        self._pool.submit(self._serve, request, client_address)

    def _serve(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=True)


class MetricsServer:
    """Serves ``registry`` at ``/metrics`` from a background thread until :meth:`close`."""

    def __init__(
        self, registry: CollectorRegistry, port: int, addr: str = "127.0.0.1", *, timeout: float = 5.0, max_connections: int = 8
    ) -> None:
        if not timeout > 0 or max_connections < 1:
            raise InvalidArgumentError(f"timeout must be > 0 and max_connections ≥ 1, got {timeout!r}, {max_connections!r}")
        handler = type("_RegistryHandler", (_Handler,), {"registry": registry, "seconds": timeout})
        self._server = _PooledServer((addr, port), handler, max_connections, timeout)
        self._thread = threading.Thread(target=self._server.serve_forever, name="pagedkv-metrics-accept", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port (useful when 0 asked for any free one)."""
        return int(self._server.server_address[1])

    def close(self) -> None:
        """Stops accepting, waits for the connections being served (each ends within the timeout)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
