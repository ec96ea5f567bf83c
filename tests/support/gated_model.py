"""A model the test steps by hand: its forward pass waits at a gate the test opens, so a test
never races the engine's worker (whatever the machine's speed, nothing moves while it is held).

``allow(k)`` lets k more forward passes through, ``open()`` all of them, ``close()`` none;
``held()`` returns once the worker waits at the gate with no pass left, i.e. its step is
scheduled and stays put. Every wait is bounded by :data:`HANG_GUARD_S` only to turn a hang into
a failure: no outcome depends on it.
"""

from __future__ import annotations

import math
import threading

from pagedkv.engine import Engine, EngineConfig
from pagedkv.loaders import load_tokenizer
from pagedkv.models import LlamaModel, LlamaWeights

HANG_GUARD_S = 60.0


class GatedModel:
    """The tiny model behind a gate (closed when made, unless ``open``)."""

    def __init__(self, model: LlamaModel, open: bool = False) -> None:
        self.model = model
        self.config = model.config
        self._cond = threading.Condition()
        self._passes = math.inf if open else 0
        self._arrived = 0  # forward passes that reached the gate
        self._passed = 0  # ... and went through it

    def kv_spec(self, dtype=None):
        return self.model.kv_spec(dtype)

    def forward(self, step):
        with self._cond:
            self._arrived += 1
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._passes > 0, HANG_GUARD_S):
                raise TimeoutError(f"the test left the gate closed for {HANG_GUARD_S} s")
            self._passes -= 1
            self._passed += 1
        return self.model.forward(step)

    def allow(self, passes: float = 1) -> None:
        with self._cond:
            self._passes += passes
            self._cond.notify_all()

    def open(self) -> None:
        self.allow(math.inf)

    def close(self) -> None:
        with self._cond:
            self._passes = 0

    def held(self) -> None:
        """Returns once a forward pass waits at the gate with none allowed (the test's hang
        guard fails it otherwise)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._arrived > self._passed and self._passes == 0, HANG_GUARD_S)
        assert ok, f"no step reached the gate within {HANG_GUARD_S} s"


def gated_engine(weights: LlamaWeights, *, open: bool = False, max_waiting: int = 1024, **config) -> tuple[Engine, GatedModel]:
    """An engine over the tiny model behind a gate, and the gate."""
    model = GatedModel(LlamaModel(weights), open=open)
    tokenizer = load_tokenizer(None, model.config.vocab_size)
    return Engine(model, tokenizer, EngineConfig(**config), max_waiting=max_waiting), model
