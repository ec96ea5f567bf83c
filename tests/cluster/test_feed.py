"""The replica-feed protocol (pagedkv.cluster.feed) driven directly, as the Ray front end and the
simulated cluster drive it: membership by join and loss, its epochs, the KV event feed with its gaps
and resyncs, a replica's answers and load, and what a migrated request asks. No Ray, no clock:
times are given."""

from __future__ import annotations

import random

import pytest

from pagedkv import block_hashes
from pagedkv.cluster import NoReplicaError, ReplicaLoad, Router
from pagedkv.cluster.feed import ReplicaFeed, continuation, replica_answer, replica_load
from pagedkv.engine import EngineConfig, EngineCore, SimulatedRunner, VirtualClock
from pagedkv.kv_events import BlockRemoved, BlockStored, KvEventBatch, KvEventPublisher, KvSnapshot
from pagedkv.models import SimulatedModel
from pagedkv.sampling import SamplingParams

BS = 4
PROMPT = list(range(100, 100 + 8 * BS + 1))
HASHES = block_hashes(PROMPT, BS)


def stored(block: int) -> BlockStored:
    parent = HASHES[block - 1] if block else 0
    return BlockStored(HASHES[block], parent, tuple(PROMPT[block * BS : (block + 1) * BS]), "ram")


def publisher(blocks: int, replay: int = 1024) -> tuple[KvEventPublisher, list[KvEventBatch]]:
    """A replica's publisher having stored the first ``blocks`` blocks, one batch each."""
    pub = KvEventPublisher(replay=replay, clock=lambda: 0.0)
    batches = []
    for block in range(blocks):
        batch = pub.publish([stored(block)])
        assert batch is not None
        batches.append(batch)
    return pub, batches


def joined(replica_id: str = "r0", router: Router | None = None, now: float = 0.0) -> ReplicaFeed:
    feed = ReplicaFeed(router or Router("prefix_aware", BS), replica_id)
    feed.join(now, incarnation="first")
    return feed


def test_a_replica_is_routable_from_its_join_to_its_loss():
    router = Router("round_robin", BS)
    feed = ReplicaFeed(router, "r0")
    assert not feed.member and feed.applied_seq is None and feed.epoch == 0
    with pytest.raises(NoReplicaError):
        router.route(PROMPT)
    feed.join(10.0, KvSnapshot(3, frozenset({(HASHES[0], "ram")})), incarnation="a")
    assert feed.member and feed.epoch == 1 and feed.applied_seq == 3
    assert router.replicas == ("r0",) and router.blocks_of("r0") == {(HASHES[0], "ram")}
    assert feed.current("a") and not feed.current("b")
    assert feed.lose(12.5) and not feed.member and feed.applied_seq is None
    assert router.replicas == () and not feed.current("a")
    assert not feed.lose(13.0)  # lost once: counted once
    assert feed.deaths == 1 and feed.down_since == 12.5 and feed.incarnation == "a"  # the last one seen
    feed.join(14.0, incarnation="b")  # a restarted replica: an empty cache, at batch 0
    assert feed.epoch == 2 and feed.applied_seq == 0 and router.blocks_of("r0") == frozenset()
    assert feed.current("b") and not feed.current("a")
    assert feed.recoveries == [1.5] and feed.down_since is None


def test_joining_twice_without_a_loss_is_a_bug():
    feed = joined()
    with pytest.raises(AssertionError):
        feed.join(1.0)


def test_batches_in_order_keep_the_index_and_ask_nothing():
    pub, batches = publisher(4)
    feed = joined()
    assert feed.batches(batches[:1], 1) is None
    assert feed.batches(batches[1:], 4) is None
    assert feed.batches(batches[:2], 2) is None  # old batches again: ignored
    assert feed.batches([], 4) is None  # a heartbeat with nothing new
    assert feed.applied_seq == 4 and feed.router.blocks_of("r0") == pub.snapshot().blocks
    assert feed.snapshots == feed.replays == 0


def test_a_gap_asks_one_resync_from_the_index_seq_until_answered():
    pub, batches = publisher(5)
    feed = joined()
    assert feed.batches(batches[:2], 2) is None
    assert feed.batches([batches[3]], 4) == 2  # batch 3 lost on the way: batch 4 is refused
    assert feed.resyncing and feed.applied_seq == 2
    assert feed.batches([batches[4]], 5) is None  # still behind, but the resync is on its way
    replay = pub.since(2)
    assert replay is not None
    feed.resynced(replay)
    assert not feed.resyncing and feed.replays == 1 and feed.applied_seq == 5
    assert feed.router.blocks_of("r0") == pub.snapshot().blocks


