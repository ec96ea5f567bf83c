"""Engines over the tiny model for tests: plain (:func:`make_engine`), or with a model that gives
NaN logits or fails on demand (:func:`poisoned_engine`); and a bounded blocking read of a handle."""

from __future__ import annotations

import itertools
import threading

import numpy as np

from pagedkv.engine import Engine, EngineConfig
from pagedkv.loaders import load_tokenizer
from pagedkv.models import LlamaModel, LlamaWeights
from support.gated_model import GatedModel

GREEDY = dict(temperature=0.0, ignore_eos=True)
NAN = np.nan


def make_engine(weights: LlamaWeights, max_waiting: int = 1024, **config) -> Engine:
    model = LlamaModel(weights)
    return Engine(model, load_tokenizer(None, model.config.vocab_size), EngineConfig(**config), max_waiting=max_waiting)


def tokens_of(handle, timeout: float = 30, limit: int | None = None) -> list[int]:
    """The token ids a blocking iteration of ``handle`` yields (the first ``limit`` of them, if
    given), or the error it raises; iterated in a thread, so that a handle that never ends fails
    the test instead of hanging it."""
    out: list = []

    def iterate() -> None:
        try:
            out.append([event.token_id for event in itertools.islice(handle, limit)])
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            out.append(error)

    thread = threading.Thread(target=iterate, daemon=True)
    thread.start()
    thread.join(timeout)
    assert out, f"iterating {handle.request_id!r} did not end within {timeout} s"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


class PoisonedModel(GatedModel):
    """The tiny model behind an open gate, with NaN logits for requests whose id starts with
    "nan" and a failure of the forward pass once ``fail`` is set."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__(model, open=True)
        self.fail = False

    def forward(self, step):
        logits = super().forward(step)  # waits at the gate
        if self.fail:
            raise RuntimeError("the model broke")
        for row, request_id in enumerate(step.sample_request_ids):
            if request_id.startswith("nan"):
                logits[row] = NAN
        return logits


def poisoned_engine(weights, **config) -> tuple[Engine, PoisonedModel]:
    model = PoisonedModel(LlamaModel(weights))
    return Engine(model, load_tokenizer(None, model.config.vocab_size), EngineConfig(**config)), model
