"""KV storage: every row written is read back exactly through the block table, copy ops, dtypes,
and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import BlockManager, InvalidArgumentError, KVCache, ShapeError

LAYERS, BLOCKS, BS, HEADS, DIM = 2, 64, 4, 2, 8


def rows(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal((n, HEADS, DIM), dtype=np.float32)


@pytest.mark.parametrize("dtype,tol", [("float32", 0.0), ("float16", 1e-3), ("bfloat16", 8e-3)])
def test_every_row_written_is_read_back_through_the_block_table(dtype, tol):
    rng = np.random.default_rng(0)
    m = BlockManager(num_blocks=BLOCKS, block_size=BS)
    cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM, dtype=dtype)
    written = {}
    for seq in range(10):
        n = int(rng.integers(1, 20))
        m.allocate(seq, list(rng.integers(0, 1000, n)))
        slots = m.slot_mapping([seq], [n])
        for layer in range(LAYERS):
            k, v = rows(rng, n), rows(rng, n)
            cache.write(layer, k, v, slots)
            written[seq, layer] = (k, v)
    for (seq, layer), (k, v) in written.items():
        got_k, got_v = cache.gather(layer, m.block_table(seq).tolist(), m.num_tokens(seq))
        np.testing.assert_allclose(got_k, k, rtol=tol, atol=tol)
        np.testing.assert_allclose(got_v, v, rtol=tol, atol=tol)
        if dtype == "float32":
            assert np.array_equal(got_k, k) and np.array_equal(got_v, v)


def test_copy_on_write_op_copies_the_shared_tail_in_every_layer():
    rng = np.random.default_rng(1)
    m = BlockManager(num_blocks=BLOCKS, block_size=BS)
    cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM)
    m.allocate(1, [1, 2, 3, 4, 5, 6])
    for layer in range(LAYERS):
        cache.write(layer, rows(rng, 6), rows(rng, 6), m.slot_mapping([1], [6]))
    m.fork(1, 2)
    src, dst = m.append(2, [7])
    cache.copy_blocks([(src, dst)])
    new = rows(rng, 1)
    cache.write(0, new, new, m.slot_mapping([2], [1]))
    parent_k, _ = cache.gather(0, m.block_table(1).tolist(), 6)
    child_k, _ = cache.gather(0, m.block_table(2).tolist(), 7)
    assert np.array_equal(child_k[:6], parent_k)
    assert np.array_equal(child_k[6], new[0])
    for layer in range(LAYERS):
        assert np.array_equal(cache.gather(layer, m.block_table(2).tolist(), 6)[1], cache.gather(layer, m.block_table(1).tolist(), 6)[1])


def test_properties_and_size():
    cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM, dtype="bfloat16")
    assert (cache.num_layers, cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim) == (LAYERS, BLOCKS, BS, HEADS, DIM)
    assert cache.dtype == "bfloat16"
    assert cache.nbytes == 2 * LAYERS * BLOCKS * BS * HEADS * DIM * 2


@pytest.mark.parametrize(
    "call,error",
    [
        (lambda c, k, s: c.write(0, k.astype(np.float64), k, s), ShapeError),
        (lambda c, k, s: c.write(0, k[:, :1], k[:, :1], s), ShapeError),
        (lambda c, k, s: c.write(0, k, k, s[:1]), ShapeError),
        (lambda c, k, s: c.write(0, k, k, s.astype(np.int32)), ShapeError),
        (lambda c, k, s: c.write(0, k, k, [0, 1]), ShapeError),
        (lambda c, k, s: c.write(5, k, k, s), InvalidArgumentError),
        (lambda c, k, s: c.write(-1, k, k, s), InvalidArgumentError),
        (lambda c, k, s: c.write(0, k, k, s + BLOCKS * BS), InvalidArgumentError),
        (lambda c, k, s: c.write(0, k, np.full_like(k, np.nan), s), InvalidArgumentError),
        (lambda c, k, s: c.copy_blocks([(0, BLOCKS)]), InvalidArgumentError),
        (lambda c, k, s: c.copy_blocks([(-1, 0)]), InvalidArgumentError),
        (lambda c, k, s: c.gather(0, [0], BS + 1), InvalidArgumentError),
        (lambda c, k, s: c.gather(0, [BLOCKS], 1), InvalidArgumentError),
    ],
)
def test_bad_input_is_rejected_without_writing(call, error):
    rng = np.random.default_rng(2)
    cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM)
    k = rows(rng, 2)
    slots = np.array([0, 1], dtype=np.int64)
    cache.write(0, k, k, slots)
    with pytest.raises(error):
        call(cache, rows(rng, 2), slots)
    assert np.array_equal(cache.gather(0, [0], 2)[0], k)


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(head_dim=-1), dict(dtype="int8")])
def test_bad_construction(bad):
    args = dict(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=8) | bad
    with pytest.raises(InvalidArgumentError):
        KVCache(**args)