def test_a_batch_lost_unseen_is_a_gap_when_the_reply_says_what_it_brings():
    # A poll's reply brings the index to last_seq; batches missing from it (one silently dropped
    # on the way) leave the index short of it: a gap, though nothing was refused.
    pub, batches = publisher(3)
    feed = joined()
    assert feed.batches(batches[:2], 3) == 2
    feed.resynced(pub.snapshot())
    assert feed.snapshots == 1 and feed.applied_seq == 3 and feed.router.blocks_of("r0") == pub.snapshot().blocks


def test_a_snapshot_older_than_the_index_changes_nothing_but_ends_the_resync():
    pub, batches = publisher(3)
    feed = joined()
    old = pub.snapshot()
    pub.publish([BlockRemoved(HASHES[2], "ram")])
    batch = pub.since(3)
    assert batch is not None
    assert feed.batches(batches, 3) is None and feed.batches(batch, 4) is None
    feed.resyncing = True
    feed.resynced(old)
    assert not feed.resyncing and feed.applied_seq == 4 and feed.router.blocks_of("r0") == pub.snapshot().blocks


def test_a_loss_forgets_an_outstanding_resync():
    _, batches = publisher(3)
    feed = joined()
    assert feed.batches([batches[2]], 3) == 0
    feed.lose(1.0)
    feed.join(2.0)
    assert not feed.resyncing
    assert feed.batches([batches[2]], 3) == 0  # the new member asks again


@pytest.mark.parametrize("seed", range(5))
def test_a_lossy_feed_ends_equal_to_the_publisher(seed):
    # Batches delivered one by one, each lost with probability 0.4; a gap's resync is answered
    # (replay while the buffer holds it, else a snapshot) before the next batch arrives.
    rng = random.Random(seed)
    pub = KvEventPublisher(replay=3, clock=lambda: 0.0)
    feed = joined()
    resyncs = 0
    for step in range(60):
        block = rng.randrange(len(HASHES))
        batch = pub.publish([stored(block)] if rng.random() < 0.6 else [BlockRemoved(HASHES[block], "ram")])
        assert batch is not None
        if rng.random() < 0.4:
            continue
        seq = feed.batches([batch], batch.seq)
        if seq is not None:
            resyncs += 1
            replay = pub.since(seq)
            feed.resynced(replay if replay is not None else pub.snapshot())
        assert feed.applied_seq == batch.seq, step
        assert feed.router.blocks_of("r0") == pub.snapshot().blocks, step
    assert resyncs == feed.replays + feed.snapshots > 0


def test_load_reports_reach_the_router():
    router = Router("least_loaded", BS)
    feeds = [joined("r0", router), joined("r1", router)]
    feeds[0].report(ReplicaLoad(num_waiting=3, num_running=1, kv_usage=0.5))
    assert feeds[0].load == ReplicaLoad(3, 1, 0.5) and feeds[1].load is None
    assert router.load_of("r0") == 0.5 * 3 + 0.5
    assert router.route(PROMPT) == "r1"


def test_a_request_is_finished_only_in_the_epoch_it_was_routed_in():
    router = Router("round_robin", BS)
    feed = joined("r0", router)
    assert router.route(PROMPT) == "r0"
    epoch = feed.epoch
    loaded = router.load_of("r0")
    feed.finished(epoch)
    assert router.load_of("r0") < loaded  # counted there no more
    assert router.route(PROMPT) == "r0"
    feed.lose(1.0)
    feed.finished(epoch)  # not a member: nothing to finish (the router dropped its count)
    feed.join(2.0)
    feed.finished(epoch)  # an earlier epoch's request: not this one's (Router.finished would raise)
    assert router.load_of("r0") == 0.0


def test_a_continuation_asks_for_the_rest_of_one_sample():
    params = SamplingParams(max_tokens=10, temperature=0.0, n=3, stop=["\n"], seed=7)
    prompt = [1, 2, 3]
    resumed, rest = continuation(prompt, params, [7, 8])
    assert resumed == [1, 2, 3, 7, 8] and prompt == [1, 2, 3]
    assert rest == SamplingParams(max_tokens=8, temperature=0.0, n=1, stop=["\n"], seed=7)
    first, same = continuation(prompt, SamplingParams(max_tokens=10), [])
    assert first == prompt and same == SamplingParams(max_tokens=10)


def test_a_replica_answers_with_its_batches_while_it_holds_them_else_a_snapshot() -> None:
    pub, _ = publisher(6, replay=4)
    taken: list[KvSnapshot] = []

    def snapshot() -> KvSnapshot:
        taken.append(pub.snapshot())
        return taken[-1]

    assert [b.seq for b in replica_answer(pub, 3, snapshot)] == [4, 5, 6]
    assert replica_answer(pub, 6, snapshot) == [] and not taken  # nothing new
    for after, bound in ((1, None), (None, None), (3, 2)):  # past the buffer; knows nothing; past the bound
        assert replica_answer(pub, after, snapshot, bound) == pub.snapshot()
    assert len(taken) == 3


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
