"""``pagedkv.block_hashes``: the prefix-cache hash chain a router computes for a prompt.

The engine-side check that these are the very hashes the block manager registers (its KV events
name them) is in tests/engine/test_kv_events.py."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv


def test_one_hash_per_full_block_each_chaining_the_whole_prefix() -> None:
    tokens = list(range(100, 150))  # 3 full blocks of 16, and 2 tokens
    hashes = pagedkv.block_hashes(tokens, 16)
    assert len(hashes) == 3
    assert all(isinstance(h, int) and 0 <= h < 2**128 for h in hashes)
    assert len(set(hashes)) == 3
    # A prefix's hashes are the leading hashes; the partial tail changes nothing.
    assert pagedkv.block_hashes(tokens[:32], 16) == hashes[:2]
    assert pagedkv.block_hashes(tokens[:48], 16) == hashes
    # The same block after a different prefix hashes differently (the chain covers the prefix).
    other = [7] * 16 + tokens[16:48]
    assert pagedkv.block_hashes(other, 16)[1:] != hashes[1:]
    # A numpy array of any integer dtype is the same sequence.
    assert pagedkv.block_hashes(np.array(tokens, dtype=np.uint32), 16) == hashes


def test_salts_never_share_a_hash() -> None:
    tokens = list(range(64))
    plain = pagedkv.block_hashes(tokens, 16)
    a = pagedkv.block_hashes(tokens, 16, cache_salt="tenant-a")
    b = pagedkv.block_hashes(tokens, 16, cache_salt="tenant-b")
    empty = pagedkv.block_hashes(tokens, 16, cache_salt="")
    assert a == pagedkv.block_hashes(tokens, 16, "tenant-a")
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(empty)


def test_short_prompt_has_no_hash() -> None:
    assert pagedkv.block_hashes([1, 2, 3], 16) == []
    assert pagedkv.block_hashes([], 4) == []


@pytest.mark.parametrize(
    ("tokens", "block_size", "salt"),
    [
        ([1, 2], 0, None),  # the core refuses a zero block size
        ([1, 2], -1, None),
        ([1, 2], True, None),
        ("abc", 4, None),
        ([1, 2**32], 4, None),
        ([1, 2], 4, b"bytes"),
        ([1, 2], 4, "\ud800"),
    ],
)
def test_bad_arguments_are_typed(tokens: object, block_size: object, salt: object) -> None:
    with pytest.raises(pagedkv.InvalidArgumentError):
        pagedkv.block_hashes(tokens, block_size, salt)  # type: ignore[arg-type]
