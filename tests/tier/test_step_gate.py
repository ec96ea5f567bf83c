"""Issue 19: the disk tier's memory safety no longer rests on a promise. While a tier shares a
KVCache, its I/O thread copies blocks out of it and into it; a write or read of any block but the
current step's could race that copy (undefined behaviour in Rust). The cache now takes every touch
of its K/V only through its scheduler's step awaiting update: what the old contract in the stub
asked callers to promise is refused by construction. Each refusal touches nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pagedkv import InvalidArgumentError, KVCache, Scheduler
from pagedkv._core import attention_kernel_seconds

BLOCKS, BLOCK, HEADS, DIM = 16, 4, 2, 8


def cache() -> KVCache:
    return KVCache(1, BLOCKS, BLOCK, HEADS, DIM)


def scheduler() -> Scheduler:
    return Scheduler(num_blocks=BLOCKS, block_size=BLOCK, admission_lookahead_tokens=None)


def rows(n: int, value: float) -> np.ndarray:
    return np.full((n, HEADS, DIM), value, dtype=np.float32)


def contents(kv: KVCache, table: list[int], tokens: int) -> tuple[np.ndarray, np.ndarray]:
    return kv.gather(0, np.array(table, dtype=np.int32), tokens)


@pytest.fixture
def tiered(tmp_path: Path):
    """A scheduler with a disk tier over a cache, one request scheduled: (scheduler, cache, step)."""
    s, kv = scheduler(), cache()
    s.attach_disk_tier(kv, tmp_path / "tier", 1 << 20, b"id")
    s.add_request("r", list(range(10)), max_tokens=2)
    step = s.schedule()
    yield s, kv, step
    s.detach_disk_tier()


def test_slots_and_tables_given_by_hand_are_refused_while_a_tier_shares_the_cache(tiered) -> None:
    s, kv, step = tiered
    n = len(step.slot_mapping)
    fake = SimpleNamespace(slot_mapping=step.slot_mapping, block_tables=step.block_tables, copy_ops=np.zeros((0, 2), np.int64),
                           context_lens=step.context_lens, query_start_loc=step.query_start_loc)
    other_blocks = np.arange(n, dtype=np.int64) + (BLOCKS - 3) * BLOCK  # blocks no step holds
    query = rows(n, 0.5)
    refused = [
        lambda: kv.write(0, rows(n, 1.0), rows(n, 1.0), other_blocks),  # the old race
        lambda: kv.write(0, rows(n, 1.0), rows(n, 1.0), step.slot_mapping),  # the step's slots, by hand
        lambda: kv.write(0, rows(n, 1.0), rows(n, 1.0), step=fake),  # the arrays of a step, not the step
        lambda: kv.copy_blocks([(0, BLOCKS - 1)]),
        lambda: kv.attention(0, query, step.block_tables, step.context_lens, step.query_start_loc),
        lambda: kv.gather(0, np.array([0], dtype=np.int32), 1),
        lambda: kv.fill_random(1),
        lambda: attention_kernel_seconds(kv, 0, query, step.block_tables, step.context_lens, step.query_start_loc),
    ]
    for call in refused:
        with pytest.raises(InvalidArgumentError, match="disk tier|awaiting update"):
            call()
    s.update(step, [7])
    s.detach_disk_tier()
    assert not contents(kv, list(range(BLOCKS)), BLOCKS * BLOCK)[0].any(), "a refused call wrote"


def test_the_step_awaiting_update_is_the_one_key(tiered) -> None:
    s, kv, step = tiered
    n = len(step.slot_mapping)
    kv.copy_blocks(step=step)
    kv.write(0, rows(n, 1.0), rows(n, 2.0), step=step)
    out = kv.attention(0, rows(n, 0.5), step=step)
    assert out.shape == (n, HEADS, DIM) and np.allclose(out, 2.0)  # every value row is 2
    s.update(step, [7])
    with pytest.raises(InvalidArgumentError, match="awaiting update"):  # its blocks may now change hands
        kv.write(0, rows(n, 3.0), rows(n, 3.0), step=step)
    following = s.schedule()
    kv.write(0, rows(1, 4.0), rows(1, 4.0), step=following)
    s.update(following, [8])


def test_another_schedulers_step_is_refused_and_a_cache_serves_one_tier(tiered, tmp_path: Path) -> None:
    s, kv, step = tiered
    other = scheduler()
    other.add_request("x", list(range(10)), max_tokens=1)
    foreign = other.schedule()
    with pytest.raises(InvalidArgumentError, match="awaiting update"):
        kv.write(0, rows(len(foreign.slot_mapping), 1.0), rows(len(foreign.slot_mapping), 1.0), step=foreign)
    with pytest.raises(InvalidArgumentError, match="another scheduler"):
        scheduler().attach_disk_tier(kv, tmp_path / "second", 1 << 20, b"id")
    s.update(step, [7])


def test_after_detach_the_cache_is_the_callers_again(tmp_path: Path) -> None:
    s, kv = scheduler(), cache()
    s.attach_disk_tier(kv, tmp_path / "tier", 1 << 20, b"id")
    with pytest.raises(InvalidArgumentError):
        kv.write(0, rows(1, 1.0), rows(1, 1.0), np.array([5]))
    s.detach_disk_tier()
    kv.write(0, rows(1, 1.0), rows(1, 1.0), np.array([5]))
    assert contents(kv, [1], 2)[0][1].min() == 1.0  # slot 5: row 1 of block 1


def test_a_failed_attach_leaves_the_cache_ungated(tmp_path: Path) -> None:
    kv = cache()
    with pytest.raises(InvalidArgumentError):
        scheduler().attach_disk_tier(kv, "", 1 << 20, b"id")  # an empty path is refused
    kv.write(0, rows(1, 1.0), rows(1, 1.0), np.array([0]))


@pytest.mark.parametrize("step", [42, None.__class__, SimpleNamespace(slot_mapping=np.zeros(1, np.int64))])
def test_a_step_without_a_steps_arrays_is_a_typed_error(step: object) -> None:
    kv = cache()
    with pytest.raises(InvalidArgumentError):
        kv.attention(0, rows(1, 0.5), step=step)
    with pytest.raises(InvalidArgumentError):
        kv.copy_blocks(step=step)
    with pytest.raises(InvalidArgumentError, match="not both"):
        kv.write(0, rows(1, 1.0), rows(1, 1.0), np.array([0]), step=step)

