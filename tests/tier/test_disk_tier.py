"""The disk tier through the engine, on the tiny model: greedy parity through evict → offload →
load → hit; random workloads on a tiny RAM pool with a disk tier give the tokens of a huge pool,
every invariant holding after every step; corrupt and truncated data files are dropped and
recomputed; a warm restart hits the disk tier; a tier of another model is cleared; KV events and
snapshots agree with the blocks held; the threaded engine, its stats and its metrics; the tier's
files are private and never reached through a planted link, and a damaged index is cleared."""

from __future__ import annotations

import os
import random
import stat
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

import pagedkv
from pagedkv.engine import Engine
from pagedkv.kv_events import BlockStored, KvEventBatch
from pagedkv.models import DenseReference, LlamaWeights
from pagedkv.sampling import SamplingParams
from support.tier_workload import BLOCK_BYTES, BLOCK_SIZE, FIXED, GREEDY, SYSTEMS, greedy, random_prompt, tiny_core, tiny_model

DATA_FILE = "blocks.dat"
INDEX_FILE = "index.redb"


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(weights: LlamaWeights) -> DenseReference:
    return DenseReference(weights)  # conftest's weights: the same seed-0 tiny model


def dense(reference: DenseReference, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    with threadpool_limits(limits=1, user_api="blas"):
        return [reference.generate_greedy(p, max_tokens) for p in prompts]


def fillers(seed: int, count: int, blocks: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(blocks * BLOCK_SIZE + 1)] for _ in range(count)]


def offload_fixed(core, seed: int = 0) -> None:
    """Serves the fixed prompts, then fillers that evict their blocks from the small RAM pool, and
    waits for the tier's writes: the fixed prompts' blocks are then on disk only."""
    greedy(core, FIXED, prefix="warm")
    for i, filler in enumerate(fillers(seed, 4, 6)):
        greedy(core, [filler], max_tokens=1, prefix=f"filler{i}-")
    core.scheduler.flush_disk_tier()


def delta(after: dict, before: dict, key: str) -> float:
    return after[key] - before[key]


def test_greedy_parity_through_evict_offload_load_hit(tiny, reference, tmp_path: Path) -> None:
    model, identity = tiny
    # Every cached block offloaded as soon as it is released (tiny_core's watermark), so the
    # fillers evict none unsaved.
    core = tiny_core(model, identity, tmp_path, num_blocks=12)
    try:
        prompt = SYSTEMS[2] + [9, 8, 7]  # 5 full blocks
        first = greedy(core, [prompt], max_tokens=8, prefix="a")
        for i, filler in enumerate(fillers(1, 2, 10)):  # each needs 11 of the 12 blocks
            greedy(core, [filler], max_tokens=1, prefix=f"f{i}-")
        core.scheduler.flush_disk_tier()
        before = core.stats()
        again = greedy(core, [prompt], max_tokens=8, prefix="b", check=True)
        after = core.stats()
    finally:
        core.close()
    assert delta(after, before, "disk_loads") == 5 and delta(after, before, "disk_hits") == 5
    assert delta(after, before, "disk_hit_tokens") == 5 * BLOCK_SIZE
    assert delta(after, before, "prefill_tokens") == len(prompt) - 5 * BLOCK_SIZE  # the rest was loaded
    assert first == again == dense(reference, [prompt], 8)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), ram_blocks=st.integers(12, 16), disk_blocks=st.integers(4, 40),
       watermark=st.floats(0.05, 1.0))
