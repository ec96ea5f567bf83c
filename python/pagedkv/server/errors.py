"""OpenAI-shaped errors: every failure the server answers is ``{"error": {"message", "type",
"param", "code"}}`` with the HTTP status its cause implies.

Invariants:

- One table (:data:`STATUS`) maps pagedkv's exception classes to statuses: a bad argument 400, an
  unknown model 404, a full waiting queue 429, a closed or draining engine 503; 429 and 503
  carry ``Retry-After``.
- Nothing a client sends reaches a 500: bodies FastAPI refuses (malformed JSON, wrong types,
  unknown fields: its 422) are answered 400; only a bug in pagedkv is a 500.
- :func:`error_body` is the one place the JSON is built, for responses and for the error event
  that ends a stream (:mod:`pagedkv.server.streaming`).
- A body past the server's limit is a 413 (:class:`BodyLimit`), read no further.
- A request still unanswered when the server cancels it (uvicorn's graceful shutdown ends with
  the requests still running: a body still arriving) is a 503, as any request the shutdown meets
  (:class:`CancelledIs503`), not uvicorn's plain-text 500.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.engine import EngineClosedError, EngineOverloadedError
from pagedkv.errors import DuplicateSequenceError, InvalidArgumentError, NoChatTemplateError, PagedKVError

__all__ = [
    "RETRY_AFTER_SECONDS", "STATUS", "BodyLimit", "BodyTooLargeError", "CancelledIs503", "ModelNotFoundError",
    "error_body", "error_response", "install_handlers",
]

RETRY_AFTER_SECONDS = 1  # a full queue drains in a few steps; a restart takes a few seconds either way


class ModelNotFoundError(PagedKVError, LookupError):
    """The request named a model this server does not serve."""


# Most specific first: a class's first match wins.
STATUS: tuple[tuple[type[BaseException], HTTPStatus, str], ...] = (
    (ModelNotFoundError, HTTPStatus.NOT_FOUND, "NotFoundError"),
    (NoChatTemplateError, HTTPStatus.BAD_REQUEST, "BadRequestError"),
    (InvalidArgumentError, HTTPStatus.BAD_REQUEST, "BadRequestError"),
    (DuplicateSequenceError, HTTPStatus.BAD_REQUEST, "BadRequestError"),
    (EngineOverloadedError, HTTPStatus.TOO_MANY_REQUESTS, "RateLimitError"),
    (EngineClosedError, HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailableError"),
)


def classify(error: BaseException) -> tuple[HTTPStatus, str]:
    """The status and OpenAI error type of ``error`` (500 for anything unexpected: a bug)."""
    for cls, status, kind in STATUS:
        if isinstance(error, cls):
            return status, kind
    return HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError"


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status in (429, 503) else None
    return JSONResponse(error_body(message, kind, status, param), status_code=status, headers=headers)


def exception_response(error: BaseException) -> JSONResponse:
    status, kind = classify(error)
    return error_response(status, str(error) or type(error).__name__, kind, getattr(error, "param", None))


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message naming each refused field, and the first one's path as ``param``."""
    parts, param = [], None
    for item in error.errors():
        location = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        param = param or location or None
        parts.append(f"{location or 'body'}: {item.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request body", param


class BodyTooLargeError(HTTPException):
    """A request body past the server's limit: raised from the body's reading, a 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the request body exceeds {max_bytes} bytes")


class BodyLimit:
    """ASGI middleware: a request body past ``max_bytes`` is a 413, read no further: at once when
    its ``Content-Length`` says so, else (a chunked body) when the bytes received pass it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            error = BodyTooLargeError(self.max_bytes)
            await error_response(error.status_code, error.detail, "RequestEntityTooLarge")(scope, receive, send)
            return
        received = 0

        async def receive_counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise BodyTooLargeError(self.max_bytes)  # FastAPI's handler answers it (see install_handlers)
            return message

        await self.app(scope, receive_counted, send)


class CancelledIs503:
    """ASGI middleware: a request cancelled before its response started is answered 503 (the
    cancellation is the server's shutdown; it ends here, with the answer)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except asyncio.CancelledError:
            if started:
                raise
            response = error_response(HTTPStatus.SERVICE_UNAVAILABLE, "the server is shutting down", "ServiceUnavailableError")
            await response(scope, receive, send)


def install_handlers(app: FastAPI) -> None:
    """Makes every error of ``app`` OpenAI-shaped (see the module doc)."""
    app.add_middleware(CancelledIs503)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return error_response(HTTPStatus.BAD_REQUEST, message, "BadRequestError", param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:  # 404 route, 405 method
        return error_response(error.status_code, str(error.detail), HTTPStatus(error.status_code).phrase.replace(" ", ""))

    @app.exception_handler(PagedKVError)
    async def pagedkv_error(request: Request, error: PagedKVError) -> JSONResponse:
        return exception_response(error)
