"""Issue 19: the disk tier's memory safety rests on construction, not on a promise. The tier's
I/O thread copies blocks of the scheduler's K/V while steps run; a write or read of any block but
the current step's could race that copy (undefined behaviour in Rust). Now the scheduler owns its
K/V (``kv_spec=``) and the only way in is its step awaiting update, at the slots and tables kept in
Rust: there is no cache to hand a tier, no slot to give by hand, and rewriting the step's numpy
arrays changes nothing the step touches. Each refusal touches nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pagedkv import InvalidArgumentError, KvSpec, Scheduler, ShapeError

BLOCKS, BLOCK, HEADS, DIM = 16, 4, 2, 8


def scheduler(kv: bool = True) -> Scheduler:
    spec = KvSpec.uniform(1, HEADS, DIM) if kv else None
    return Scheduler(num_blocks=BLOCKS, block_size=BLOCK, admission_lookahead_tokens=None, kv_spec=spec)


def rows(n: int, value: float) -> np.ndarray:
    return np.full((n, HEADS, DIM), value, dtype=np.float32)


@pytest.fixture
def tiered(tmp_path: Path):
    """A scheduler with a disk tier, one request of 10 tokens scheduled: (scheduler, step)."""
    s = scheduler()
    s.attach_disk_tier(tmp_path / "tier", 1 << 20, b"id")
    s.add_request("r", list(range(10)), max_tokens=3)
    step = s.schedule()
    yield s, step
    s.detach_disk_tier()


def test_rewriting_a_steps_arrays_changes_nothing_it_touches(tiered) -> None:
    """The old race, tried from Python: point the step's slots and tables at blocks no step holds
    (the tier's thread may be copying them). The step still writes and reads where the scheduler
    put it: the next step, attending over the whole context, finds every value row there."""
    s, step = tiered
    n = len(step.slot_mapping)
    step.slot_mapping[:] = np.arange(n) + (BLOCKS - 3) * BLOCK
    step.block_tables[:] = BLOCKS - 1
    step.copy_blocks()
    step.write(0, rows(n, 1.0), rows(n, 2.0))
    s.update(step, [7])
    decode = s.schedule()
    decode.write(0, rows(1, 1.0), rows(1, 2.0))
    out = decode.attention(0, rows(1, 0.5))
    assert out.shape == (1, HEADS, DIM) and np.allclose(out, 2.0), "a value row is missing from the step's blocks"
    s.update(decode, [8])


def test_only_the_step_awaiting_update_reaches_the_kv(tiered) -> None:
    s, step = tiered
    n = len(step.slot_mapping)
    step.write(0, rows(n, 1.0), rows(n, 2.0))
    s.update(step, [7])
    for call in (  # its blocks may now change hands
        lambda: step.write(0, rows(n, 3.0), rows(n, 3.0)),
        lambda: step.copy_blocks(),
        lambda: step.attention(0, rows(n, 0.5)),
    ):
        with pytest.raises(InvalidArgumentError, match="awaiting its finish"):
            call()
    decode = s.schedule()
    decode.write(0, rows(1, 2.0), rows(1, 2.0))
    assert np.allclose(decode.attention(0, rows(1, 0.5)), 2.0), "the refused write wrote"
    s.update(decode, [8])


def test_another_schedulers_step_is_refused(tiered) -> None:
    s, step = tiered
    other = scheduler()
    other.add_request("x", list(range(10)), max_tokens=1)
    foreign = other.schedule()
    foreign.write(0, rows(10, 1.0), rows(10, 1.0))  # its own scheduler's K/V: fine
    s.update(step, [7])
    other.update(foreign, [1])
    with pytest.raises(InvalidArgumentError, match="awaiting its finish"):
        foreign.write(0, rows(10, 1.0), rows(10, 1.0))


def test_a_scheduler_without_kv_serves_steps_and_refuses_kv_calls(tmp_path: Path) -> None:
    s = scheduler(kv=False)
    assert s.kv_spec is None
    s.add_request("r", list(range(10)), max_tokens=1)
    step = s.schedule()
    for call in (
        lambda: step.write(0, rows(10, 1.0), rows(10, 1.0)),
        lambda: step.copy_blocks(),
        lambda: step.attention(0, rows(10, 0.5)),
        lambda: s.attach_disk_tier(tmp_path / "tier", 1 << 20, b"id"),
    ):
        with pytest.raises(InvalidArgumentError, match="K/V"):
            call()
    s.update(step, [1])
    assert not (tmp_path / "tier").exists()


def test_bad_kv_calls_are_typed_and_write_nothing() -> None:
    s = scheduler()
    assert s.kv_spec == KvSpec.uniform(1, HEADS, DIM, "float32")
    s.add_request("r", list(range(10)), max_tokens=2)
    step = s.schedule()
    with pytest.raises(InvalidArgumentError):
        step.write(0, rows(10, np.nan), rows(10, 1.0))
    with pytest.raises(InvalidArgumentError):
        step.write(1, rows(10, 1.0), rows(10, 1.0))  # no layer 1
    with pytest.raises(ShapeError):
        step.write(0, rows(9, 1.0), rows(9, 1.0))  # not the step's 10 tokens
    with pytest.raises(InvalidArgumentError):
        KvSpec.uniform(1, HEADS, DIM, "int8")
    step.write(0, rows(10, 1.0), rows(10, 2.0))
    assert np.allclose(step.attention(0, rows(10, 0.5)), 2.0)
    s.update(step, [1])

