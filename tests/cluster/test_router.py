"""The router: its index follows KV events (and heals gaps from snapshots), prefix_aware takes the
longest cached prefix traded off against load, round robin and least loaded spread."""

from __future__ import annotations

import random

import pytest

from pagedkv import block_hashes
from pagedkv.cluster import NoReplicaError, ReplicaLoad, Router, UnknownReplicaError
from pagedkv.errors import InvalidArgumentError
from pagedkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventPublisher

BS = 4
PROMPT = list(range(100, 100 + 8 * BS + 1))  # 8 full reusable blocks, then one token
HASHES = block_hashes(PROMPT, BS)


def holding(blocks: int, medium: str = "ram", prompt=PROMPT, salt=None) -> list[BlockStored]:
    """Events storing the first ``blocks`` blocks of ``prompt``."""
    hashes = block_hashes(prompt, BS, salt)
    parents = [0, *hashes]
    return [
        BlockStored(hashes[i], parents[i], tuple(prompt[i * BS : (i + 1) * BS]), medium) for i in range(blocks)
    ]


def router_with(policy: str = "prefix_aware", replicas: int = 3, **weights) -> tuple[Router, dict[str, KvEventPublisher]]:
    router = Router(policy, block_size=BS, **weights)
    publishers = {}
    for i in range(replicas):
        name = f"r{i}"
        router.add_replica(name)
        publishers[name] = KvEventPublisher()
        publishers[name].subscribe(lambda batch, name=name: router.apply(name, batch))
    return router, publishers


def test_the_longest_cached_prefix_wins():
    router, pubs = router_with()
    pubs["r0"].publish(holding(2))
    pubs["r1"].publish(holding(6))
    pubs["r2"].publish(holding(4))
    assert router.route(PROMPT) == "r1"
    assert router.blocks_of("r1") == {(h, "ram") for h in HASHES[:6]}


def test_ram_is_worth_more_than_disk_and_a_salt_shares_nothing():
    router, pubs = router_with()
    pubs["r0"].publish(holding(5, "disk"))
    pubs["r1"].publish(holding(4, "ram"))
    assert router.route(PROMPT) == "r1"
    router.finished("r1")
    salted, salted_pubs = router_with()
    salted_pubs["r2"].publish(holding(8, salt="tenant-a"))
    assert salted.route(PROMPT, cache_salt="tenant-a") == "r2"
    salted.finished("r2")
    assert salted.route(PROMPT, cache_salt="tenant-b") == "r0"  # no hit: the least loaded, first


def test_a_hit_never_covers_the_last_prompt_token():
    router, pubs = router_with(replicas=2)
    exact = PROMPT[: 8 * BS]  # eight full blocks and nothing after: only seven can be reused
    pubs["r0"].publish(holding(7))
    pubs["r1"].publish(holding(8))
    router.update_load("r1", ReplicaLoad(0, 0, 0.01))  # a hair more loaded
    assert router.route(exact) == "r0"


def test_load_outweighs_a_prefix_past_a_point():
    # A queued request costs queue_weight × the mean prompt (8.25 blocks): half of it here.
    router, pubs = router_with(replicas=2, queue_weight=0.5)
    pubs["r1"].publish(holding(8))
    assert router.route(PROMPT) == "r1"  # idle and holding everything
    router.finished("r1")
    router.update_load("r1", ReplicaLoad(num_waiting=1, num_running=0, kv_usage=0.1))
    assert router.route(PROMPT) == "r1"  # one queued request (4.1 blocks) costs less than 8 of prefill
    router.update_load("r1", ReplicaLoad(num_waiting=30, num_running=10, kv_usage=0.9))
    assert router.route(PROMPT) == "r0"  # a long queue costs more
    # Requests routed since the last load report count as queued: without any report, r1 takes
    # two, then its queue (8.25 blocks) outweighs its prefix (8).
    fresh, fresh_pubs = router_with(replicas=2, queue_weight=0.5)
    fresh_pubs["r1"].publish(holding(8))
    assert [fresh.route(PROMPT) for _ in range(3)] == ["r1", "r1", "r0"]
    # A report showing them running takes them out of the queue: r1 is preferred again.
    fresh.update_load("r1", ReplicaLoad(num_waiting=0, num_running=2, kv_usage=0.1))
    assert fresh.route(PROMPT) == "r1"


