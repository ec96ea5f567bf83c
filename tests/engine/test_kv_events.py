"""The KV events — one class per kind, made in Rust straight from the scheduler's event — and the
publisher: sequence numbers without gaps, the replay buffer behind ``since``, snapshots equal to
the fold of every batch, and subscriptions."""

from __future__ import annotations

import pickle
import random

import pytest

from pagedkv import KvSpec, LayerSpec, Scheduler, block_hashes
from pagedkv.errors import InvalidArgumentError
from pagedkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, KvEventPublisher


def stored(h: int, medium: str = "ram") -> BlockStored:
    return BlockStored(block_hash=h, parent_block_hash=h + 100, token_ids=(1, 2), medium=medium)  # hashes are u128: no -1


def test_the_schedulers_events_are_the_published_classes_by_value():
    """One shape from the block manager to the router: what ``take_kv_events`` returns is the
    class a router receives (through Ray too: it pickles), equal and hashed by value."""
    s = Scheduler(num_blocks=8, block_size=2, emit_kv_events=True)
    s.add_request("r", [5, 6, 7], max_tokens=1)
    s.update(s.schedule(), [9])
    (first,) = block_hashes([5, 6, 7], 2)
    events = s.take_kv_events()  # the full prompt block; the last sampled token is never computed
    assert events == [BlockStored(first, 0, (5, 6), "ram")]
    assert [pickle.loads(pickle.dumps(e)) for e in events] == events
    assert len({*events, BlockStored(first, 0, [5, 6], "ram")}) == 1 and events[0] != BlockRemoved(first, "ram")
    assert repr(events[0]) == f"BlockStored(block_hash={first}, parent_block_hash=0, token_ids=(5, 6), medium='ram')"
    for make in (lambda: BlockStored(1, 0, (1,), "tape"), lambda: BlockRemoved(-1, "ram"), lambda: AllBlocksCleared(3)):
        with pytest.raises(InvalidArgumentError):
            make()


def test_batches_are_numbered_from_one_and_empty_publishes_consume_no_number():
    clock = iter([10.0, 11.0])
    publisher = KvEventPublisher(clock=lambda: next(clock))
    assert publisher.last_seq == 0
    assert publisher.publish([]) is None
    first = publisher.publish([stored(1)])
    assert publisher.publish(()) is None
    second = publisher.publish([stored(2), BlockRemoved(1, "ram")])
    assert (first.seq, first.timestamp, second.seq, second.timestamp) == (1, 10.0, 2, 11.0)
    assert second.events == (stored(2), BlockRemoved(1, "ram"))
    assert publisher.last_seq == 2


def test_since_replays_until_the_buffer_no_longer_reaches():
    publisher = KvEventPublisher(replay=3)
    for h in range(1, 6):
        publisher.publish([stored(h)])
    assert [b.seq for b in publisher.since(2)] == [3, 4, 5]
    assert [b.seq for b in publisher.since(4)] == [5]
    assert publisher.since(5) == []
    assert publisher.since(9) == []
    assert publisher.since(1) is None  # batch 2 has left the buffer
    assert KvEventPublisher(replay=0).since(0) == []
    with pytest.raises(InvalidArgumentError):
        publisher.since(-1)


def test_snapshot_is_the_fold_of_every_batch():
    rng = random.Random(7)
    publisher = KvEventPublisher(replay=2)
    truth: set[tuple[int, str]] = set()
    for _ in range(200):
        events = []
        for _ in range(rng.randrange(1, 4)):
            medium = rng.choice(["ram", "disk"])
            kind = rng.random()
            if kind < 0.6:
                h = rng.randrange(20)
                events.append(stored(h, medium))
                truth.add((h, medium))
            elif kind < 0.95:
                h = rng.randrange(20)
                events.append(BlockRemoved(h, medium))
                truth.discard((h, medium))
            else:
                events.append(AllBlocksCleared(medium))
                truth = {b for b in truth if b[1] != medium}
        publisher.publish(events)
        snapshot = publisher.snapshot()
        assert snapshot.seq == publisher.last_seq
        assert snapshot.blocks == truth


def test_subscribers_get_each_batch_in_order_until_they_unsubscribe():
    publisher = KvEventPublisher()
    seen: list[int] = []
    other: list[int] = []
    unsubscribe = publisher.subscribe(lambda b: seen.append(b.seq))
    publisher.subscribe(lambda b: other.append(b.seq))
    publisher.publish([stored(1)])
    publisher.publish([stored(2)])
    unsubscribe()
    unsubscribe()  # a second call does nothing
    publisher.publish([stored(3)])
    assert seen == [1, 2]
    assert other == [1, 2, 3]


def test_a_failing_subscriber_neither_stops_publishing_nor_the_others(caplog):
    publisher = KvEventPublisher()
    seen: list[int] = []

    def broken(batch: KvEventBatch) -> None:
        raise RuntimeError("subscriber bug")

    publisher.subscribe(broken)
    publisher.subscribe(lambda b: seen.append(b.seq))
    assert publisher.publish([stored(1)]).seq == 1
    assert seen == [1]
    assert "subscriber bug" in caplog.text


