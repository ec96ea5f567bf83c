"""Connections a client opens and then neglects: :class:`GuardedH11Protocol`, uvicorn's HTTP/1.1
protocol with a deadline for each request head and a cap on open connections, and
:func:`quiet_accept_errors`, which logs a failing ``accept()`` once per interval.

uvicorn times out a connection idle *between* requests (``timeout_keep_alive``) but not one that
never completes a request head: a client that connects and sends nothing (or a few bytes of a
head) held its connection forever, and enough of them exhausted the file descriptors; then
``accept()`` failed on every attempt, each logged with a traceback (1.3 M lines in 20 s), and
``/health`` went unanswered (issue 23). ``limit_concurrency`` does not help: it answers 503 to
requests, never closes a silent connection.

Invariants:

- A connection has ``head_timeout`` seconds from its opening, and from the end of each response,
  to deliver a complete request head; then it is closed. (A request's body is the app's to wait
  for; shutdown bounds it.)
- At most ``max_connections`` are open: one past the cap is closed as soon as it is accepted, so
  the server's descriptors never run out while the cap is below their limit (the launcher keeps
  it there).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["ACCEPT_ERROR_INTERVAL", "GuardedH11Protocol", "quiet_accept_errors"]

ACCEPT_ERROR_INTERVAL = 10.0  # seconds between two logs of failing accept() calls

_logger = logging.getLogger("pagedkv.server")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a connection cap (see the module
    doc); pass it to ``uvicorn.Config(http=functools.partial(GuardedH11Protocol, head_timeout=...,
    max_connections=...))``."""

    def __init__(self, *args: Any, head_timeout: float, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout = head_timeout
        self._max_connections = max_connections
        self._head_deadline: asyncio.TimerHandle | None = None
        self._waiting_after: object = None  # the request cycle a new head must follow

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._max_connections:
            transport.close()  # connection_lost follows and forgets it
            return
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_deadline is not None and self.cycle is not self._waiting_after:
            self._head_deadline.cancel()  # a head arrived: its request is the app's now
            self._head_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        self._waiting_after = self.cycle
        self._head_deadline = self.loop.call_later(self._head_timeout, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Makes ``loop`` log a failing ``accept()`` (asyncio retries it each second) at most once per
    :data:`ACCEPT_ERROR_INTERVAL`, without its traceback; other errors go to the default handler."""
    last = -ACCEPT_ERROR_INTERVAL

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        nonlocal last
        if "accept" not in str(context.get("message", "")):
            loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if now - last >= ACCEPT_ERROR_INTERVAL:
            last = now
            _logger.error("accepting connections failed: %s (logged once per %.0f s)", context.get("exception"),
                          ACCEPT_ERROR_INTERVAL)

    loop.set_exception_handler(handle)
