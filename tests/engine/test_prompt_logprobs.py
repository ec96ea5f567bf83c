"""Prompt logprobs (issue 21): each prompt token's log-probability given the tokens before it,
computed as the prompt's prefill runs, equal to a dense forward pass over the prompt whatever the
chunking, the batch or the prefix cache did; refused where they cannot be computed."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import InvalidArgumentError, SamplingParams
from pagedkv.engine import EngineConfig, EngineCore, PagedModelRunner, SimulatedRunner, VirtualClock
from pagedkv.models import LlamaModel, SimulatedModel
from support.engines import make_engine
from support.prefill import prefill_logits


def log_softmax(logits: np.ndarray) -> np.ndarray:
    peak = logits.max(axis=1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(axis=1, keepdims=True))


@pytest.mark.parametrize("budget", [8, 64, 2048])  # prefill in 13 chunks, 2, or whole
def test_prompt_logprobs_equal_a_dense_forward_pass_however_the_prefill_is_chunked(weights, budget):
    prompt = [int(t) for t in np.random.default_rng(budget).integers(3, 200, size=100)]
    expected = log_softmax(prefill_logits(LlamaModel(weights), prompt))
    with make_engine(weights, max_num_batched_tokens=budget, num_blocks=64) as engine:
        others = [engine.submit(list(range(5, 40)), SamplingParams(max_tokens=8)) for _ in range(3)]  # share the batch
        output = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
        for handle in others:
            handle.result(timeout=60)
    scores = output.prompt_logprobs
    assert scores is not None and len(scores) == len(prompt) and scores[0] is None
    for position, entry in enumerate(scores[1:], start=1):
        assert entry is not None and entry.token_id == prompt[position]
        assert entry.logprob == pytest.approx(float(expected[position - 1, prompt[position]]), abs=1e-4)
        top_ids = [t for t, _ in entry.top]
        assert len(top_ids) == 3 and top_ids[0] == int(expected[position - 1].argmax())
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


def test_a_cached_prefix_is_recomputed_for_scoring_and_others_still_share_theirs(weights):
    prompt = list(range(10, 74))  # 4 full blocks
    with make_engine(weights, num_blocks=64) as engine:
        engine.generate([prompt], SamplingParams(max_tokens=1))  # caches the prompt's blocks
        cached = engine.generate([prompt], SamplingParams(max_tokens=1))[0]
        scored = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        again = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    assert cached.num_cached_tokens == 48 and scored.num_cached_tokens == again.num_cached_tokens == 0
    assert [e.logprob for e in scored.prompt_logprobs[1:]] == [e.logprob for e in again.prompt_logprobs[1:]]
    assert all(e.top == () for e in scored.prompt_logprobs[1:])  # prompt_logprobs=0: the token's own only


def test_requests_without_prompt_logprobs_report_none_and_bad_values_are_refused(weights):
    with make_engine(weights, num_blocks=64) as engine:
        assert engine.generate(["plain"], SamplingParams(max_tokens=1))[0].prompt_logprobs is None
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    core = EngineCore(SimulatedRunner(SimulatedModel(), VirtualClock()), EngineConfig(num_blocks=16))
    with pytest.raises(InvalidArgumentError, match="prompt_logprobs"):
        core.add_request("r", [1, 2, 3], SamplingParams(prompt_logprobs=1))
    assert not core.has_unfinished()
    assert PagedModelRunner(LlamaModel(weights)).scores_prompts
