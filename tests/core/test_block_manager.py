"""The Python face of the block manager: prefix sharing, eviction order, fork and copy-on-write,
refusal without side effects, bad input on every public method, and the seed's own checks."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pagedkv
from pagedkv import (
    BlockManager,
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    UnknownSequenceError,
)

BS = 4


def snapshot(m: BlockManager) -> tuple:
    """Everything observable about a manager's state, for no-side-effect checks."""
    seqs = [s for s in range(64) if s in m]
    return (
        m.stats(),
        m.num_free_blocks,
        len(m),
        {s: (m.token_ids(s), m.block_table(s).tolist()) for s in seqs},
    )


def test_requests_sharing_a_system_prompt_share_its_full_blocks():
    m = BlockManager(num_blocks=32, block_size=BS)
    system = list(range(100, 112))  # three full blocks
    assert m.allocate(1, system + [1, 2]) == 0
    assert m.allocate(2, system + [3, 4, 5]) == 12
    t1, t2 = m.block_table(1), m.block_table(2)
    assert t1[:3].tolist() == t2[:3].tolist()
    assert t1[3] != t2[3]
    assert m.stats()["prefix_hit_tokens"] == 12
    assert m.stats()["prefix_queried_tokens"] == 14 + 15
    m.check_invariants()


def test_a_hit_never_covers_the_whole_prompt():
    m = BlockManager(num_blocks=8, block_size=BS)
    m.allocate(1, list(range(8)))
    assert m.cached_prefix_len(list(range(8))) == 4
    assert m.allocate(2, list(range(8))) == 4


def test_shared_prefix_shorter_than_a_block_gives_no_hit_but_counts_the_lookup():
    m = BlockManager(num_blocks=8, block_size=BS)
    m.allocate(1, [1, 2, 3, 9, 9])
    assert m.allocate(2, [1, 2, 3, 7, 7]) == 0
    stats = m.stats()
    assert (stats["prefix_queried_tokens"], stats["prefix_hit_tokens"]) == (10, 0)


def test_cache_salt_isolates_prefixes():
    m = BlockManager(num_blocks=8, block_size=BS)
    m.allocate(1, list(range(9)), cache_salt="tenant-a")
    assert m.allocate(2, list(range(9)), cache_salt="tenant-b") == 0
    assert m.allocate(3, list(range(9)), cache_salt="tenant-a") == 8


def test_freed_prefix_stays_cached_and_the_tail_is_evicted_first():
    m = BlockManager(num_blocks=4, block_size=BS)
    prompt = list(range(16))  # four full blocks
    m.allocate(1, prompt)
    head = m.block_table(1).tolist()
    m.free(1)
    stats = m.stats()
    assert (stats["used_blocks"], stats["cached_blocks"], stats["free_blocks"]) == (0, 4, 0)
    # One new block evicts the least recently used cached block: the prompt's last.
    m.allocate(2, [999])
    assert m.block_table(2).tolist() == [head[3]]
    assert m.stats()["evictions"] == 1
    m.free(2)
    # The first three blocks are still a hit (12 tokens).
    assert m.allocate(3, prompt) == 12
    assert m.block_table(3).tolist()[:3] == head[:3]
    m.check_invariants()


def test_fork_shares_everything_and_copy_on_write_splits_the_tail():
    m = BlockManager(num_blocks=8, block_size=BS)
    m.allocate(1, [1, 2, 3, 4, 5, 6])
    m.fork(1, 2)
    assert m.block_table(1).tolist() == m.block_table(2).tolist()
    assert m.stats()["used_blocks"] == 2
    src = int(m.block_table(1)[1])
    copy = m.append(2, [7])
    assert copy is not None and copy[0] == src
    assert int(m.block_table(2)[1]) == copy[1]
    assert m.append(1, [8]) is None  # sole owner now: writes in place
    assert m.token_ids(1) == [1, 2, 3, 4, 5, 6, 8]
    assert m.token_ids(2) == [1, 2, 3, 4, 5, 6, 7]
    assert m.stats()["cow_copies"] == 1
    m.free(1)
    m.free(2)
    assert m.stats()["used_blocks"] == 0
    m.check_invariants()


