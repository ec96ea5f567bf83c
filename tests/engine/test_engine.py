"""The engine end to end: greedy generation through continuous batching (chunked prefill, prefix
hits, forced preemption) equals the dense full-recompute reference token for token; streaming,
concurrency, abort, shutdown, back-pressure and bad input."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from pagedkv import DuplicateSequenceError, InvalidArgumentError, SamplingParams
from pagedkv.engine import Engine, EngineClosedError, EngineConfig, EngineCore, EngineOverloadedError, PagedModelRunner
from pagedkv.models import DenseReference, LlamaModel, LlamaWeights
from support.engines import GREEDY, make_engine
from support.gated_model import HANG_GUARD_S, gated_engine


@pytest.fixture(scope="module")
def reference(weights: LlamaWeights) -> DenseReference:
    return DenseReference(weights)


def prompts(seed: int, count: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def expected(reference: DenseReference, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    with threadpool_limits(limits=1, user_api="blas"):
        return [reference.generate_greedy(p, max_tokens) for p in batch]


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(dict(num_blocks=256, block_size=16, max_num_batched_tokens=512), id="plain"),
        pytest.param(
            dict(num_blocks=256, block_size=8, max_num_batched_tokens=24, long_prefill_token_threshold=8), id="chunked-prefill"
        ),
        # No admission headroom, so admission overfills the 14 blocks and growth must preempt.
        pytest.param(
            dict(num_blocks=14, block_size=8, max_num_seqs=6, max_num_batched_tokens=64, admission_lookahead_tokens=None),
            id="forced-preemption",
        ),
        pytest.param(dict(num_blocks=14, block_size=8, max_num_seqs=6, max_num_batched_tokens=64), id="tight-with-headroom"),
    ],
)
def test_greedy_generation_equals_the_dense_reference(weights, reference, config):
    batch = prompts(seed=1, count=6, shared_prefix=20)  # the shared prefix gives prefix-cache hits
    want = expected(reference, batch, max_tokens=10)
    with make_engine(weights, **config) as engine:
        outputs = engine.generate(batch, SamplingParams(max_tokens=10, **GREEDY))
        stats = engine.stats()
    assert [o.token_ids for o in outputs] == want
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert stats["prefix_hit_tokens"] > 0
    if config.get("admission_lookahead_tokens", 0) is None:
        assert stats["preemptions"] > 0, "the configuration was meant to force preemption"


def test_logits_through_the_engine_core_match_the_reference(weights, reference):
    """One step's logits, as the engine computes them, within 1e-4 of the float64 reference."""
    model = LlamaModel(weights)
    runner = PagedModelRunner(model)
    core = EngineCore(runner, EngineConfig(num_blocks=64, block_size=8))
    batch = prompts(seed=2, count=3)
    for i, p in enumerate(batch):
        core.add_request(str(i), p, SamplingParams(max_tokens=2, **GREEDY))
    step = core.scheduler.schedule()
    logits = model.forward(step)
    for row, request_id in enumerate(step.sample_request_ids):
        prompt = batch[int(request_id)]
        want = reference.logits(prompt)[-1]
        assert np.max(np.abs(logits[row] - want)) <= 1e-4


def test_streamed_tokens_from_many_threads_arrive_in_order_and_complete(weights, reference):
    batch = prompts(seed=3, count=12)
    want = expected(reference, batch, max_tokens=6)
    streamed: dict[int, list[int]] = {}
    with make_engine(weights, num_blocks=256, block_size=16, max_num_seqs=5) as engine:

        def client(i: int) -> None:
            handle = engine.submit(batch[i], SamplingParams(max_tokens=6, **GREEDY), request_id=f"client-{i}")
            streamed[i] = [event.token_id for event in handle]
            assert handle.result().token_ids == streamed[i]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(batch))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [streamed[i] for i in range(len(batch))] == want


def test_asyncio_clients(weights):
    async def main(engine: Engine) -> list[list[int]]:
        async def one(prompt: list[int]) -> list[int]:
            handle = engine.submit(prompt, SamplingParams(max_tokens=4, **GREEDY))
            tokens = [event.token_id async for event in handle]
            assert (await handle).token_ids == tokens
            return tokens

        return await asyncio.gather(*(one(p) for p in prompts(seed=4, count=3)))

    with make_engine(weights, num_blocks=128) as engine:
        results = asyncio.run(main(engine))
    assert [len(r) for r in results] == [4, 4, 4]


def test_parallel_sampling_returns_n_samples_sharing_the_prompt(weights):
    with make_engine(weights, num_blocks=128, block_size=8) as engine:
        (output,) = engine.generate(
            [list(range(3, 40))], SamplingParams(max_tokens=5, n=3, temperature=1.0, seed=7, ignore_eos=True)
        )
    assert [len(c.token_ids) for c in output.outputs] == [5, 5, 5]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1, "independent samples should differ"


