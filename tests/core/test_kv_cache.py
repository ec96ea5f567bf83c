"""KV storage: every row written is read back exactly through the block table, copy ops, dtypes,
array layouts, sizes, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pagedkv import BlockManager, InvalidArgumentError, KVCache, Scheduler, ShapeError
from support.array_layouts import layouts

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
        assert np.array_equal(
            cache.gather(layer, m.block_table(2).tolist(), 6)[1], cache.gather(layer, m.block_table(1).tolist(), 6)[1]
        )


def test_properties_and_size():
    cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM, dtype="bfloat16")
    assert (cache.num_layers, cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim) == (
        LAYERS,
        BLOCKS,
        BS,
        HEADS,
        DIM,
    )
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


# --- every layout, every form of ids and pairs (issue 10: items 3, 14, 15) --------------------


@pytest.mark.parametrize("argument", ["keys", "values", "slot_mapping"])
def test_write_reads_every_array_layout_in_index_order(argument):
    rng = np.random.default_rng(3)
    args = {"keys": rows(rng, 5), "values": rows(rng, 5), "slot_mapping": np.array([9, 2, 7, 0, 4], np.int64)}
    expected = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM)
    expected.write(1, **args)
    table = list(range(3))
    for name, variant in layouts(args[argument]).items():
        cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM)
        cache.write(1, **(args | {argument: variant}))
        for got, want in zip(cache.gather(1, table, 3 * BS), expected.gather(1, table, 3 * BS), strict=True):
            assert np.array_equal(got, want), name


def filled_cache(rng: np.random.Generator) -> tuple[KVCache, np.ndarray]:
    """A cache whose every slot of layer 0 holds distinct rows, and those rows by slot."""
    cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM)
    k = rows(rng, BLOCKS * BS)
    cache.write(0, k, k, np.arange(BLOCKS * BS, dtype=np.int64))
    return cache, k


def block_rows(k: np.ndarray, block: int) -> np.ndarray:
    return k[block * BS : (block + 1) * BS]


def test_readme_loop_applies_copy_ops_and_gathers_through_padded_block_tables():
    # The README's loop: a step's int64 [C, 2] copy_ops go straight to copy_blocks, and each row of
    # its block_tables (-1 past the used blocks) straight to gather.
    rng = np.random.default_rng(4)
    sched = Scheduler(num_blocks=BLOCKS, block_size=BS)
    cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM)
    sched.add_request("forked", list(range(2 * BS + 1)), max_tokens=3, n=2)
    sched.add_request("short", [1, 2], max_tokens=3)
    written: dict[tuple[str, int], list[np.ndarray]] = {}
    saw_copies = saw_padding = False
    for _ in range(3):
        step = sched.schedule()
        saw_copies |= len(step.copy_ops) > 0
        cache.copy_blocks(step.copy_ops)
        k = rows(rng, len(step.input_ids))
        cache.write(0, k, k, step.slot_mapping)
        starts = step.query_start_loc
        keys = list(zip(step.request_ids, step.seq_indices.tolist(), strict=True))
        before = {key: list(written.get(key) or written.get((key[0], 0), [])) for key in keys}
        for i, (rid, seq) in enumerate(keys):  # a fork starts from its parent's rows
            written[rid, seq] = before[rid, seq] + list(k[starts[i] : starts[i + 1]])
            table = step.block_tables[i]
            saw_padding |= bool((table == -1).any())
            got_k, got_v = cache.gather(0, table, int(step.context_lens[i]))
            assert np.array_equal(got_k, np.stack(written[rid, seq])), (rid, seq)
            assert np.array_equal(got_v, got_k)
        sched.update(step, [5] * step.num_samples)
    assert saw_copies and saw_padding


@pytest.mark.parametrize(
    "form",
    [
        lambda ops: ops.tolist(),
        lambda ops: [tuple(op) for op in ops.tolist()],
        lambda ops: tuple(tuple(op) for op in ops.tolist()),
        lambda ops: ops,
        lambda ops: ops.astype(np.int32),
        *[lambda ops, name=name: layouts(ops)[name] for name in ["fortran", "strided", "reversed", "unaligned"]],
    ],
)
def test_copy_blocks_takes_pairs_as_an_array_in_any_layout_or_a_sequence(form):
    cache, k = filled_cache(np.random.default_rng(5))
    ops = np.array([[0, 1], [2, 3], [1, 5]], np.int64)  # in order: block 5 gets block 0's rows
    cache.copy_blocks(form(ops))
    got = cache.gather(0, list(range(6)), 6 * BS)[0]
    for block, source in [(0, 0), (1, 0), (2, 2), (3, 2), (4, 4), (5, 0)]:
        assert np.array_equal(block_rows(got, block), block_rows(k, source)), block


@pytest.mark.parametrize(
    "ops,error",
    [
        ([(0, 1, 2)], ShapeError),
        ([(0,)], ShapeError),
        (np.zeros((1, 3), np.int64), ShapeError),
        (np.zeros(2, np.int64), InvalidArgumentError),
        ("ab", InvalidArgumentError),
        (5, InvalidArgumentError),
        ([(0.5, 1)], InvalidArgumentError),
        (np.array([[0.0, 1.0]]), InvalidArgumentError),
        ([(0, 2**40)], InvalidArgumentError),
        ([(0, -1)], InvalidArgumentError),
        ([(0, 1), (0, BLOCKS)], InvalidArgumentError),  # the valid first op is not applied either
    ],
)
def test_malformed_copy_ops_raise_typed_errors_and_copy_nothing(ops, error):
    cache, k = filled_cache(np.random.default_rng(6))
    with pytest.raises(error):
        cache.copy_blocks(ops)
    assert np.array_equal(cache.gather(0, list(range(BLOCKS)), BLOCKS * BS)[0], k)


@pytest.mark.parametrize(
    "form",
    [
        lambda t: t.tolist(),
        lambda t: tuple(t.tolist()),
        lambda t: t,
        lambda t: t.astype(np.int64),
        *[lambda t, name=name: layouts(t)[name] for name in ["strided", "reversed", "unaligned"]],
    ],
)
def test_gather_reads_only_the_used_entries_of_a_padded_block_table(form):
    cache, k = filled_cache(np.random.default_rng(7))
    table = np.array([6, 3, -1, -1], np.int32)  # -1: the padding of a step's block_tables rows
    got_k, got_v = cache.gather(0, form(table), BS + 1)
    expected = np.concatenate([block_rows(k, 6), block_rows(k, 3)[:1]])
    assert np.array_equal(got_k, expected) and np.array_equal(got_v, expected)
    assert cache.gather(0, form(table), 0)[0].shape == (0, HEADS, DIM)


@pytest.mark.parametrize(
    "table,num_tokens,error",
    [
        ([6, -1], BS + 1, InvalidArgumentError),  # padding inside the used blocks
        ([6], BS + 1, InvalidArgumentError),
        ([2**40], 1, InvalidArgumentError),
        ([0.5], 1, InvalidArgumentError),
        ("ab", 1, InvalidArgumentError),
        (np.zeros((1, 1), np.int32), 1, InvalidArgumentError),
    ],
)
def test_gather_refuses_what_is_not_a_block_table(table, num_tokens, error):
    cache, _ = filled_cache(np.random.default_rng(8))
    with pytest.raises(error):
        cache.gather(0, table, num_tokens)


# --- values the storage dtype cannot hold (issue 10: item 21) ---------------------------------


@pytest.mark.parametrize(
    "dtype,value,stored",
    [
        ("float16", 65504.0, 65504.0),
        ("float16", -65519.0, -65504.0),  # rounds to the largest finite float16
        ("float16", 65520.0, None),  # rounds to inf
        ("float16", -70000.0, None),
        ("float16", 1e38, None),
        ("bfloat16", -3.39e38, -3.3895313892515355e38),  # rounds to the largest finite bfloat16
        ("bfloat16", 3.4e38, None),
        ("float32", 3.4e38, 3.4e38),
        *[(dtype, x, None) for dtype in ["float32", "float16", "bfloat16"] for x in [np.inf, -np.inf, np.nan]],
    ],
)
def test_write_refuses_every_value_the_dtype_would_store_as_inf_or_nan(dtype, value, stored):
    # One rule: the cache stores finite values only, so a finite input it would round to inf is
    # refused like inf itself.
    cache = KVCache(1, 4, BS, HEADS, DIM, dtype=dtype)
    ones = np.ones((1, HEADS, DIM), np.float32)
    cache.write(0, ones, ones, np.array([0], np.int64))
    bad = ones.copy()
    bad[0, 1, 3] = value
    slot = np.array([0], np.int64)
    if stored is None:
        for keys, values in [(bad, ones), (ones, bad)]:
            with pytest.raises(InvalidArgumentError):
                cache.write(0, keys, values, slot)
            assert all(np.array_equal(x, ones) for x in cache.gather(0, [0], 1))
    else:
        cache.write(0, bad, bad, slot)
        got_k, got_v = cache.gather(0, [0], 1)
        assert got_k[0, 1, 3] == np.float32(stored) and np.array_equal(got_k, got_v)


# --- sizes (issue 10: items 4, 5) -------------------------------------------------------------


@pytest.mark.parametrize(
    "dims",
    [
        (1, 1, 4, 2**62, 1),  # num_kv_heads × block_size wraps to 0
        (1, 1, 2**63 - 1, 1, 1),
        (2**40, 2**30, 1, 1, 8),
        (1, 2**31, 2**31, 2**31, 1),
        (1, 2**31, 1, 1, 8),  # more blocks than int32 block tables address
        (1, 2**31, 16, 8, 128),
    ],
)
def test_sizes_whose_product_overflows_are_refused_at_construction(dims):
    with pytest.raises(InvalidArgumentError):
        KVCache(*dims, dtype="float16")


UNALLOCATABLE = """
import json, resource
import pagedkv
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
outcomes = {}
for name, make in [
    ("KVCache(1, 2**31 - 1, 16, 8, 128)", lambda: pagedkv.KVCache(1, 2**31 - 1, 16, 8, 128)),
    ("KVCache(4, 2**20, 16, 8, 128)", lambda: pagedkv.KVCache(4, 2**20, 16, 8, 128)),
    ("KVCache(2**40, 1, 1, 1, 8)", lambda: pagedkv.KVCache(2**40, 1, 1, 1, 8)),  # the layer list
    ("ContiguousKV(2**20, 8, 4096, 128)", lambda: pagedkv.ContiguousKV(2**20, 8, 4096, 128)),
    ("ReadBandwidthProbe(2**40)", lambda: pagedkv.ReadBandwidthProbe(2**40)),
    ("measure_read_bandwidth(2**40)", lambda: pagedkv.measure_read_bandwidth(2**40)),
]:
    try:
        make()
        outcomes[name] = "allocated"
    except BaseException as error:  # a PanicException is a BaseException
        outcomes[name] = type(error).__name__
