"""Faults in the engine (issue 10): non-finite logits fail one request alone, a failing model
closes the engine in its documented state, and every end-of-sequence id stops generation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pagedkv import InvalidArgumentError, ModelError, SamplingParams, _core
from pagedkv.engine import Engine, EngineClosedError, EngineConfig, EngineCore, PagedModelRunner
from pagedkv.loaders import load_tokenizer
from pagedkv.models import LlamaModel
from pagedkv.sampling import NO_TOKEN, sample
from support.engines import GREEDY, PoisonedModel, make_engine, poisoned_engine
from support.gated_model import HANG_GUARD_S, gated_engine

INF, NAN = np.inf, np.nan


def draws(row: list[float], count: int = 200, **params) -> set[int]:
    logits = np.tile(np.array(row, dtype=np.float32), (count, 1))
    p = SamplingParams(**params)
    return set(sample(logits, [p] * count, [np.random.default_rng(i) for i in range(count)]).tolist())


@pytest.mark.parametrize(
    "params", [dict(temperature=0.7), dict(temperature=0.7, top_k=2), dict(temperature=0.7, top_p=0.9), dict(temperature=0.0)]
)
def test_a_plus_inf_logit_is_the_token_drawn(params):
    """Item 22: +inf beats every finite logit; several +inf share the draw."""
    assert draws([0.0, 1.0, INF, 3.0], **params) == {2}
    both = draws([INF, 1.0, INF, 3.0], **params)
    assert both == ({0} if params["temperature"] == 0 else {0, 2})


@pytest.mark.parametrize(
    "params", [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=0.7, top_k=2), dict(temperature=0.7, top_p=0.5)]
)
@pytest.mark.parametrize("row", [[0.0, 1.0, NAN, 3.0], [NAN] * 4, [-INF] * 4], ids=["one-nan", "all-nan", "all-minus-inf"])
def test_a_row_with_nan_or_only_minus_inf_gives_no_token(params, row):
    """Item 22: never the NaN token, never token 0 by default: no token at all."""
    assert draws(row, count=5, **params) == {NO_TOKEN}


def test_nan_logits_fail_that_request_alone(weights):
    """Item 22 and the design: the NaN request fails with ModelError; the one beside it in the
    same batches finishes; the engine keeps serving and frees every block."""
    engine, _ = poisoned_engine(weights, num_blocks=64)
    with engine:
        good = engine.submit([5, 6, 7], SamplingParams(max_tokens=20, **GREEDY), request_id="good")
        bad = engine.submit([5, 6, 7], SamplingParams(max_tokens=20, n=2, temperature=0.7), request_id="nan-1")
        with pytest.raises(ModelError, match="nan-1"):
            bad.result(timeout=30)
        with pytest.raises(ModelError):
            next(iter(bad))  # the request has ended: the error is at hand
        assert bad.done() and len(good.result(timeout=30).token_ids) == 20
        assert len(engine.submit([8, 9], SamplingParams(max_tokens=3, **GREEDY)).result(timeout=30).token_ids) == 3
    assert engine.core.scheduler.num_free_blocks == 64


def test_a_failing_model_closes_the_engine_in_its_documented_state(weights):
    """The design: every request in flight fails with EngineClosedError caused by the model's
    error, blocks are freed, submit raises EngineClosedError, stats and shutdown still work."""
    engine, model = poisoned_engine(weights, num_blocks=64, max_num_seqs=2)
    model.close()
    handles = [engine.submit([5, 6, 7 + i], SamplingParams(max_tokens=400, **GREEDY)) for i in range(4)]
    model.held()
    model.allow(1)  # the first step runs: two requests hold blocks and a token, two wait
    model.held()
    model.fail = True  # the second fails
    model.open()
    for handle in handles:
        with pytest.raises(EngineClosedError) as caught:
            handle.result(timeout=30)
        assert isinstance(caught.value.__cause__, RuntimeError)
    with pytest.raises(EngineClosedError):
        engine.submit([5, 6])
    assert engine.closed
    assert engine.stats()["num_unfinished_requests"] == 0
    assert engine.core.scheduler.num_free_blocks == 64
    engine.shutdown(timeout=10)
    assert not engine._state.thread.is_alive()


def test_a_runner_failure_completes_the_protocol_of_the_core(weights):
    """Item 1: the step the model failed in is updated (its requests aborted), so the core can
    step again."""
    model = PoisonedModel(LlamaModel(weights))
    core = EngineCore(PagedModelRunner(model), EngineConfig(num_blocks=64))
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY))
    model.fail = True
    with pytest.raises(RuntimeError, match="broke"):
        core.step()
    assert not core.has_unfinished() and core.scheduler.num_free_blocks == 64
    model.fail = False
    core.add_request("b", [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY))
    while core.has_unfinished():
        core.step()


def test_every_eos_id_stops_generation(weights):
    """Item 11: a model with eos ids (2, t) stops at t, which is not its first eos id."""
    prompt = [5, 6, 7]
    with make_engine(weights, num_blocks=64) as engine:
        free = engine.submit(prompt, SamplingParams(max_tokens=12, **GREEDY)).result(timeout=30).token_ids
    stop_at = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i] and 2 not in free[: i + 1])
    eos = free[stop_at]
    two_eos = dataclasses.replace(weights, config=dataclasses.replace(weights.config, eos_token_ids=(2, eos)))
    model = LlamaModel(two_eos)
    with Engine(model, load_tokenizer(None, model.config.vocab_size), EngineConfig(num_blocks=64)) as engine:
        output = engine.submit(prompt, SamplingParams(max_tokens=12, temperature=0.0)).result(timeout=30)
        ignoring = engine.submit(prompt, SamplingParams(max_tokens=12, **GREEDY)).result(timeout=30)
    assert output.token_ids == free[: stop_at + 1]
    assert output.outputs[0].finish_reason == "stop"
    assert ignoring.token_ids == free


def test_a_top_k_past_the_kernels_range_is_served_and_the_engine_stays_open(weights):
    """Issue 23 item 1: top_k = 2**32 - 1 passed every check, then the sampling kernel refused it
    mid-step and the engine closed for good. It keeps all tokens, as top_k = 0 does."""
    huge = SamplingParams(max_tokens=6, temperature=0.8, seed=3, top_k=4294967295, ignore_eos=True)
    with make_engine(weights, num_blocks=64) as engine:
        output = engine.submit([5, 6, 7], huge).result(timeout=30)
        plain = engine.submit([5, 6, 7], dataclasses.replace(huge, top_k=0)).result(timeout=30)
        assert output.token_ids == plain.token_ids and len(output.token_ids) == 6
        assert not engine.closed


def test_a_row_the_sampling_kernel_refuses_fails_its_request_alone(weights, monkeypatch):
    """Issue 23 item 1, defence in depth: should the kernel refuse a row anyway, the batch is
    sampled row by row and only that row's request fails (ModelError); the one sharing its step
    finishes and the engine keeps serving."""
    real = _core.sample_rows
    calls: list[tuple[int, bool]] = []  # (rows, whether the marked row is among them)

    def refusing(logits, table, *rest):
        marked = bool((table[:, 0] == 0.625).any())  # the refused request's temperature
        calls.append((len(table), marked))
        if marked:
            raise InvalidArgumentError("refused for the test")
        return real(logits, table, *rest)

    monkeypatch.setattr(_core, "sample_rows", refusing)
    engine, gate = gated_engine(weights, num_blocks=64)
    good = engine.submit([5, 6, 7], SamplingParams(max_tokens=8, **GREEDY))
    gate.held()  # good's first step waits: bad is scheduled beside it in the next
    bad = engine.submit([8, 9], SamplingParams(max_tokens=8, temperature=0.625, ignore_eos=True))
    gate.open()
    with pytest.raises(ModelError, match="refused for the test"):
        bad.result(timeout=HANG_GUARD_S)
    assert len(good.result(timeout=HANG_GUARD_S).token_ids) == 8
    assert (2, True) in calls, "the two requests shared a refused batch"
    assert not engine.closed
    assert len(engine.submit([8, 9], SamplingParams(max_tokens=3, **GREEDY)).result(timeout=30).token_ids) == 3
    engine.shutdown()
    assert engine.core.scheduler.num_free_blocks == 64