def test_round_robin_spreads_and_skips_the_excluded():
    router, _ = router_with("round_robin", replicas=4)
    assert [router.route(PROMPT) for _ in range(8)] == ["r0", "r1", "r2", "r3"] * 2
    assert router.route(PROMPT, exclude={"r0"}) == "r1"
    router.remove_replica("r2")
    assert [router.route(PROMPT) for _ in range(3)] == ["r3", "r0", "r1"]
    assert router.replicas == ("r0", "r1", "r3")


def test_least_loaded_follows_routes_finishes_and_reports():
    router, pubs = router_with("least_loaded", replicas=3)
    pubs["r2"].publish(holding(8))  # ignored by this policy
    assert [router.route(PROMPT) for _ in range(3)] == ["r0", "r1", "r2"]
    router.finished("r1")
    assert router.route(PROMPT) == "r1"
    router.update_load("r0", ReplicaLoad(num_waiting=0, num_running=0, kv_usage=0.0))  # stale: 1 routed
    router.update_load("r2", ReplicaLoad(num_waiting=5, num_running=3, kv_usage=0.5))
    assert router.load_of("r2") > router.load_of("r0")
    router.finished("r0")
    with pytest.raises(InvalidArgumentError):
        router.finished("r0")  # nothing routed there is left


def test_gaps_are_refused_and_a_resync_makes_the_index_the_truth():
    """Drops batches on purpose; the router refuses what follows a gap, and a replay or a snapshot
    (when the replay buffer is short) restores exactly the publisher's state."""
    rng = random.Random(3)
    router = Router(block_size=BS)
    router.add_replica("r0")
    publisher = KvEventPublisher(replay=2)  # two losses in a row outrun it: a snapshot
    refused = replays = snapshots = 0

    def deliver(batch):
        nonlocal refused, replays, snapshots
        if rng.random() < 0.3:
            return  # lost
        if router.apply("r0", batch):
            return
        refused += 1
        missed = publisher.since(router.applied_seq("r0"))
        if missed is None:
            snapshots += 1
            router.resync("r0", publisher.snapshot())
        else:
            replays += 1
            for old in missed:
                assert router.apply("r0", old)

    publisher.subscribe(deliver)
    for _ in range(300):
        events = []
        for _ in range(rng.randrange(1, 4)):
            h, medium = rng.randrange(40), rng.choice(["ram", "disk"])
            kind = rng.random()
            if kind < 0.55:
                events.append(BlockStored(h, 0, (1,), medium))
            elif kind < 0.97:
                events.append(BlockRemoved(h, medium))
            else:
                events.append(AllBlocksCleared(medium))
        publisher.publish(events)
    publisher.publish([BlockStored(1000, 0, (1,), "ram")])  # delivered, or it heals the last gap
    if router.applied_seq("r0") != publisher.last_seq:
        router.resync("r0", publisher.snapshot())
    assert refused > 0 and replays > 0 and snapshots > 0
    assert router.blocks_of("r0") == publisher.snapshot().blocks
    # A batch already covered (before the snapshot, or replayed) is ignored.
    assert router.apply("r0", publisher.since(publisher.last_seq - 1)[0])
    assert router.blocks_of("r0") == publisher.snapshot().blocks


def test_an_older_snapshot_never_rolls_the_index_back():
    router, pubs = router_with(replicas=1)
    old = pubs["r0"].snapshot()
    pubs["r0"].publish(holding(3))
    router.resync("r0", old)
    assert router.blocks_of("r0") == pubs["r0"].snapshot().blocks


def test_removal_forgets_the_index_and_errors_are_typed():
    router, pubs = router_with(replicas=2)
    pubs["r1"].publish(holding(8))
    router.remove_replica("r1")
    router.add_replica("r1")  # a restarted replica rejoins empty, at batch 0
    assert router.blocks_of("r1") == frozenset() and router.applied_seq("r1") == 0
    assert router.route(PROMPT) == "r0"
    with pytest.raises(NoReplicaError):
        router.route(PROMPT, exclude=("r0", "r1"))
    with pytest.raises(NoReplicaError):
        Router(block_size=BS).route(PROMPT)
    with pytest.raises(UnknownReplicaError):
        router.apply("nope", pubs["r0"].publish(holding(1)))
    with pytest.raises(InvalidArgumentError):
        router.add_replica("r0")
    with pytest.raises(InvalidArgumentError):
        Router("random")
    with pytest.raises(InvalidArgumentError):
        router.update_load("r0", ReplicaLoad(0, 0, 1.5))