def test_random_workloads_on_a_tiny_pool_and_a_disk_tier_equal_a_huge_pool(
    tiny, seed: int, ram_blocks: int, disk_blocks: int, watermark: float
) -> None:
    model, identity = tiny
    rng = random.Random(seed)
    workload = [(random_prompt(rng), rng.randrange(1, 6)) for _ in range(10)]
    huge = tiny_core(model, identity, None, num_blocks=512)
    expected = [greedy(huge, [p], n, prefix=f"h{i}-")[0] for i, (p, n) in enumerate(workload)]
    with tempfile.TemporaryDirectory() as directory:
        core = tiny_core(model, identity, Path(directory), ram_blocks, capacity_blocks=disk_blocks, emit_kv_events=True,
                         offload_watermark_blocks=max(1, round(watermark * ram_blocks)))  # some drop unsaved
        try:
            got: list[list[int]] = []
            for i in range(0, len(workload), 2):  # two at a time: a load overlaps the other's compute
                pair = workload[i : i + 2]
                got += greedy(core, [p for p, _ in pair], prefix=f"t{i}-", check=True, max_tokens_each=[n for _, n in pair])
                stats = core.stats()
                assert stats["disk_blocks"] <= disk_blocks
                assert stats["disk_hits"] == stats["disk_loads"] + stats["disk_loads_dropped"]
            core.scheduler.flush_disk_tier()
            stats = core.stats()  # nothing in flight; each offload stored, lost, or already on disk
            assert stats["disk_jobs_in_flight"] == 0
            assert stats["disk_offloads_issued"] >= stats["disk_offloads"] + stats["disk_offloads_lost"]
            # What the tier holds is what it stored, less what it evicted and (some of) what it dropped.
            held = stats["disk_offloads"] - stats["disk_evictions"]
            assert held - stats["disk_dropped_corrupt"] <= stats["disk_blocks"] <= held, stats
            snapshot = core.kv_snapshot()
            # The events' fold is the engine's truth, per medium (one block may be in both).
            assert core.kv_events.snapshot() == snapshot
            assert sum(m == "disk" for _, m in snapshot.blocks) == core.stats()["disk_blocks"]
        finally:
            core.close()
    assert got == expected


