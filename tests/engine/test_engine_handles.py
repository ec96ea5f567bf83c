"""Handles and the engine's lifetime (issue 10): replayed iteration, asyncio without executor
threads, aborts bound to one submission, stats current when a request ends, dropped engines freed."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pagedkv import SamplingParams
from support.engines import GREEDY, make_engine, tokens_of
from support.gated_model import HANG_GUARD_S, gated_engine

T = TypeVar("T")


def test_a_handle_iterated_twice_or_by_two_threads_replays_its_stream(weights):
    """Item 7: every iteration yields every token; none blocks once the request has ended."""
    with make_engine(weights, num_blocks=64) as engine:
        handle = engine.submit([5, 6, 7], SamplingParams(max_tokens=12, **GREEDY))
        streams: dict[int, list[int]] = {}

        def consume(i: int) -> None:
            streams[i] = [event.token_id for event in handle]

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive(), "an iterating thread hung"
        tokens = handle.result(timeout=30).token_ids
        assert len(tokens) == 12
        assert streams == {0: tokens, 1: tokens}
        assert tokens_of(handle) == tokens  # a third pass, after the end


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def run_async(main: Callable[[], Coroutine[Any, Any, T]], timeout: float = 30) -> T:
    """``asyncio.run(main())`` in a thread, failing the test if it does not return in time."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(asyncio.run(main())), daemon=True)
    thread.start()
    thread.join(timeout)
    assert out, f"asyncio.run did not return within {timeout} s"
    return out[0]


def test_cancelling_await_leaks_no_thread_and_asyncio_run_returns_promptly(weights):
    """Item 8: a cancelled ``await handle`` leaves no executor thread blocked, so asyncio.run
    returns while the request is still held at the gate instead of waiting for it to end."""
    engine, gate = gated_engine(weights, num_blocks=256)
    handle = engine.submit([5, 6, 7], SamplingParams(max_tokens=3000, **GREEDY))
    before = _threads()

    async def main() -> None:
        try:
            await asyncio.wait_for(handle, timeout=0.05)
        except asyncio.TimeoutError:
            return
        raise AssertionError("a request held at the gate ended")

    run_async(main)  # its hang guard fails the test if asyncio.run waits for the request
    leaked = _threads() - before
    assert not handle.done(), "asyncio.run returned while the request was still held"
    handle.abort()
    gate.open()
    handle.result(timeout=HANG_GUARD_S)
    engine.shutdown()
    assert not leaked, f"threads left behind: {leaked}"


def test_cancelling_async_for_loses_no_token_for_a_later_consumer(weights):
    """Item 8: a consumer cancelled mid-stream steals nothing: a later one gets every token."""
    with make_engine(weights, num_blocks=64) as engine:
        handle = engine.submit([5, 6, 7], SamplingParams(max_tokens=10, **GREEDY))
        before = _threads()

        async def main() -> int:
            first = asyncio.Event()
            seen = 0

            async def consume() -> None:
                nonlocal seen
                async for _ in handle:
                    seen += 1
                    first.set()
                    await asyncio.sleep(3600)  # parks mid-stream until cancelled

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), timeout=30)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return seen

        assert run_async(main) == 1
        output = handle.result(timeout=30)
        assert tokens_of(handle) == output.token_ids
        assert len(output.token_ids) == 10
        assert not (_threads() - before)


def test_asyncio_consumers_of_one_handle_each_get_the_whole_stream(weights):
    """Item 8: two ``async for`` over one handle and an ``await``, all in one loop, no threads."""
    with make_engine(weights, num_blocks=64) as engine:
        handle = engine.submit([5, 6, 7], SamplingParams(max_tokens=8, **GREEDY))

        async def main() -> tuple[list[int], list[int], list[int]]:
            async def stream() -> list[int]:
                return [event.token_id async for event in handle]

            a, b, output = await asyncio.wait_for(asyncio.gather(stream(), stream(), handle), timeout=30)
            return a, b, output.token_ids

        a, b, tokens = run_async(main)
    assert a == b == tokens and len(tokens) == 8


def test_a_late_abort_never_reaches_a_resubmission_with_the_same_id(weights):
    """Item 9: aborting an ended submission is a no-op, even when its id is reused at once."""
    engine, gate = gated_engine(weights, open=True, num_blocks=64)
    with engine:
        for _ in range(20):
            first = engine.submit([5, 6], SamplingParams(max_tokens=1, **GREEDY), request_id="same")
            first.result(timeout=30)
            first.abort()
            second = engine.submit([5, 6], SamplingParams(max_tokens=3, **GREEDY), request_id="same")
            assert second.result(timeout=30).outputs[0].finish_reason == "length"
        gate.close()  # the engine is idle: its next step waits at the gate
        running = engine.submit([5, 6], SamplingParams(max_tokens=500, **GREEDY), request_id="same")
        engine.abort("same")  # by id: the submission now using it
        gate.open()
        assert running.result(timeout=30).outputs[0].finish_reason == "abort"


def test_stats_are_current_once_generate_returns(weights):
    """Item 12: the step that ended the last request is already counted."""
    with make_engine(weights, num_blocks=128) as engine:
        for round in range(1, 4):
            engine.generate([[5, 6, 7, 8]] * 4, SamplingParams(max_tokens=8, **GREEDY))
            stats = engine.stats()
            assert stats["generated_tokens"] == 32 * round
            assert stats["finished_requests"] == 4 * round


def test_an_engine_dropped_without_shutdown_is_freed(weights):
    """Item 13: the worker holds no reference to its Engine; collecting the Engine stops it."""
    refs, workers = [], []
    for _ in range(3):
        engine = make_engine(weights, num_blocks=64)
        handle = engine.submit([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
        handle.result(timeout=30)
        refs.append((weakref.ref(engine), weakref.ref(engine.core)))
        workers.append(engine._state.thread)
        del engine, handle
    gc.collect()
    for worker in workers:
        worker.join(timeout=10)
        assert not worker.is_alive(), "the worker of a dropped engine kept running"
    gc.collect()
    assert all(e() is None and c() is None for e, c in refs), "a dropped engine (or its core) stayed alive"


def test_a_handle_keeps_its_engine_serving(weights):
    """Item 13's other half: an engine only its handle references still finishes the request."""
    handle = make_engine(weights, num_blocks=64).submit([5, 6, 7], SamplingParams(max_tokens=6, **GREEDY))
    gc.collect()
    output = handle.result(timeout=30)
    assert output.outputs[0].finish_reason == "length" and len(output.token_ids) == 6
