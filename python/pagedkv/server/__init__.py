"""An OpenAI-compatible HTTP server over a :class:`~pagedkv.Engine` (FastAPI on uvicorn):
``build_app`` makes the ASGI app, ``serve`` runs it until SIGTERM and drains; ``python -m
pagedkv serve`` is :mod:`pagedkv.server.launch`. Needs the ``server`` extra."""

from __future__ import annotations

from pagedkv.server.app import DEFAULT_MAX_TOKENS, build_app
from pagedkv.server.launch import serve

__all__ = ["DEFAULT_MAX_TOKENS", "build_app", "serve"]