def test_abort_and_shutdown_end_every_request(weights):
    """Held at its first step, the engine is told to abort one request and to shut down without
    draining; released, it ends every request with an abort and frees every block."""
    engine, gate = gated_engine(weights, num_blocks=128, max_num_seqs=2)
    long = SamplingParams(max_tokens=200, **GREEDY)
    handles = [engine.submit(p, long) for p in prompts(seed=5, count=6)]
    gate.held()
    handles[0].abort()
    engine.shutdown(drain=False, timeout=0)  # the worker is held: it sees both once released
    assert engine.closed
    with pytest.raises(EngineClosedError):
        engine.submit([5, 6], long)
    gate.open()
    for handle in handles:
        output = handle.result(timeout=HANG_GUARD_S)
        assert output.finished and output.outputs[0].finish_reason == "abort"
        assert len(output.token_ids) <= 1, "one step ran: the one held at the gate"
    engine.shutdown(timeout=HANG_GUARD_S)
    assert not engine._state.thread.is_alive()
    assert engine.core.scheduler.num_free_blocks == 128, "every block returned"


def test_drain_finishes_everything_submitted(weights):
    engine = make_engine(weights, num_blocks=128)
    handles = [engine.submit(p, SamplingParams(max_tokens=3, **GREEDY)) for p in prompts(seed=6, count=4)]
    engine.shutdown(drain=True)
    assert all(h.done() and len(h.result().token_ids) == 3 for h in handles)


def test_back_pressure_bounds_the_waiting_queue(weights):
    """One request running (held at the gate, so it cannot finish whatever the machine's speed),
    one waiting: a third submission times out; once the gate opens, a blocked one gets in."""
    engine, gate = gated_engine(weights, num_blocks=64, max_num_seqs=1, max_waiting=1)
    slow = SamplingParams(max_tokens=5, **GREEDY)
    running = engine.submit([5, 6, 7], slow)
    gate.held()
    waiting = engine.submit([8, 9], slow)
    with pytest.raises(EngineOverloadedError):
        engine.submit([10, 11], slow, timeout=0.05)  # nothing can leave the queue meanwhile
    assert engine.core.scheduler.num_waiting == 1
    late: list = []
    blocked = threading.Thread(target=lambda: late.append(engine.submit([10, 11], slow)), daemon=True)
    blocked.start()  # waits for room, however long it takes
    gate.open()
    blocked.join(HANG_GUARD_S)
    assert late, "the blocked submission never got in"
    outputs = [h.result(timeout=HANG_GUARD_S) for h in (running, waiting, late[0])]
    assert [len(o.token_ids) for o in outputs] == [5, 5, 5]
    engine.shutdown()


@pytest.mark.parametrize(
    "prompt,error",
    [
        ([], InvalidArgumentError),
        ([1, 999_999], InvalidArgumentError),
        ([1.5], InvalidArgumentError),
        (list(range(3, 500)) * 20, InvalidArgumentError),
    ],
)
def test_bad_prompts_raise_at_submit(weights, prompt, error):
    with make_engine(weights, num_blocks=64) as engine:
        with pytest.raises(error):
            engine.submit(prompt)


def test_duplicate_request_id_is_refused(weights):
    engine, gate = gated_engine(weights, num_blocks=64)
    first = engine.submit([5, 6], SamplingParams(max_tokens=50, **GREEDY), request_id="same")
    with pytest.raises(DuplicateSequenceError):  # the gate is closed: "same" is still in flight
        engine.submit([5, 6], request_id="same")
    engine.abort("same")
    gate.open()
    assert first.result(timeout=HANG_GUARD_S).outputs[0].finish_reason == "abort"
    engine.shutdown()


def test_request_metrics_are_consistent(weights):
    with make_engine(weights, num_blocks=64) as engine:
        (output,) = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=5, **GREEDY))
    m = output.metrics
    assert m.num_output_tokens == 5
    assert 0 < m.ttft <= m.e2e_latency
    assert m.tpot == pytest.approx((m.finished_time - m.first_token_time) / 4)


def test_every_scheduler_option_is_an_engine_option_with_the_schedulers_default(weights, monkeypatch):
    """One list of the scheduler's options: EngineConfig's fields, passed on by name. An option
    added to the core without a field here (aging_steps was missing) fails this test."""
    import pagedkv.engine.core as core_module
    from pagedkv._core import SCHEDULER_DEFAULTS, Scheduler

    defaults = EngineConfig()
    assert {name: getattr(defaults, name) for name in SCHEDULER_DEFAULTS} == SCHEDULER_DEFAULTS
    given: dict = {}

    def recording(**options):
        given.update(options)
        return Scheduler(**options)

    monkeypatch.setattr(core_module, "Scheduler", recording)
    config = EngineConfig(num_blocks=32, policy="priority", aging_steps=7, max_num_seqs=3, kv_dtype="float16")
    EngineCore(PagedModelRunner(LlamaModel(weights), kv_dtype=config.kv_dtype), config)
    expected = {name: getattr(config, name) for name in SCHEDULER_DEFAULTS.keys() - {"kv_dtype"}}
    assert {name: given[name] for name in expected} == expected
    assert (given["num_blocks"], given["kv_spec"].dtype) == (32, "float16")