def test_refusals_change_no_state():
    m = BlockManager(num_blocks=3, block_size=BS)
    m.allocate(1, list(range(10)))  # 3 blocks
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.allocate(2, [1])
    with pytest.raises(OutOfBlocksError):
        m.append(1, [1, 2, 3])
    with pytest.raises(DuplicateSequenceError):
        m.allocate(1, [1])
    with pytest.raises(UnknownSequenceError):
        m.append(5, [1])
    with pytest.raises(UnknownSequenceError):
        m.free(5)
    with pytest.raises(UnknownSequenceError):
        m.fork(5, 6)
    with pytest.raises(DuplicateSequenceError):
        m.fork(1, 1)
    assert snapshot(m) == before
    m.free(1)
    with pytest.raises(UnknownSequenceError):  # double free
        m.free(1)


def test_admission_counts_evictable_hits_against_free_capacity():
    m = BlockManager(num_blocks=3, block_size=BS)
    m.allocate(1, list(range(9)))
    m.free(1)  # two cached blocks, one clean
    longer = list(range(13))  # reuses 2 cached + needs 2 new = 4 > 3
    assert not m.can_allocate(longer)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.allocate(2, longer)
    assert snapshot(m) == before
    assert m.can_allocate(list(range(12)))


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.allocate(-1, [1]),
        lambda m: m.allocate(1, []),
        lambda m: m.allocate(1, "abc"),
        lambda m: m.allocate(1, [1, -2]),
        lambda m: m.allocate(1, [1.5]),
        lambda m: m.allocate(1, [2**40]),
        lambda m: m.allocate(1, np.array([1.0, 2.0])),
        lambda m: m.append(0, ["x"]),
        lambda m: m.fork(-3, 1),
        lambda m: m.free(-1),
        lambda m: m.slot_mapping([0], [99]),
        lambda m: m.slot_mapping([0], [1, 2]),
        lambda m: m.block_tables([0, -1]),
        # Ints beyond int64 are refused like -1, never OverflowError (item 18).
        lambda m: m.free(2**63),
        lambda m: m.allocate(2**70, [1]),
        lambda m: m.slot_mapping([0], [2**64]),
        lambda m: m.block_tables([0, 2**63]),
        # Wrong types are InvalidArgumentError, never TypeError (item 2).
        lambda m: m.free("0"),
        lambda m: m.free(0.0),
        lambda m: m.free(True),
        lambda m: m.block_tables("01"),
        lambda m: m.slot_mapping(0, [1]),
        lambda m: m.allocate(1, [1], cache_salt=123),
        lambda m: m.allocate(1, [1], cache_salt=b"x"),
        lambda m: m.allocate(1, [1], cache_salt="\udc80"),
        lambda m: m.can_allocate([1], cache_salt=7),
        lambda m: m.cached_prefix_len([1], cache_salt=b"x"),
        # Bools and bytes are not token ids (item 19).
        lambda m: m.allocate(1, [True, 2]),
        lambda m: m.allocate(1, b"hi"),
        lambda m: m.allocate(1, bytearray(b"hi")),
        lambda m: m.allocate(1, np.array([True, False])),
        lambda m: m.append(0, [False]),
        lambda m: m.can_allocate(b"hi"),
    ],
)
def test_bad_input_raises_invalid_argument_and_changes_nothing(call):
    m = BlockManager(num_blocks=8, block_size=BS)
    m.allocate(0, [5, 6, 7])
    before = snapshot(m)
    with pytest.raises(InvalidArgumentError):
        call(m)
    assert snapshot(m) == before


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_blocks=0),
        dict(num_blocks=-4),
        dict(num_blocks=8, block_size=0),
        dict(num_blocks=2**63),
        dict(num_blocks="8"),
        dict(num_blocks=8, block_size=None),
        dict(num_blocks=8, block_size=4.0),
        dict(num_blocks=8, enable_prefix_caching=1),
        # Slots block * block_size + offset would overflow int64 (item 5).
        dict(num_blocks=4, block_size=2**62),
    ],
)
def test_bad_sizes_are_rejected(kwargs):
    with pytest.raises(InvalidArgumentError):
        BlockManager(**kwargs)