def test_bad_input_is_refused_and_changes_nothing():
    publisher = KvEventPublisher()
    publisher.publish([stored(1)])
    with pytest.raises(InvalidArgumentError):
        publisher.publish([stored(2), "not an event"])  # type: ignore[list-item]
    assert publisher.last_seq == 1
    assert publisher.snapshot().blocks == {(1, "ram")}
    with pytest.raises(InvalidArgumentError):
        BlockRemoved(1, "gpu")
    with pytest.raises(InvalidArgumentError):
        KvEventPublisher(replay=-1)
    with pytest.raises(InvalidArgumentError):
        publisher.subscribe(42)  # type: ignore[arg-type]


def test_a_subscriber_may_publish_and_read_from_its_callback():
    """Issue 23 item 6: a callback that publishes (as one calling back into an engine records
    events) gets the new batch after its own call returns, in order, never nested."""
    publisher = KvEventPublisher()
    seen: list[int] = []
    snapshots: list[int] = []

    def reentrant(batch: KvEventBatch) -> None:
        if batch.seq == 1:
            publisher.publish([stored(2)])
            snapshots.append(publisher.snapshot().seq)
        seen.append(batch.seq)

    publisher.subscribe(reentrant)
    publisher.publish([stored(1)])
    assert seen == [1, 2]
    assert snapshots == [2]


def test_recorded_batches_reach_subscribers_only_when_delivered():
    """Issue 23 item 6: ``record`` (under an engine's lock) numbers and folds a batch at once but
    calls nobody; ``deliver`` (after the lock) hands over every batch recorded, in order."""
    publisher = KvEventPublisher()
    seen: list[int] = []
    publisher.subscribe(lambda b: seen.append(b.seq))
    publisher.record([stored(1)])
    publisher.record([stored(2)])
    assert seen == [] and publisher.last_seq == 2 and publisher.snapshot().blocks == {(1, "ram"), (2, "ram")}
    publisher.deliver()
    publisher.deliver()
    assert seen == [1, 2]


@pytest.mark.parametrize("error", [SystemExit(3), KeyboardInterrupt()], ids=["SystemExit", "KeyboardInterrupt"])
def test_a_subscriber_raising_systemexit_or_keyboardinterrupt_is_logged_and_skipped(caplog, error):
    """Issue 23 item 21: they escaped the publisher and ended the engine's worker."""
    publisher = KvEventPublisher()
    seen: list[int] = []

    def exiting(batch: KvEventBatch) -> None:
        raise error

    publisher.subscribe(exiting)
    publisher.subscribe(lambda b: seen.append(b.seq))
    publisher.publish([stored(1)])
    publisher.publish([stored(2)])
    assert seen == [1, 2]
    assert type(error).__name__ in caplog.text


def test_a_hybrid_layouts_events_name_their_group_and_group_0_is_the_one_a_router_hashes():
    """A full layer and two sliding ones (window 3): group 0 is the full group in blocks of the
    pages' size, hashed as ``block_hashes`` hashes a prompt; the sliding group carves its pages
    into blocks of 1 and chains its own hashes. Replaying each group's events gives its blocks."""
    spec = KvSpec([LayerSpec(1, 4, window=3), LayerSpec(1, 4), LayerSpec(1, 4, window=3)])
    s = Scheduler(num_blocks=32, block_size=2, emit_kv_events=True, kv_spec=spec)
    assert [(g.layers, g.block_size, g.layer.window) for g in s.kv_groups] == [([1], 2, None), ([0, 2], 1, 3)]
    prompt = [5, 6, 7, 8, 9]
    s.add_request("a", prompt, max_tokens=3)
    held: dict[int, set[tuple[int, str]]] = {0: set(), 1: set()}
    while s.has_unfinished():
        out = s.schedule()
        s.update(out, [11] * len(out.logits_indices))
        for event in s.take_kv_events():
            assert type(event) is BlockStored or type(event) is BlockRemoved, event
            blocks = held[event.group]
            if type(event) is BlockStored:
                blocks.add((event.block_hash, event.medium))
                assert len(event.token_ids) == (2 if event.group == 0 else 1)
            else:
                blocks.remove((event.block_hash, event.medium))
        for group, blocks in held.items():
            assert blocks == set(s.kv_blocks(group)), group
    assert set(s.kv_blocks()) == held[0] | held[1] and not held[0] & held[1]
    # The full group's hashes are a router's hashes of the tokens computed (prompt + 2 sampled).
    assert {h for h, _ in held[0]} == set(block_hashes(prompt + [11, 11], 2))
    removed = BlockRemoved(7, "ram", group=1)
    assert removed.group == 1 and repr(removed) == "BlockRemoved(block_hash=7, medium='ram', group=1)"
    assert pickle.loads(pickle.dumps(removed)) == removed != BlockRemoved(7, "ram")
    for bad in (-1, 2**32, "1", 1.0, True):
        with pytest.raises(InvalidArgumentError, match="group"):
            BlockRemoved(7, "ram", bad)
        with pytest.raises(InvalidArgumentError, match="group"):
            BlockStored(7, 0, (1,), "ram", bad)
    for bad in (2, -1, "0", 2**64):
        with pytest.raises(InvalidArgumentError, match="group"):
            s.kv_blocks(bad)
