"""Paged attention (``KVCache.attention``) against a float64 numpy reference of dense attention, over
every earlier key or a sliding window of them.

The reference uses the float32 K/V written to the cache, so f16/bf16 storage rounding counts in the
error: the bounds are 1e-5 (f32) and 1e-2 (f16, bf16) of the largest reference magnitude.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagedkv
from pagedkv import _core
from support.array_layouts import layouts

TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
DTYPES = list(TOLERANCE)
LAYER = 1  # not 0, so a kernel reading the wrong layer fails


class Batch:
    """A KV cache holding each sequence's K/V in shuffled physical blocks, plus the dense copy."""

    def __init__(self, rng, dtype, contexts, block_size, num_kv_heads, head_dim, shuffle=True):
        self.contexts = list(contexts)
        self.block_size = block_size
        blocks = [-(-c // block_size) for c in contexts]
        self.width = max(blocks) + 1  # a padding column that must never be read
        num_blocks = sum(blocks) + 2
        physical = rng.permutation(num_blocks) if shuffle else np.arange(num_blocks)
        self.cache = pagedkv.KVCache(2, num_blocks, block_size, num_kv_heads, head_dim, dtype)
        self.tables = np.full((len(contexts), self.width), -1, dtype=np.int32)
        self.keys, self.values = [], []
        used = 0
        for seq, context in enumerate(contexts):
            self.tables[seq, : blocks[seq]] = physical[used : used + blocks[seq]]
            used += blocks[seq]
            positions = np.arange(context)
            slots = (self.tables[seq, positions // block_size].astype(np.int64) * block_size + positions % block_size)
            k = rng.uniform(-1, 1, (context, num_kv_heads, head_dim)).astype(np.float32)
            v = rng.uniform(-1, 1, (context, num_kv_heads, head_dim)).astype(np.float32)
            self.cache.write(LAYER, k, v, slots)
            self.keys.append(k)
            self.values.append(v)

    def attention(self, query, query_counts, contexts=None, **kwargs):
        contexts = self.contexts if contexts is None else contexts
        qsl = np.concatenate([[0], np.cumsum(query_counts)]).astype(np.int32)
        return self.cache.attention(LAYER, query, self.tables, np.array(contexts, dtype=np.int32), qsl, **kwargs)

    def reference(self, query, query_counts, scale, window=None):
        num_heads = query.shape[1]
        out = np.zeros(query.shape, dtype=np.float64)
        start = 0
        for seq, (nq, context) in enumerate(zip(query_counts, self.contexts, strict=True)):
            k = self.keys[seq].astype(np.float64)
            v = self.values[seq].astype(np.float64)
            group = num_heads // k.shape[1]
            k = np.repeat(k, group, axis=1)  # [context, num_heads, d]
            v = np.repeat(v, group, axis=1)
            q = query[start : start + nq].astype(np.float64)
            scores = np.einsum("thd,khd->htk", q, k) * scale
            positions = context - nq + np.arange(nq)
            scores[:, np.arange(context)[None, :] > positions[:, None]] = -np.inf
            if window is not None:  # keys k with p - window < k <= p
                scores[:, np.arange(context)[None, :] <= positions[:, None] - window] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            weights = np.exp(scores)
            weights /= weights.sum(axis=-1, keepdims=True)
            out[start : start + nq] = np.einsum("htk,khd->thd", weights, v)
            start += nq
        return out


def relative_error(actual, expected):
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-30))


def check(rng, dtype, contexts, query_counts, block_size, num_kv_heads, group, head_dim, kernel=None):
    batch = Batch(rng, dtype, contexts, block_size, num_kv_heads, head_dim)
    query = rng.standard_normal((sum(query_counts), num_kv_heads * group, head_dim)).astype(np.float32)
    out = batch.attention(query, query_counts, kernel=kernel)
    assert out.dtype == np.float32 and out.shape == query.shape
    expected = batch.reference(query, query_counts, 1 / np.sqrt(head_dim))
    error = relative_error(out, expected)
    assert error <= TOLERANCE[dtype], (dtype, contexts, query_counts, block_size, error)
    return batch, query, out


@st.composite
def cases(draw):
    num_seqs = draw(st.integers(1, 4))
    contexts = draw(st.lists(st.integers(1, 300), min_size=num_seqs, max_size=num_seqs))
    # Per sequence: a decode (1), a whole prefill (= context), or a chunk over a cached prefix.
    counts = [draw(st.sampled_from([1, c, max(1, c // 3)])) for c in contexts]
    return dict(
        dtype=draw(st.sampled_from(DTYPES)),
        contexts=contexts,
        query_counts=counts,
        block_size=draw(st.sampled_from([1, 3, 8, 16, 32])),
        num_kv_heads=draw(st.sampled_from([1, 2, 4])),
        group=draw(st.sampled_from([1, 2, 4, 8])),
        head_dim=draw(st.sampled_from([8, 24, 64, 128])),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_random_batches_match_dense_reference(case):
    rng = np.random.default_rng(case.pop("seed"))
    check(rng, **case)


@pytest.mark.parametrize("kernel", pagedkv.available_kernels())
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_path_matches_reference_and_portable(kernel, dtype):
    rng = np.random.default_rng(3)
    batch, query, out = check(rng, dtype, [1, 70, 513], [1, 30, 1], 16, 2, 4, 128, kernel=kernel)
    portable = batch.attention(query, [1, 30, 1], kernel="portable")
    assert relative_error(out, portable.astype(np.float64)) <= 1e-5


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa_ratios(group):
    rng = np.random.default_rng(group)
    check(rng, "float32", [37, 200], [1, 50], 16, 2, group, 64)


def test_context_length_one_and_sequential_blocks():
    rng = np.random.default_rng(5)
    batch = Batch(rng, "float32", [1], 16, 1, 8, shuffle=False)
    query = rng.standard_normal((1, 2, 8)).astype(np.float32)
    out = batch.attention(query, [1])
    # One key: softmax weight 1, the output is that key's value.
    np.testing.assert_allclose(out[0], np.repeat(batch.values[0][0], 2, axis=0), rtol=1e-6)


@pytest.mark.parametrize("context", [255, 256, 257, 511, 512, 513, 4095, 4096, 4097])
def test_partition_boundaries(context):
    # One sequence and one KV head: long contexts are split into key partitions merged at the end.
    pagedkv.set_num_threads(2)
    check(np.random.default_rng(context), "float32", [context], [1], 16, 1, 4, 128)


def test_prefill_with_and_without_cached_prefix():
    rng = np.random.default_rng(7)
    check(rng, "float32", [100], [100], 16, 2, 2, 64)  # whole prompt
    check(rng, "bfloat16", [300, 64], [44, 64], 16, 2, 2, 64)  # 256 cached tokens, and a fresh one


def test_chunked_prefill_equals_whole_prefill():
    rng = np.random.default_rng(8)
    prompt = 150
    batch = Batch(rng, "float16", [prompt], 16, 2, 64)
    query = rng.standard_normal((prompt, 8, 64)).astype(np.float32)
    whole = batch.attention(query, [prompt])
    start = 0
    for chunk in [64, 50, 36]:
        part = batch.attention(query[start : start + chunk], [chunk], contexts=[start + chunk])
        np.testing.assert_allclose(part, whole[start : start + chunk], rtol=0, atol=1e-6)
        start += chunk


def test_scale_argument_and_thread_counts_agree():
    rng = np.random.default_rng(9)
    batch = Batch(rng, "float32", [900, 33], 16, 2, 64)
    query = rng.standard_normal((2, 4, 64)).astype(np.float32)
    expected = batch.reference(query, [1, 1], 0.05)
    before = pagedkv.get_num_threads()
    try:
        for threads in [1, 2, 3]:
            pagedkv.set_num_threads(threads)
            assert pagedkv.get_num_threads() == threads
            assert relative_error(batch.attention(query, [1, 1], scale=0.05), expected) <= 1e-5
    finally:
        pagedkv.set_num_threads(before)


def test_contiguous_kv_runs_the_same_kernel():
    kv = pagedkv.ContiguousKV(2, 2, 300, 64, "bfloat16", seed=1)
    query = np.random.default_rng(10).standard_normal((2, 4, 64)).astype(np.float32)
    args = (query, np.array([300, 17], np.int32), np.array([0, 1, 2], np.int32))
    small, large = kv.attention(*args, block_size=16), kv.attention(*args, block_size=128)
    np.testing.assert_allclose(small, large, rtol=0, atol=1e-5)
    assert np.isfinite(small).all() and np.abs(small).max() > 0


@pytest.mark.parametrize("kernel", pagedkv.available_kernels())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 20, 1000])
def test_sliding_window_matches_dense_reference(kernel, dtype, window):
    # A decode, a chunk of 30 over a cached prefix and a whole prompt, in blocks of 16; windows of
    # one token, less than a block, not a block multiple, longer than every context.
    rng = np.random.default_rng(window)
    contexts, counts = [70, 100, 45], [1, 30, 45]
    batch = Batch(rng, dtype, contexts, 16, 2, 64)
    query = rng.standard_normal((sum(counts), 8, 64)).astype(np.float32)
    # The entries of blocks wholly before every window of a sequence are never read.
    for seq, (nq, context) in enumerate(zip(counts, contexts, strict=True)):
        batch.tables[seq, : max(0, context - nq + 1 - window) // 16] = -1
    out = batch.attention(query, counts, window=window, kernel=kernel)
    expected = batch.reference(query, counts, 1 / 8, window=window)
    assert relative_error(out, expected) <= TOLERANCE[dtype]
    qsl = np.array([0, 1, 31, 76], np.int32)
    seconds = _core.attention_kernel_seconds(
        batch.cache, LAYER, query, batch.tables, np.array(contexts, np.int32), qsl, iterations=1, window=window
    )
    assert seconds > 0


@pytest.mark.parametrize("window", [0, -1, True, 1.5, "3", 2**63])
def test_a_window_is_a_positive_int_or_none(window):
    rng = np.random.default_rng(15)
    batch = Batch(rng, "float32", [20], 8, 2, 16)
    query = np.zeros((1, 4, 16), np.float32)
    with pytest.raises(pagedkv.InvalidArgumentError, match="window"):
        batch.attention(query, [1], window=window)
    kv = pagedkv.ContiguousKV(1, 2, 20, 16)
    with pytest.raises(pagedkv.InvalidArgumentError, match="window"):
        kv.attention(query, np.array([20], np.int32), np.array([0, 1], np.int32), window=window)
    assert np.array_equal(batch.attention(query, [1], window=None), batch.attention(query, [1]))


def test_contiguous_kv_takes_the_window_as_paged_attention_does():
    kv = pagedkv.ContiguousKV(2, 2, 300, 64, "float32", seed=2)
    query = np.random.default_rng(16).standard_normal((7, 4, 64)).astype(np.float32)
    args = (query, np.array([300, 41], np.int32), np.array([0, 1, 7], np.int32))
    small, large = kv.attention(*args, block_size=16, window=50), kv.attention(*args, block_size=128, window=50)
    np.testing.assert_allclose(small, large, rtol=0, atol=1e-5)
    assert not np.allclose(small, kv.attention(*args, block_size=16), rtol=0, atol=1e-3)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_attention_works_in_a_forked_child():
    rng = np.random.default_rng(11)
    batch = Batch(rng, "float32", [2000], 16, 1, 128)
    query = rng.standard_normal((1, 4, 128)).astype(np.float32)
    pagedkv.set_num_threads(2)
    expected = batch.attention(query, [1])  # builds the pool in the parent
    pid = os.fork()
    if pid == 0:
        ok = np.allclose(batch.attention(query, [1]), expected, rtol=0, atol=1e-6)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("attention hung in a forked child")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_bad_inputs_raise_typed_errors():
    rng = np.random.default_rng(12)
    batch = Batch(rng, "float32", [20, 5], 8, 2, 16)
    query = np.zeros((2, 4, 16), np.float32)
    tables, contexts, qsl = batch.tables, np.array([20, 5], np.int32), np.array([0, 1, 2], np.int32)
    attention = batch.cache.attention
    assert attention(LAYER, query, tables, contexts, qsl).shape == (2, 4, 16)
    with pytest.raises(pagedkv.ShapeError):
        attention(LAYER, query.astype(np.float64), tables, contexts, qsl)
    with pytest.raises(pagedkv.ShapeError):
        attention(LAYER, query[0], tables, contexts, qsl)  # 2-D query
    with pytest.raises(pagedkv.ShapeError):
        attention(LAYER, np.zeros((2, 4, 8), np.float32), tables, contexts, qsl)  # head_dim 8 != 16
    with pytest.raises(pagedkv.ShapeError):
        attention(LAYER, query, tables.astype(np.int64), contexts, qsl)
    with pytest.raises(pagedkv.ShapeError):
        attention(LAYER, query, tables, contexts, np.array([0, 1], np.int32))  # num_seqs + 1 entries
    with pytest.raises(pagedkv.ShapeError):
        attention(LAYER, query, tables, contexts, np.array([0, 1, 3], np.int32))  # 3 tokens, 2 rows
    with pytest.raises(pagedkv.InvalidArgumentError):
        attention(LAYER, np.zeros((2, 3, 16), np.float32), tables, contexts, qsl)  # 3 heads, 2 KV heads
    with pytest.raises(pagedkv.InvalidArgumentError):
        attention(LAYER, query, tables, contexts, np.array([0, 2, 1], np.int32))  # decreasing
    with pytest.raises(pagedkv.InvalidArgumentError):
        attention(LAYER, query, tables, np.array([20, 5 + 8 * batch.width], np.int32), qsl)
    with pytest.raises(pagedkv.InvalidArgumentError):
        attention(LAYER, np.zeros((3, 4, 16), np.float32), tables, np.array([20, 1], np.int32), np.array([0, 1, 3], np.int32))
    with pytest.raises(pagedkv.InvalidArgumentError):
        attention(7, query, tables, contexts, qsl)
    with pytest.raises(pagedkv.InvalidArgumentError):
        attention(LAYER, query, tables, contexts, qsl, kernel="sse9")
    for bad_block in [-1, batch.cache.num_blocks]:
        bad = tables.copy()
        bad[1, 0] = bad_block
        with pytest.raises(pagedkv.InvalidArgumentError):
            attention(LAYER, query, bad, contexts, qsl)
    with pytest.raises(pagedkv.InvalidArgumentError):
        pagedkv.set_num_threads(0)
    odd = pagedkv.KVCache(1, 1, 4, 1, 12)
    with pytest.raises(pagedkv.InvalidArgumentError):
        odd.attention(
            0, np.zeros((1, 1, 12), np.float32), np.zeros((1, 1), np.int32), np.array([1], np.int32), np.array([0, 1], np.int32)
        )


# --- layouts, bounds and sizes (issue 10: items 3, 4, 5) ---------------------------------------


def layout_case():
    rng = np.random.default_rng(13)
    batch = Batch(rng, "float32", [40, 7, 300], 8, 2, 16)
    counts = [3, 1, 2]
    args = {
        "query": rng.standard_normal((sum(counts), 4, 16)).astype(np.float32),
        "block_tables": batch.tables,
        "context_lens": np.array(batch.contexts, np.int32),
        "query_start_loc": np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
    }
    return batch, args


@pytest.mark.parametrize("argument", ["query", "block_tables", "context_lens", "query_start_loc"])
def test_attention_reads_every_array_layout_in_index_order(argument):
    batch, args = layout_case()
    expected = batch.cache.attention(LAYER, **args)
    assert relative_error(expected, batch.reference(args["query"], [3, 1, 2], 1 / 4)) <= 1e-5
    for name, variant in layouts(args[argument]).items():
        got = batch.cache.attention(LAYER, **(args | {argument: variant}))
        assert np.array_equal(got, expected), name
        assert _core.attention_kernel_seconds(batch.cache, LAYER, **(args | {argument: variant}), iterations=1) > 0


@pytest.mark.parametrize("argument", ["query", "context_lens", "query_start_loc"])
def test_contiguous_attention_reads_every_array_layout_in_index_order(argument):
    kv = pagedkv.ContiguousKV(2, 2, 64, 16, seed=3)
    args = {
        "query": np.random.default_rng(14).standard_normal((3, 4, 16)).astype(np.float32),
        "context_lens": np.array([64, 9], np.int32),
        "query_start_loc": np.array([0, 2, 3], np.int32),
    }
    expected = kv.attention(**args)
    for name, variant in layouts(args[argument]).items():
        assert np.array_equal(kv.attention(**(args | {argument: variant})), expected), name


def test_contiguous_attention_with_a_block_size_past_every_sequence():
    kv = pagedkv.ContiguousKV(1, 1, 40, 8, seed=4)
    args = (np.ones((1, 2, 8), np.float32), np.array([40], np.int32), np.array([0, 1], np.int32))
    whole = kv.attention(*args, block_size=40)
    for block_size in [41, 2**40, 2**62]:  # one tile of 40 rows all the same
        np.testing.assert_allclose(kv.attention(*args, block_size=block_size), whole, rtol=0, atol=1e-6)


def test_block_tables_whose_entry_count_overflows_are_a_shape_error():
    cache = pagedkv.KVCache(1, 4, 4, 1, 8)
    # 16 rows × 2**60 columns wraps to 0 entries, which an empty array holds.
    tables = np.zeros((0, 2**60), np.int32)
    with pytest.raises(pagedkv.ShapeError):
        cache.attention(0, np.zeros((1, 1, 8), np.float32), tables, np.ones(16, np.int32), np.array([0] + [1] * 16, np.int32))


def test_thread_counts_outside_the_documented_bound_are_refused_and_change_nothing():
    rng = np.random.default_rng(15)
    batch = Batch(rng, "float32", [3000], 16, 1, 64)
    query = rng.standard_normal((1, 4, 64)).astype(np.float32)
    expected = batch.reference(query, [1], 1 / 8)
    before = pagedkv.get_num_threads()
    try:
        for bad in [0, -1, 1025, 100000, 2**62]:
            with pytest.raises(pagedkv.InvalidArgumentError):
                pagedkv.set_num_threads(bad)
            assert pagedkv.get_num_threads() == before
            assert relative_error(batch.attention(query, [1]), expected) <= 1e-5
        pagedkv.set_num_threads(1024)  # the bound itself runs
        assert pagedkv.get_num_threads() == 1024
        assert relative_error(batch.attention(query, [1]), expected) <= 1e-5
    finally:
        pagedkv.set_num_threads(before)


THREADS_FROM_ENV = """
import numpy as np, pagedkv
threads = pagedkv.get_num_threads()
assert 1 <= threads <= 1024, threads
kv = pagedkv.ContiguousKV(1, 1, 4096, 64, seed=1)
out = kv.attention(np.ones((1, 2, 64), np.float32), np.array([4096], np.int32), np.array([0, 1], np.int32))
assert np.isfinite(out).all()
"""


@pytest.mark.parametrize("value", ["100000", "0", "many"])
def test_an_out_of_range_thread_count_in_the_environment_is_ignored(value):
    env = os.environ | {"PAGEDKV_NUM_THREADS": value}
    result = subprocess.run([sys.executable, "-c", THREADS_FROM_ENV], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
