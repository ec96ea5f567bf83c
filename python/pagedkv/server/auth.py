"""Who may call the server: an API key (``--api-key`` or ``PAGEDKV_API_KEY``) as a bearer token.

Invariants:

- With a key, every route but the open ones (:data:`OPEN_PATHS`: ``/health``, ``/metrics``,
  ``/ping``, ``/version``; with ``protect_metrics`` only ``/ping``) needs ``Authorization: Bearer
  <key>``, else a 401 in OpenAI's error shape with ``WWW-Authenticate: Bearer``. A CORS preflight
  (``OPTIONS``) is answered by the CORS middleware outside this one and never reaches it.
- The comparison takes the same time whatever the key sent: both sides are SHA-256 digests
  (fixed length) compared by :func:`hmac.compare_digest`, so neither the key's length nor its
  first wrong byte shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac
from http import HTTPStatus

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.server.errors import error_response

__all__ = ["OPEN_PATHS", "ApiKeyAuth"]

OPEN_PATHS = frozenset({"/health", "/metrics", "/ping", "/version"})
_ALWAYS_OPEN = frozenset({"/ping"})


class ApiKeyAuth:
    """ASGI middleware: the bearer key checked on every guarded route (see the module doc)."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        if not api_key:
            raise ValueError("an API key must not be empty")
        self.app = app
        self._digest = hashlib.sha256(api_key.encode()).digest()
        self._open = _ALWAYS_OPEN if protect_metrics else OPEN_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self._open or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = error_response(HTTPStatus.UNAUTHORIZED, "a valid API key is needed: Authorization: Bearer <key>",
                                  "AuthenticationError")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        given = hashlib.sha256(token.strip()).digest()
        return hmac.compare_digest(given, self._digest) and scheme.lower() == b"bearer"
