"""User code the engine calls (issue 23 items 6 and 21): KV-event subscribers run outside the
engine's locks, so they may call back into it; nothing a subscriber, the tokenizer or the tracer
raises (SystemExit and KeyboardInterrupt included) closes the engine."""

from __future__ import annotations

import pytest

from pagedkv import ModelError, SamplingParams
from pagedkv.engine import Engine, EngineConfig
from pagedkv.models import LlamaModel
from pagedkv.text.tokenizer import ByteTokenizer
from support.engines import GREEDY, make_engine
from support.gated_model import HANG_GUARD_S

INTERRUPTS = pytest.mark.parametrize("error", [SystemExit(3), KeyboardInterrupt()], ids=["SystemExit", "KeyboardInterrupt"])
PROMPT = list(range(5, 17))  # three full blocks of 4: the first step stores them (KV events)


def test_a_kv_event_subscriber_may_call_back_into_the_engine(weights):
    """Item 6: a subscriber calling ``kv_snapshot()`` and ``submit()`` deadlocked the engine (it
    ran in the worker under the core's lock). Both requests now finish. The timeouts only turn a
    deadlock into a failure."""
    engine = make_engine(weights, num_blocks=64, block_size=4, emit_kv_events=True)
    got: dict = {}

    def resync(batch) -> None:
        if "snapshot" not in got:
            got["snapshot"] = engine.kv_snapshot()
            got["seq"] = batch.seq
            got["handle"] = engine.submit(PROMPT[::-1], SamplingParams(max_tokens=4, **GREEDY))

    engine.kv_events.subscribe(resync)
    first = engine.submit(PROMPT, SamplingParams(max_tokens=4, **GREEDY))
    try:
        assert len(first.result(timeout=HANG_GUARD_S).token_ids) == 4
        assert len(got["handle"].result(timeout=HANG_GUARD_S).token_ids) == 4
    finally:
        engine.shutdown(drain=False, timeout=HANG_GUARD_S)  # bounded: a deadlocked worker is left behind
    assert not engine._state.thread.is_alive()
    snapshot = got["snapshot"]
    assert snapshot.seq >= got["seq"] and len(snapshot.blocks) >= 3


@INTERRUPTS
def test_a_subscriber_raising_an_interrupt_leaves_the_engine_serving(weights, caplog, error):
    """Item 21 for KV-event subscribers: it is logged; the requests finish."""
    with make_engine(weights, num_blocks=64, block_size=4, emit_kv_events=True) as engine:
        seen: list[int] = []

        def exiting(batch) -> None:
            seen.append(batch.seq)
            raise error

        engine.kv_events.subscribe(exiting)
        for _ in range(2):
            assert len(engine.submit(PROMPT, SamplingParams(max_tokens=3, **GREEDY)).result(timeout=30).token_ids) == 3
        assert not engine.closed
    assert seen and type(error).__name__ in caplog.text


class RaisingTokenizer(ByteTokenizer):
    """The byte tokenizer, whose ``decode`` raises ``error`` while it is set."""

    error: BaseException | None = None

    def decode(self, token_ids) -> str:
        if self.error is not None:
            raise self.error
        return super().decode(token_ids)


@INTERRUPTS
def test_a_tokenizer_raising_an_interrupt_fails_its_request_alone(weights, caplog, error):
    """Item 21 for the tokenizer: the request being decoded fails with ModelError, the engine
    stays open and serves the next one."""
    model = LlamaModel(weights)
    tokenizer = RaisingTokenizer()
    with Engine(model, tokenizer, EngineConfig(num_blocks=64)) as engine:
        tokenizer.error = error
        with pytest.raises(ModelError, match="cannot be decoded"):
            engine.submit([5, 6, 7], SamplingParams(max_tokens=3, **GREEDY)).result(timeout=30)
        tokenizer.error = None
        assert not engine.closed
        assert len(engine.submit([5, 6, 7], SamplingParams(max_tokens=3, **GREEDY)).result(timeout=30).token_ids) == 3
    assert type(error).__name__ in caplog.text


class RaisingTracer:
    """A tracer (and its own observer) whose every hook raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.calls: list[str] = []

    def observe(self, clock) -> RaisingTracer:
        return self

    def queued(self, *args) -> None:
        self.calls.append("queued")
        raise self.error

    def step(self, *args) -> None:
        self.calls.append("step")
        raise self.error

    def finished(self, *args) -> None:
        self.calls.append("finished")
        raise self.error


@INTERRUPTS
def test_a_tracer_raising_an_interrupt_changes_nothing(weights, caplog, error):
    """Item 21 for the tracer: submit returns its handle, the worker steps and ends the request;
    each hook's exception is logged."""
    tracer = RaisingTracer(error)
    model = LlamaModel(weights)
    with Engine(model, ByteTokenizer(), EngineConfig(num_blocks=64), tracer=tracer) as engine:  # type: ignore[arg-type]
        handle = engine.submit([5, 6, 7], SamplingParams(max_tokens=3, **GREEDY))
        assert len(handle.result(timeout=30).token_ids) == 3
        assert not engine.closed
        assert len(engine.submit([5, 6, 7], SamplingParams(max_tokens=2, **GREEDY)).result(timeout=30).token_ids) == 2
    assert {"queued", "step", "finished"} <= set(tracer.calls)
    assert type(error).__name__ in caplog.text
