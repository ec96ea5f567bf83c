"""The quantized GGUF formats pagedkv reads, held to scalar transcriptions of ggml's
``dequantize_row_*`` (ggml-quants.c), written here from the block layouts: the loader dequantizes
with the ``gguf`` package's vectorized code, and these references say it reads each format as
llama.cpp does. Random blocks of every supported quantized type, then real blocks of each type
Gemma 3's Q4_K_M file holds.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from pagedkv.loaders.gguf_file import SUPPORTED_TYPES, read_gguf
from pagedkv.loaders.registry import locate_registered


def f16(raw: bytes | np.ndarray, at: int) -> float:
    return float(np.frombuffer(bytes(raw[at : at + 2]), np.float16)[0])


def q4_0(b: np.ndarray) -> list[float]:
    d = f16(b, 0)
    qs = b[2:18]
    return [d * ((int(q) & 0xF) - 8) for q in qs] + [d * ((int(q) >> 4) - 8) for q in qs]


def q4_1(b: np.ndarray) -> list[float]:
    d, m = f16(b, 0), f16(b, 2)
    qs = b[4:20]
    return [d * (int(q) & 0xF) + m for q in qs] + [d * (int(q) >> 4) + m for q in qs]


def q5_0(b: np.ndarray) -> list[float]:
    d = f16(b, 0)
    qh = int.from_bytes(bytes(b[2:6]), "little")
    qs = b[6:22]
    low = [d * (((int(qs[j]) & 0xF) | (((qh >> j) << 4) & 0x10)) - 16) for j in range(16)]
    high = [d * (((int(qs[j]) >> 4) | ((qh >> (j + 12)) & 0x10)) - 16) for j in range(16)]
    return low + high


def q5_1(b: np.ndarray) -> list[float]:
    d, m = f16(b, 0), f16(b, 2)
    qh = int.from_bytes(bytes(b[4:8]), "little")
    qs = b[8:24]
    low = [d * ((int(qs[j]) & 0xF) | (((qh >> j) << 4) & 0x10)) + m for j in range(16)]
    high = [d * ((int(qs[j]) >> 4) | ((qh >> (j + 12)) & 0x10)) + m for j in range(16)]
    return low + high


def q8_0(b: np.ndarray) -> list[float]:
    d = f16(b, 0)
    return [d * int(q) for q in b[2:34].view(np.int8)]


def scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    """The 6-bit scale and min of sub-block ``j`` packed in a K-quant's 12 scale bytes."""
    q = [int(x) for x in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def q4_k(b: np.ndarray) -> list[float]:
    d, dmin = f16(b, 0), f16(b, 2)
    scales, qs = b[4:16], b[16:144]
    out: list[float] = []
    for chunk in range(4):  # 64 weights: two sub-blocks of 32, low then high nibbles
        q = qs[32 * chunk : 32 * chunk + 32]
        for sub, shift in ((2 * chunk, 0), (2 * chunk + 1, 4)):
            sc, m = scale_min_k4(sub, scales)
            out += [d * sc * ((int(x) >> shift) & 0xF) - dmin * m for x in q]
    return out


def q5_k(b: np.ndarray) -> list[float]:
    d, dmin = f16(b, 0), f16(b, 2)
    scales, qh, qs = b[4:16], b[16:48], b[48:176]
    out: list[float] = []
    for chunk in range(4):
        q = qs[32 * chunk : 32 * chunk + 32]
        for half, shift in ((0, 0), (1, 4)):
            sub = 2 * chunk + half
            sc, m = scale_min_k4(sub, scales)
            bit = 1 << sub
            out += [d * sc * (((int(x) >> shift) & 0xF) + (16 if int(h) & bit else 0)) - dmin * m
                    for x, h in zip(q, qh, strict=True)]
    return out


def q6_k(b: np.ndarray) -> list[float]:
    ql, qh, scales, d = b[0:128], b[128:192], b[192:208].view(np.int8), f16(b, 208)
    out = [0.0] * 256
    for half in range(2):  # 128 weights each: ql 64 bytes, qh 32 bytes, 8 scales
        l_, h_, s_ = ql[64 * half :], qh[32 * half :], scales[8 * half :]
        for i in range(32):
            lo0, lo1, hi = int(l_[i]), int(l_[i + 32]), int(h_[i])
            quads = ((lo0 & 0xF) | ((hi & 3) << 4), (lo1 & 0xF) | (((hi >> 2) & 3) << 4),
                     (lo0 >> 4) | (((hi >> 4) & 3) << 4), (lo1 >> 4) | (((hi >> 6) & 3) << 4))
            for k, q in enumerate(quads):
                out[128 * half + 32 * k + i] = d * int(s_[i // 16 + 2 * k]) * (q - 32)
    return out


REFERENCES = {Q.Q4_0: q4_0, Q.Q4_1: q4_1, Q.Q5_0: q5_0, Q.Q5_1: q5_1, Q.Q8_0: q8_0,
              Q.Q4_K: q4_k, Q.Q5_K: q5_k, Q.Q6_K: q6_k}


def reference(raw: np.ndarray, kind: Q) -> np.ndarray:
    block_bytes = GGML_QUANT_SIZES[kind][1]
    return np.array([x for b in raw.reshape(-1, block_bytes) for x in REFERENCES[kind](b)], np.float64)


def random_blocks(kind: Q, count: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes, each float16 field a finite value in [-2, 2] (where it sits in the block)."""
    block_bytes = GGML_QUANT_SIZES[kind][1]
    raw = rng.integers(0, 256, (count, block_bytes), dtype=np.uint8)
    fields = {Q.Q6_K: [208], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2]}.get(kind, [0])
    for at in fields:
        raw[:, at : at + 2] = rng.uniform(-2, 2, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    return raw


def test_every_supported_quantized_type_has_a_reference():
    quantized = {t for t in SUPPORTED_TYPES if t not in (Q.F32, Q.F16, Q.BF16)}
    assert quantized == set(REFERENCES)


@pytest.mark.parametrize("kind", list(REFERENCES), ids=lambda k: k.name)
def test_random_blocks_dequantize_as_ggml_does(kind):
    raw = random_blocks(kind, 24, np.random.default_rng(int(kind)))
    got = quants.dequantize(raw, kind).astype(np.float64).ravel()
    np.testing.assert_allclose(got, reference(raw, kind), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def gemma3_file():
    return read_gguf(locate_registered("gemma3-270m"))


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_0, Q.Q6_K, Q.Q8_0], ids=lambda k: k.name)
def test_the_real_blocks_of_gemma3_dequantize_as_ggml_does(gemma3_file, kind):
    name, tensor = next((n, t) for n, t in gemma3_file.tensors.items() if t.type == kind and n.startswith("blk."))
    block_bytes = GGML_QUANT_SIZES[kind][1]
    with gemma3_file.file.open() as f:
        f.seek(tensor.offset)
        raw = np.frombuffer(f.read(block_bytes * 16), np.uint8).reshape(16, block_bytes)
    got = quants.dequantize(raw, kind).astype(np.float64).ravel()
    np.testing.assert_allclose(got, reference(raw, kind), rtol=1e-6, atol=1e-7, err_msg=name)