# What failed was released: a cache of 1 GiB still fits under the cap.
outcomes["after"] = pagedkv.KVCache(1, 4096, 16, 8, 128).nbytes
print(json.dumps(outcomes))
"""


def test_sizes_that_cannot_be_allocated_raise_memory_error_under_a_4_gib_cap():
    result = subprocess.run([sys.executable, "-c", UNALLOCATABLE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]  # an abort would kill the process
    outcomes = json.loads(result.stdout)
    assert outcomes.pop("after") == 2 * 4096 * 16 * 8 * 128 * 4
    assert outcomes == dict.fromkeys(outcomes, "MemoryError"), outcomes


@pytest.mark.parametrize(
    "call",
    [
        lambda c, k, s: KVCache(2**63, 4, 4, 1, 8),
        lambda c, k, s: KVCache(1, 4, 4, 1, 8, dtype="\udcff"),
        lambda c, k, s: KVCache(1, 4, 4, 1, 8, dtype=b"float32"),
        lambda c, k, s: KVCache(1, 4.0, 4, 1, 8),
        lambda c, k, s: c.write(2**63, k, k, s),
        lambda c, k, s: c.write(True, k, k, s),
        lambda c, k, s: c.gather(0, [0], 2**63),
        lambda c, k, s: c.gather(0, [True], 1),
        lambda c, k, s: c.copy_blocks([(True, False)]),
        lambda c, k, s: c.fill_random(-1),
        lambda c, k, s: c.attention(
            0, k, np.zeros((2, 1), np.int32), np.ones(2, np.int32), np.arange(3, dtype=np.int32), scale="big"
        ),
        lambda c, k, s: c.attention(
            0, k, np.zeros((2, 1), np.int32), np.ones(2, np.int32), np.arange(3, dtype=np.int32), kernel=5
        ),
    ],
)
def test_arguments_of_the_wrong_type_or_range_are_invalid_argument_errors(call):
    # Never OverflowError, TypeError or UnicodeEncodeError: one class for every bad argument.
    rng = np.random.default_rng(9)
    cache = KVCache(LAYERS, BLOCKS, BS, HEADS, DIM)
    k = rows(rng, 2)
    slots = np.array([0, 1], dtype=np.int64)
    cache.write(0, k, k, slots)
    with pytest.raises(InvalidArgumentError):
        call(cache, rows(rng, 2), slots)
    assert np.array_equal(cache.gather(0, [0], 2)[0], k)
