"""A submitted request's handle: its tokens as they come (blocking or asyncio iteration, each
replaying the stream from the start), its final output, and a way to abort it.

Invariants: the worker that runs the request calls ``_push`` for each token and ``_complete``
exactly once; every waiter (threads and asyncio futures, on any loop) is woken by each; ``abort``
goes through the callable the engine gave, never into the engine's state.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from functools import partial

from pagedkv.engine.outputs import RequestOutput, TokenEvent

__all__ = ["RequestHandle"]


class RequestHandle:
    """A submitted request: iterate it for tokens as they are produced (blocking), ``async for``
    it in asyncio, or wait for the whole :class:`RequestOutput` with :meth:`result` / ``await``.
    Every iteration replays the stream from its first token; any number may run at once."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        abort: Callable[[RequestHandle], None],
    ) -> None:
        """``abort(handle)`` asks whoever runs the request to stop it (an engine passes a method
        of its own, so a handle keeps its engine alive)."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self._abort = abort
        self._cond = threading.Condition()
        self._events: list[TokenEvent] = []
        self._ended = False
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._waiters: list[asyncio.Future[None]] = []  # asyncio consumers to wake

    # Called by the worker.
    def _push(self, event: TokenEvent) -> None:
        with self._cond:
            self._events.append(event)
            self._wake()

    def _complete(self, output: RequestOutput | None, error: BaseException | None) -> None:
        with self._cond:
            self._output, self._error, self._ended = output, error, True
            self._wake()

    def _wake(self) -> None:
        self._cond.notify_all()
        for future in self._waiters:
            try:
                future.get_loop().call_soon_threadsafe(_resolve, future)
            except RuntimeError:
                pass  # its loop is closed: nobody awaits the future any more
        self._waiters.clear()

    # Consumer side.
    def __iter__(self) -> Iterator[TokenEvent]:
        """Tokens as they are produced; raises the request's error, if it failed, at the end."""
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(partial(self._has_news, seen))
                events, ended = self._events[seen:], self._ended
            seen += len(events)
            yield from events
            if ended:  # no event follows the end
                break
        self._raise_if_failed()

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        seen = 0
        while True:
            await self._until(partial(self._has_news, seen))
            with self._cond:
                events, ended = self._events[seen:], self._ended
            seen += len(events)
            for event in events:
                yield event
            if ended:
                break
        self._raise_if_failed()

    def _has_news(self, seen: int) -> bool:
        """Whether a consumer that has seen ``seen`` events has more to read (or the end)."""
        return seen < len(self._events) or self._ended

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Blocks until the request ends; returns its output or raises its error."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ended, timeout):
                raise TimeoutError(f"request {self.request_id!r} still running after {timeout} s")
        return self._final()

    def __await__(self) -> Generator[object, None, RequestOutput]:
        return self._result_async().__await__()

    async def _result_async(self) -> RequestOutput:
        await self._until(lambda: self._ended)
        return self._final()

    async def _until(self, ready: Callable[[], bool]) -> None:
        """Waits in the running event loop, holding no thread, until ``ready()`` (read under the
        handle's lock) holds; a cancelled wait leaves nothing behind."""
        while True:
            with self._cond:
                if ready():
                    return
                future = asyncio.get_running_loop().create_future()
                self._waiters.append(future)
            try:
                await future
            finally:
                with self._cond:
                    if future in self._waiters:
                        self._waiters.remove(future)

    def done(self) -> bool:
        """Whether the request has ended."""
        return self._ended

    def abort(self) -> None:
        """Asks the engine to stop this submission (a no-op once it has ended); it then ends with
        ``finish_reason == "abort"``."""
        self._abort(self)

    def _final(self) -> RequestOutput:
        self._raise_if_failed()
        assert self._output is not None
        return self._output

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # it may have been cancelled meanwhile
        future.set_result(None)
