"""Fixtures of the server tests: one served tiny model per test module (:mod:`served`), and an
``openai`` client of it."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from served import Server


@pytest.fixture(scope="module")
def server(request, tmp_path_factory) -> Iterator[Server]:
    """A server per module (each module's requests and counts its own), on 32 sequences and
    512-token steps; :meth:`Server.stop` kills it whatever the tests did."""
    running = Server(tmp_path_factory.mktemp(request.module.__name__), "--max-num-seqs", "32",
                     "--max-num-batched-tokens", "512")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()