def test_corrupt_and_truncated_blocks_are_dropped_and_recomputed(tiny, tmp_path: Path) -> None:
    model, identity = tiny
    expected = greedy(tiny_core(model, identity, None, num_blocks=256), FIXED)
    core = tiny_core(model, identity, tmp_path, num_blocks=16)
    offload_fixed(core)
    stored = core.stats()["disk_blocks"]
    core.close()
    assert stored >= 10
    data = tmp_path / DATA_FILE
    raw = bytearray(data.read_bytes())
    for offset in range(0, len(raw), max(1, len(raw) // 7)):  # a byte in several blocks
        raw[offset] ^= 0x5A
    data.write_bytes(bytes(raw))
    core = tiny_core(model, identity, tmp_path, num_blocks=16)
    try:
        assert greedy(core, FIXED, check=True) == expected
        corrupt = core.stats()["disk_dropped_corrupt"]
        assert corrupt >= 1
        offload_fixed(core, seed=1)  # the dropped blocks were recomputed and are stored again
    finally:
        core.close()
    with data.open("r+b") as handle:  # slot 0 whole, slot 1 torn, every later one gone
        handle.truncate(BLOCK_BYTES + BLOCK_BYTES // 2)
    core = tiny_core(model, identity, tmp_path, num_blocks=16)
    try:
        assert greedy(core, FIXED, check=True) == expected
        stats = core.stats()
        assert stats["disk_dropped_corrupt"] >= 1 and stats["disk_loads_dropped"] >= 1
        assert stats["disk_hits"] == stats["disk_loads"] + stats["disk_loads_dropped"]
    finally:
        core.close()


def test_a_warm_restart_hits_the_disk_tier(tiny, tmp_path: Path) -> None:
    model, identity = tiny
    core = tiny_core(model, identity, tmp_path, num_blocks=16)
    offload_fixed(core)
    stored = core.stats()["disk_blocks"]
    first = greedy(core, FIXED, prefix="before")
    core.close()
    core = tiny_core(model, identity, tmp_path, num_blocks=16)
    try:
        assert core.disk_tier is not None and core.disk_tier["recovered"] >= stored - 4 and not core.disk_tier["cleared"]
        again, disk_hits = [], []
        for i, prompt in enumerate(FIXED):  # one at a time: each request's own disk hits
            before = core.stats()["disk_hit_tokens"]
            again += greedy(core, [prompt], prefix=f"w{i}-")
            disk_hits.append(core.stats()["disk_hit_tokens"] - before)
        stats = core.stats()
    finally:
        core.close()
    assert again == first
    assert all(hit >= 3 * BLOCK_SIZE for hit in disk_hits), disk_hits  # each first request hit its system prompt
    assert stats["disk_loads"] == stats["disk_hits"] > 0


def test_a_tier_of_another_model_is_cleared(tiny, tmp_path: Path) -> None:
    model, identity = tiny
    core = tiny_core(model, identity, tmp_path, num_blocks=16)
    offload_fixed(core)
    core.close()
    other, other_identity = tiny_model(seed=1)
    core = tiny_core(other, other_identity, tmp_path, num_blocks=16, emit_kv_events=True)
    try:
        assert core.disk_tier is not None and core.disk_tier["cleared"] and core.disk_tier["recovered"] == 0
        greedy(core, FIXED)
        assert core.stats()["disk_hits"] == 0
    finally:
        core.close()


def test_kv_events_name_the_block_hashes_of_the_prompts(tiny, tmp_path: Path) -> None:
    model, identity = tiny
    core = tiny_core(model, identity, tmp_path, num_blocks=16, emit_kv_events=True)
    batches: list[KvEventBatch] = []
    unsubscribe = core.kv_events.subscribe(batches.append)
    try:
        greedy(core, FIXED[:1], prefix="one")
        hashes = pagedkv.block_hashes(FIXED[0], BLOCK_SIZE)
        stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
        assert [(e.block_hash, e.medium) for e in stored] == [(h, "ram") for h in hashes]
        blocks = [tuple(FIXED[0][i : i + BLOCK_SIZE]) for i in range(0, len(hashes) * BLOCK_SIZE, BLOCK_SIZE)]
        assert [e.token_ids for e in stored] == blocks
        assert [e.parent_block_hash for e in stored][1:] == hashes[:-1]
        offload_fixed(core)
        snapshot = core.kv_snapshot()
        assert {(h, "disk") for h in hashes} <= snapshot.blocks
        assert snapshot.seq == core.kv_events.last_seq == batches[-1].seq
        assert core.kv_events.snapshot() == snapshot
    finally:
        unsubscribe()
        core.close()


def test_the_threaded_engine_with_a_tier_restarts_warm_and_counts_it(tmp_path: Path) -> None:
    options = dict(kv_disk_path=tmp_path, kv_disk_bytes=1 << 20, num_blocks=16, emit_kv_events=True, offload_watermark_blocks=12)
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine = Engine.from_pretrained("tiny", **options)
    try:
        first = [engine.submit(p, params).result(timeout=60).token_ids for p in FIXED]
        for filler in fillers(3, 4, 6):
            engine.submit(filler, SamplingParams(max_tokens=1, **GREEDY)).result(timeout=60)
        assert engine.kv_snapshot().blocks  # consistent with the events published so far
        assert engine.kv_events.last_seq > 0
    finally:
        engine.shutdown(timeout=60)
    assert engine.stats()["disk_offloads"] > 0
    engine = Engine.from_pretrained("tiny", **options)  # the first engine released the directory
    try:
        again = [engine.submit(p, params).result(timeout=60) for p in FIXED]
        stats = engine.stats()
        metrics = engine.metrics.text()
    finally:
        engine.shutdown(timeout=60)
    assert [o.token_ids for o in again] == first
    assert stats["disk_loads"] > 0
    assert 'pagedkv:kv_disk_loads_total{model_name="pagedkv"}' in metrics
    assert "pagedkv:kv_disk_blocks" in metrics


def test_a_directory_in_use_by_another_engine_is_refused(tiny, tmp_path: Path) -> None:
    model, identity = tiny
    core = tiny_core(model, identity, tmp_path, num_blocks=16)
    try:
        with pytest.raises(pagedkv.KvTierError):
            tiny_core(model, identity, tmp_path, num_blocks=16)
    finally:
        core.close()
    tiny_core(model, identity, tmp_path, num_blocks=16).close()  # free again once closed


@pytest.mark.parametrize("name", [DATA_FILE, INDEX_FILE])
def test_a_link_planted_in_the_tier_directory_is_refused_and_its_target_unchanged(
    tiny, tmp_path: Path, name: str
) -> None:
    """Issue 23 item 8: a link planted at ``DIR/blocks.dat`` or ``DIR/index.redb`` was followed,
    its target overwritten with KV bytes or turned into a redb file."""
    model, identity = tiny
    directory = tmp_path / "tier"
    tiny_core(model, identity, directory, num_blocks=16).close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 1000)
    (directory / name).unlink()
    (directory / name).symlink_to(victim)
    with pytest.raises(pagedkv.KvTierError, match="symbolic link"):
        tiny_core(model, identity, directory, num_blocks=16)
    assert victim.read_bytes() == b"precious" * 1000
    directory.chmod(0o777)  # a directory others can write is refused too: they could plant links
    (directory / name).unlink()
    with pytest.raises(pagedkv.KvTierError, match="other users can write it"):
        tiny_core(model, identity, directory, num_blocks=16)


def test_the_tier_directory_and_files_are_private(tiny, tmp_path: Path) -> None:
    """Issue 23 item 16: the directory was created 0755 and its files 0644, the index holding every
    cached block's token ids: any local user could read what clients asked."""
    model, identity = tiny
    directory = tmp_path / "tier"
    core = tiny_core(model, identity, directory, num_blocks=16)
    try:
        offload_fixed(core)
    finally:
        core.close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert {name: stat.S_IMODE(os.stat(directory / name).st_mode) for name in (DATA_FILE, INDEX_FILE)} == {
        DATA_FILE: 0o600,
        INDEX_FILE: 0o600,
    }


@pytest.mark.parametrize("damage", ["truncate", "zero"])
def test_a_truncated_or_zeroed_index_is_cleared_and_the_engine_serves(tiny, tmp_path: Path, damage: str) -> None:
    """Issue 23 items 20 and 12: a truncated or zeroed index.redb failed every later start with
    KvTierError until the directory was deleted by hand; now it is cleared (the attach report says
    so) and the engine serves, no stale block of blocks.dat served."""
    model, identity = tiny
    expected = greedy(tiny_core(model, identity, None, num_blocks=256), FIXED)
    core = tiny_core(model, identity, tmp_path, num_blocks=16)
    try:
        offload_fixed(core)
        assert core.stats()["disk_blocks"] >= 10
    finally:
        core.close()
    index = tmp_path / INDEX_FILE
    size = index.stat().st_size
    with index.open("r+b") as handle:
        if damage == "truncate":
            handle.truncate(size // 3)
        else:
            handle.write(bytes(size))
    core = tiny_core(model, identity, tmp_path, num_blocks=16)
    try:
        assert core.disk_tier == {"recovered": 0, "cleared": True}
        assert greedy(core, FIXED, check=True) == expected
        stats = core.stats()
        assert stats["disk_hits"] == stats["disk_loads"] == stats["disk_dropped_corrupt"] == 0
        offload_fixed(core, seed=1)  # stored again over the old slots
    finally:
        core.close()
    core = tiny_core(model, identity, tmp_path, num_blocks=16)
    try:
        assert core.disk_tier is not None and core.disk_tier["recovered"] >= 10 and not core.disk_tier["cleared"]
        assert greedy(core, FIXED, prefix="again", check=True) == expected
        assert core.stats()["disk_loads"] > 0
    finally:
        core.close()
