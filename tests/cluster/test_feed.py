"""The replica feed, driven directly (no Ray, no clock): what a replica answers a receiver at a
given batch, how the receiver applies it and finds a gap, and a replica's load — the protocol the
Ray front end and the serving simulator share (:mod:`pagedkv.cluster.feed`)."""

from __future__ import annotations

from pagedkv.cluster import ReplicaLoad, Router
from pagedkv.cluster.feed import Feed, apply_batches, feed_since, replica_load
from pagedkv.engine import EngineConfig, EngineCore, SimulatedRunner, VirtualClock
from pagedkv.kv_events import BlockRemoved, BlockStored, KvEventPublisher, KvSnapshot
from pagedkv.models import SimulatedModel
from pagedkv.sampling import SamplingParams


def publisher_with(batches: int, replay: int = 8) -> KvEventPublisher:
    publisher = KvEventPublisher(replay=replay)
    for h in range(1, batches + 1):
        publisher.publish([BlockStored(h, 0, (h,), "ram")])
    return publisher


def test_a_receiver_gets_the_batches_after_its_seq_while_they_are_held() -> None:
    publisher = publisher_with(6, replay=4)
    taken: list[int] = []

    def snapshot() -> KvSnapshot:
        taken.append(1)
        return publisher.snapshot()

    feed = feed_since(publisher, 3, snapshot)
    assert [b.seq for b in feed.batches] == [4, 5, 6] and feed.snapshot is None and feed.last_seq == 6
    assert feed_since(publisher, 6, snapshot) == Feed((), None, 6)  # nothing new
    assert not taken
    for after, replay in ((1, None), (None, None), (3, 2)):  # past the buffer; knows nothing; past the bound
        feed = feed_since(publisher, after, snapshot, replay)
        assert feed.batches is None and feed.snapshot == publisher.snapshot() and feed.last_seq == 6
    assert len(taken) == 3


def test_a_receiver_applies_in_order_and_finds_a_gap() -> None:
    publisher = publisher_with(5)
    router = Router(block_size=1)
    router.add_replica("a")
    assert apply_batches(router, "a", feed_since(publisher, 0, publisher.snapshot))
    assert router.applied_seq("a") == 5 and len(router.blocks_of("a")) == 5
    publisher.publish([BlockRemoved(1, "ram")])  # batch 6: lost on the way
    publisher.publish([BlockRemoved(2, "ram")])  # batch 7
    lossy = Feed((publisher.since(6)[0],), None, 7)
    assert not apply_batches(router, "a", lossy), "the receiver must see the gap"
    assert router.applied_seq("a") == 5  # the batch after the gap was refused, nothing applied
    healed = feed_since(publisher, router.applied_seq("a"), publisher.snapshot)
    assert apply_batches(router, "a", healed) and router.blocks_of("a") == publisher.snapshot().blocks


def test_a_replicas_load_is_its_queue_and_the_blocks_in_use() -> None:
    clock = VirtualClock()
    runner = SimulatedRunner(SimulatedModel(vocab_size=64), clock)
    core = EngineCore(runner, EngineConfig(num_blocks=16, block_size=4), clock=clock)
    assert replica_load(core) == ReplicaLoad(0, 0, 0.0)
    core.add_request("r", list(range(1, 9)), SamplingParams(max_tokens=4))
    assert replica_load(core).num_waiting == 1
    core.step()
    load = replica_load(core)
    assert (load.num_waiting, load.num_running) == (0, 1) and load.kv_usage == 1 - core.scheduler.num_free_blocks / 16 > 0
