"""pagedkv._core.Linear kept in GGUF's quantized formats, against the ``gguf`` package (the one
maintained with llama.cpp): rows dequantize bit-exactly as it does, and the product on every
kernel this CPU runs is within the rounding of the activations' int8 quantization of the float
product over those rows (the bound stated in ``Linear``'s doc); typed errors for bad input."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from pagedkv import InvalidArgumentError, ShapeError
from pagedkv._core import Linear

FORMATS = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q4_k": Q.Q4_K, "q6_k": Q.Q6_K}
# Byte offsets of each block's f16 scales: random bytes there could be inf or NaN.
F16_FIELDS = {"q8_0": [0], "q4_0": [0], "q5_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q6_k": [208]}


def random_rows(name: str, rows: int, k: int, seed: int) -> np.ndarray:
    """``rows`` rows of ``k`` weights in format ``name``: random bytes, finite scales near 1/64."""
    elems, nbytes = GGML_QUANT_SIZES[FORMATS[name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // elems, nbytes), dtype=np.uint8)
    for at in F16_FIELDS[name]:
        scales = (rng.uniform(-1, 1, (rows, k // elems)) / 64).astype(np.float16)
        raw[:, :, at : at + 2] = scales[..., None].view(np.uint8).reshape(rows, k // elems, 2)
    return raw.reshape(rows, -1)


def dequantized(name: str, raw: np.ndarray) -> np.ndarray:
    return quants.dequantize(raw, FORMATS[name])


@pytest.mark.parametrize("name", FORMATS)
def test_rows_dequantize_bit_exactly_as_gguf_does(name: str) -> None:
    raw = random_rows(name, 7, 512, seed=1)
    linear = Linear.quantized(512, [(name, raw)])
    assert (linear.in_features, linear.out_features, linear.dtype, linear.nbytes) == (512, 7, name, raw.nbytes)
    ours = linear.dequantize_rows(np.arange(7))
    theirs = dequantized(name, raw)
    assert ours.dtype == np.float32
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # bit for bit, signs of zero too
    assert np.array_equal(linear.dequantize_rows(np.array([6, 0, 6])), theirs[[6, 0, 6]])


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8, 13, 70])
def test_every_kernel_is_within_the_activation_rounding_of_the_float_product(name: str, m: int) -> None:
    k, n = 512, 37
    raw = random_rows(name, n, k, seed=m)
    w = dequantized(name, raw).astype(np.float64)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32) * 2
    exact = x.astype(np.float64) @ w.T
    # Each block of 32 activations is off by at most half its scale, max|x|/127.
    half_step = np.abs(x.reshape(m, k // 32, 32)).max(axis=2) / 127 / 2
    bound = half_step @ np.abs(w).reshape(n, k // 32, 32).sum(axis=2).T
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(w).T
    linear = Linear.quantized(k, [(name, raw)])
    results = {kernel: linear(x, kernel=kernel) for kernel in linear.kernels}
    assert linear.kernels[-1] == "portable"
    for kernel, y in results.items():
        assert y.shape == (m, n) and y.dtype == np.float32
        assert np.all(np.abs(y - exact) <= bound * (1 + 1e-4) + 1e-4), kernel
        # The paths differ only in the order of their float32 additions: a few ulps of the terms;
        # but avx512bf16's prompts (64 rows or more) run on bf16 pairs, x and w rounded by 2⁻⁹ each.
        paired = kernel == "avx512bf16" and m >= 64
        assert np.all(np.abs(y - results["portable"]) <= (2**-8 if paired else 1e-5) * magnitude + 1e-6), kernel
    np.testing.assert_array_equal(linear(x), results[linear.kernels[0]])


def test_a_fused_weight_of_mixed_formats_is_its_parts_side_by_side() -> None:
    parts = [("q5_0", random_rows("q5_0", 4, 256, 1)), ("q8_0", random_rows("q8_0", 2, 256, 2)),
             ("q6_k", random_rows("q6_k", 3, 256, 3))]
    fused = Linear.quantized(256, parts)
    assert fused.dtype == "q5_0+q8_0+q6_k" and fused.out_features == 9
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    alone = np.concatenate([Linear.quantized(256, [part])(x) for part in parts], axis=1)
    np.testing.assert_array_equal(fused(x), alone)


def test_bad_input_is_a_typed_error() -> None:
    raw = random_rows("q4_1", 2, 64, 0)
    with pytest.raises(InvalidArgumentError, match="q3_k"):
        Linear.quantized(64, [("q3_k", raw)])
    with pytest.raises(ShapeError):
        Linear.quantized(64, [("q4_1", raw[:, :30])])  # not whole rows
    with pytest.raises(ShapeError):
        Linear.quantized(64, [("q4_k", raw)])  # 64 weights are not whole blocks of 256
    with pytest.raises(ShapeError):
        Linear.quantized(64, [("q4_1", raw.astype(np.int16))])
    linear = Linear.quantized(64, [("q4_1", raw)])
    with pytest.raises(ShapeError):
        linear(np.zeros((1, 63), np.float32))
    with pytest.raises(InvalidArgumentError):
        linear.dequantize_rows(np.array([2]))
    with pytest.raises(InvalidArgumentError):
        linear.dequantize_rows(np.array([-1]))
    with pytest.raises(InvalidArgumentError):
        linear(np.zeros((1, 64), np.float32), kernel="avx512")  # a float-weight kernel
    with pytest.raises(InvalidArgumentError):
        Linear(np.ones((2, 2), np.float32)).dequantize_rows(np.array([0]))