def test_sizes_beyond_memory_raise_memory_error_and_the_process_lives_on():
    """Item 4 (and 16): under a 4 GiB address-space cap, sizes the allocator refuses are a
    MemoryError (they aborted the process), and block ids past int32 are refused before any
    allocation. Run in a child process so the cap does not bind the test run."""
    cap = 4 << 30
    code = textwrap.dedent(
        f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, ({cap}, {cap}))
        import pagedkv
        for make in (lambda: pagedkv.BlockManager(2**27), lambda: pagedkv.Scheduler(num_blocks=2**28)):
            try:
                make()
            except MemoryError as error:
                print("MemoryError", "out of memory" in str(error))
        try:
            pagedkv.BlockManager(2**31)
        except pagedkv.InvalidArgumentError:
            print("InvalidArgumentError")
        m = pagedkv.BlockManager(64, 4)
        print("alive", m.allocate(0, [1, 2, 3]))
        """
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert child.stdout.split("\n") == [
        "MemoryError True",
        "MemoryError True",
        "InvalidArgumentError",
        "alive 0",
        "",
    ], child.stderr


def test_membership_of_a_value_that_cannot_be_an_id_is_false_whatever_it_is():
    """Item 18: -1, 2**63, 2**70 and non-ints are all simply absent, and the same values are all
    InvalidArgumentError when passed to a method (tested above)."""
    m = BlockManager(num_blocks=8, block_size=BS)
    m.allocate(1, [1])
    assert 1 in m and np.int64(1) in m
    for key in (-1, 2**63, 2**70, "1", 1.0, None):
        assert key not in m


def test_numpy_token_arrays_of_every_integer_width_and_any_layout_are_read_by_value():
    m = BlockManager(num_blocks=8, block_size=BS)
    for seq, dtype in enumerate([np.int64, np.int32, np.uint8, np.uint64, np.int16]):
        m.allocate(seq, np.array([1, 2, 3, 4, 5], dtype=dtype)[::-2])
        assert m.token_ids(seq) == [5, 3, 1]
    with pytest.raises(InvalidArgumentError):
        m.allocate(9, np.array([2**63], dtype=np.uint64))
    with pytest.raises(InvalidArgumentError):
        m.allocate(9, np.array([-1], dtype=np.int8))


def test_errors_are_also_standard_exceptions():
    m = BlockManager(num_blocks=1, block_size=BS)
    with pytest.raises(KeyError):
        m.free(3)
    with pytest.raises(ValueError):
        m.allocate(0, [])
    assert issubclass(OutOfBlocksError, pagedkv.PagedKVError)


def test_batch_views_for_the_model_runner():
    m = BlockManager(num_blocks=16, block_size=BS)
    m.allocate(1, list(range(6)))
    m.allocate(2, [9])
    tables = m.block_tables([1, 2])
    assert tables.dtype == np.int32 and tables.shape == (2, 2)
    assert tables[1, 1] == -1
    m.append(1, [6, 7, 8])
    m.append(2, [10])
    slots = m.slot_mapping([1, 2], [3, 1])
    assert slots.dtype == np.int64
    t1, t2 = m.block_table(1), m.block_table(2)
    assert slots.tolist() == [t1[1] * BS + 2, t1[1] * BS + 3, t1[2] * BS + 0, t2[0] * BS + 1]


def test_seed_check_100_sequences_leave_no_block_behind():
    rng = random.Random(0)
    m = BlockManager(num_blocks=2048, block_size=16)
    for seq in range(100):
        m.allocate(seq, [rng.randrange(1000) for _ in range(rng.randrange(1, 200))])
        for _ in range(rng.randrange(0, 40)):
            m.append(seq, [rng.randrange(1000)])
    assert len(m) == 100
    for seq in range(100):
        m.free(seq)
    stats = m.stats()
    assert stats["used_blocks"] == 0
    assert stats["free_blocks"] + stats["cached_blocks"] == 2048
    m.check_invariants()


def test_concurrent_use_from_threads_keeps_invariants():
    import threading

    m = BlockManager(num_blocks=256, block_size=BS)

    def worker(base: int) -> None:
        rng = random.Random(base)
        for i in range(300):
            seq = base * 1000 + i
            try:
                m.allocate(seq, [rng.randrange(4) for _ in range(rng.randrange(1, 20))])
            except OutOfBlocksError:
                continue
            try:
                m.append(seq, [1, 2])
            except OutOfBlocksError:
                pass
            if rng.random() < 0.9:
                m.free(seq)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    m.check_invariants()
