"""The registry's GGUF files run as shipped (``weight_dtype="auto"``): SmolLM2's Q4_1 projections
and Q8_0 embedding, Gemma 3's Q4_K_M mix (Q4_K, Q5_0, Q6_K, Q8_0, a fused ``[q|k|v]`` of two
formats) stay quantized, the embedding is gathered from the tied lm_head's own rows, and the
teacher-forced logits stay near those of the same file dequantized to float32.

The bound: the quantized products round each block of 32 activations to int8 (as llama.cpp does
for these formats), so logits move. Measured on the text below (27 and 28 positions): max
|Δlogit| 1.23 (SmolLM2) and 1.25 (Gemma 3), RMS 0.24 and 0.15; the top token differs at 2 of
SmolLM2's positions, where the float32 model's top two were 0.25 and 0.004 apart. The tests allow
max 2.5, RMS 0.5, and the same top token wherever the float32 model's margin exceeds 0.5.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import quants

from pagedkv.engine import Engine
from pagedkv.loaders.gguf import stream_gguf
from pagedkv.loaders.registry import load_model, locate_registered
from pagedkv.models.layers import QuantizedTensor, embedding_of
from pagedkv.sampling import SamplingParams
from support.prefill import prefill_logits

TEXT = ("The capital of France is Paris. The capital of Germany is Berlin. Water boils at one hundred degrees, "
        "and the capital of Italy is")
FORMATS = {"smollm2-135m": {"q4_1", "q8_0"}, "gemma3-270m": {"q4_k", "q5_0", "q6_k", "q8_0", "q5_0+q8_0"}}


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def models(request):
    auto, tokenizer = load_model(request.param, weight_dtype="auto")
    exact, _ = load_model(request.param, weight_dtype="float32")
    return request.param, auto, exact, tokenizer


def test_projections_stay_in_the_files_formats_at_a_fraction_of_the_bytes(models) -> None:
    name, auto, exact, _ = models
    assert {linear.dtype for linear in auto.linears()} == FORMATS[name]
    assert auto.weight_dtype == "auto"
    # The float32 model holds ~4 bytes per weight and its embedding twice; Q4/Q8 hold 0.56-1.06.
    assert auto.nbytes < 0.25 * exact.nbytes
    assert auto.projection_nbytes < 0.3 * exact.projection_nbytes


def test_teacher_forced_logits_stay_near_the_dequantized_models(models) -> None:
    _, auto, exact, tokenizer = models
    ids = tokenizer.encode(TEXT)
    quantized, reference = prefill_logits(auto, ids), prefill_logits(exact, ids)
    difference = quantized - reference
    assert np.abs(difference).max() <= 2.5 and np.sqrt(np.mean(difference**2)) <= 0.5
    top_two = np.sort(reference, axis=1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 0.5
    assert clear.sum() >= len(ids) // 2
    assert np.array_equal(quantized.argmax(axis=1)[clear], reference.argmax(axis=1)[clear])


def test_the_embedding_gathers_the_files_rows_bit_exactly() -> None:
    path = locate_registered("smollm2-135m")
    _, _, tensors = stream_gguf(path, keep_quantized=True)
    table = next(t for n, t in tensors if n == "model.embed_tokens.weight")
    assert isinstance(table, QuantizedTensor) and table.format == "q8_0"
    ids = np.array([0, 5, 49151, 5])
    rows = embedding_of(table)[0](ids)
    expected = quants.dequantize(table.rows[ids], quants.GGMLQuantizationType.Q8_0)
    assert np.array_equal(rows, expected)


def test_an_engine_serves_the_file_as_shipped() -> None:
    engine = Engine.from_pretrained("smollm2-135m", weight_dtype="auto")
    try:
        outputs = engine.generate(["The capital of France is", "1, 2, 3, 4,"],
                                  SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    finally:
        engine.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8]
    assert " Paris" in outputs[0].outputs[0].text
