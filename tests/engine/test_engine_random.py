"""An engine-level randomized test (issue 10): threads interleave submissions (some bad, some
poisoned with NaN logits), aborts, blocking and asyncio iteration, asyncio cancellation and a
shutdown. Every handle must end, the worker must survive every request's fault, and no block may
stay in use."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from pagedkv import InvalidArgumentError, ModelError, PagedKVError, SamplingParams
from pagedkv.engine import EngineClosedError, EngineOverloadedError, RequestHandle
from support.engines import poisoned_engine, tokens_of

NUM_BLOCKS = 12
SHARED = [list(range(10, 26)), list(range(100, 116))]


def bad_submission(rng: random.Random) -> dict:
    return rng.choice([
        dict(priority="high"), dict(cache_salt=7), dict(request_id=3), dict(params={"max_tokens": 2}),
        dict(params=SamplingParams(max_tokens=0)), dict(params=SamplingParams(n=2**63)), dict(prompt=b"hi"),
        dict(prompt=[]), dict(prompt=[True]), dict(prompt=[1, 10**6]),
    ])


async def cancel_midway(handle: RequestHandle, rng: random.Random) -> None:
    """Awaits the handle, or streams a few of its tokens, and is cancelled on the way."""
    async def stream() -> None:
        async for _ in handle:
            await asyncio.sleep(0)

    waiter = handle if rng.random() < 0.5 else stream()
    try:
        await asyncio.wait_for(waiter, timeout=rng.uniform(0.0, 0.02))
    except asyncio.TimeoutError:
        pass
    except PagedKVError:
        pass  # it ended with its own error first


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_threads_interleaving_every_operation_leave_a_sound_engine(weights, seed):
    engine, _ = poisoned_engine(
        weights,
        num_blocks=NUM_BLOCKS,
        block_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        admission_lookahead_tokens=None,
    )
    handles: list[RequestHandle] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        rng = random.Random(seed * 100 + index)
        mine: list[RequestHandle] = []
        for op in range(40):
            action = rng.choices(["submit", "bad", "abort", "iterate", "async"], [5, 2, 2, 2, 2])[0]
            if action == "bad":
                kwargs = dict(prompt=[5, 6], params=SamplingParams(max_tokens=2)) | bad_submission(rng)
                prompt = kwargs.pop("prompt")
                try:
                    engine.submit(prompt, **kwargs)
                except InvalidArgumentError:
                    pass
                except EngineClosedError as error:  # after the shutdown; never a dead worker
                    if error.__cause__ is not None:
                        failures.append(error)
                else:
                    failures.append(AssertionError(f"accepted {kwargs} / {prompt!r}"))
            elif action == "submit" or not mine:
                poisoned = rng.random() < 0.15
                params = SamplingParams(
                    max_tokens=rng.randint(1, 24), n=rng.choice([1, 1, 2]), temperature=rng.choice([0.0, 0.8]), seed=op,
                )
                prefix = rng.choice([[], SHARED[0], SHARED[1]])  # prefix-cache hits
                prompt = prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 24))]
                request_id = f"nan-{index}-{op}" if poisoned else None
                try:
                    handle = engine.submit(prompt, params, request_id=request_id, timeout=1.0)
                except (EngineClosedError, EngineOverloadedError):
                    continue
                mine.append(handle)
                with lock:
                    handles.append(handle)
            elif action == "abort":
                handle = rng.choice(mine)
                if rng.random() < 0.5:
                    handle.abort()
                else:
                    engine.abort(handle.request_id)
            elif action == "iterate":
                handle = rng.choice(mine)
                try:
                    streamed = tokens_of(handle)
                except ModelError:
                    continue
                output = handle.result(timeout=30)
                if sorted(streamed) != sorted(t for c in output.outputs for t in c.token_ids):
                    failures.append(AssertionError(f"{handle.request_id}: stream {streamed} != {output.outputs}"))
            else:
                asyncio.run(cancel_midway(rng.choice(mine), rng))

    def closer() -> None:
        rng = random.Random(seed)
        threading.Event().wait(rng.uniform(1.0, 3.0))
        engine.shutdown(drain=rng.random() < 0.5, timeout=30)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    threads.append(threading.Thread(target=closer, daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), f"{t.name} did not finish"
    engine.shutdown(timeout=30)
    assert not failures, failures[:3]

    assert engine._state.dead is None, "a request's fault killed the worker"
    for handle in handles:
        poisoned = handle.request_id.startswith("nan-")
        try:
            output = handle.result(timeout=30)
        except ModelError:
            assert poisoned, f"{handle.request_id} failed"
            continue
        reasons = {c.finish_reason for c in output.outputs}
        assert output.finished and reasons <= ({"abort"} if poisoned else {"stop", "length", "abort"}), reasons
    scheduler = engine.core.scheduler
    scheduler.check_invariants()
    assert scheduler.num_unfinished_requests == 0
    assert scheduler.num_free_blocks == NUM_BLOCKS, "a block is still in use"
