"""`python -m pagedkv serve` as a subprocess on 127.0.0.1 for the server tests: the built-in tiny
model (random weights, byte tokenizer) under the name :data:`MODEL`, given the chat template
:data:`TEMPLATE`; :class:`City`, the answer the SDK parse tests ask for. The fixtures that start
one per test module are in ``conftest.py``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import httpx
import openai
from pydantic import BaseModel, ConfigDict, Field

MODEL = "tiny-served"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
STARTUP_SECONDS = 60


class City(BaseModel):
    """The pydantic answer the structured-output tests ask the SDKs to parse (bounded, closed)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=10_000_000)
    kind: Literal["town", "city", "village"]
    coastal: bool


class Server:
    """A `python -m pagedkv serve` subprocess; :meth:`stop` always kills it."""

    def __init__(self, tmp: Path, *flags: str) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        template = tmp / "template.jinja"
        template.write_text(TEMPLATE)
        self.log = tmp / f"server-{self.port}.log"
        command = [sys.executable, "-m", "pagedkv", "serve", "--model", "tiny", "--served-model-name", MODEL,
                   "--port", str(self.port), "--chat-template", str(template), "--num-blocks", "256", *flags]
        with self.log.open("w") as log:
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the server did not start in {STARTUP_SECONDS} s:\n{self.log.read_text()}")
            time.sleep(0.1)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=30)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_idle(self, timeout: float = 5.0) -> dict:
        """/health once nothing runs or waits and no block is in use (fails after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if health["num_running"] == health["num_waiting"] == health["blocks_in_use"] == 0:
                return health
            assert time.monotonic() < deadline, f"still busy after {timeout} s: {health}"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
