"""The simulated cluster: with replica failures and lost KV events injected, every request
completes, each client stream equals an uninterrupted greedy run (no token lost or duplicated
by migration), and the router's index ends equal to each engine's blocks wherever it can know."""

from __future__ import annotations

import pytest

from lab.serving.cluster import ClusterSetup, simulate_cluster
from lab.serving.simulation import ServingSetup
from lab.serving.workload import SystemPrompts, Workload, build_workload
from pagedkv.cluster import POLICIES
from pagedkv.errors import InvalidArgumentError
from pagedkv.traces import load_trace

SMALL = ServingSetup(num_blocks=192, block_size=16, max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=512)


def workload(seed: int, requests: int = 36) -> Workload:
    return build_workload(
        load_trace("conv", limit=requests),
        max_model_len=SMALL.max_model_len,
        rate=30.0,
        system_prompts=SystemPrompts(count=5, min_len=64, max_len=256),
        length_scale=0.1,
        seed=seed,
    )


def uninterrupted(work: Workload) -> dict[str, list[int]]:
    result = simulate_cluster(work, ClusterSetup(replicas=1, policy="round_robin", replica=SMALL))
    return {r.request_id: r.token_ids for r in result.requests}


@pytest.mark.parametrize("seed", range(6))
def test_failures_and_event_loss_lose_no_request_and_no_token(seed):
    work = workload(seed)
    expected = uninterrupted(work)
    setup = ClusterSetup(
        replicas=3,
        policy=POLICIES[seed % len(POLICIES)],
        replica=SMALL,
        event_loss=0.3,
        replay=2,  # two batches lost in a row outrun it: a snapshot
        mtbf_s=0.6,
        detect_s=0.05,
        restart_s=0.2,
        seed=seed,
    )
    result = simulate_cluster(work, setup)
    assert all(r.finished_s is not None for r in result.requests)
    for request in result.requests:
        assert request.token_ids == expected[request.request_id], request.request_id
        assert len(request.token_ids) == request.max_tokens
        assert request.first_token_s is not None and request.arrival_s <= request.first_token_s <= request.finished_s
    assert result.failures > 0 and result.migrations > 0
    assert result.lost_messages > 0 and result.replays > 0 and result.snapshots > 0
    # Once the messages in flight have landed, an index is wrong only where it cannot know.
    assert result.index_in_sync + result.index_behind == result.index_live


def test_prefix_aware_routing_finds_the_cached_prefixes_round_robin_misses():
    work = build_workload(
        load_trace("conv", limit=60),
        max_model_len=SMALL.max_model_len,
        rate=20.0,
        system_prompts=SystemPrompts(count=12, min_len=400, max_len=800),
        length_scale=0.1,
        seed=1,
    )
    hits = {}
    for policy in ("round_robin", "prefix_aware"):
        result = simulate_cluster(work, ClusterSetup(replicas=4, policy=policy, replica=SMALL))
        assert all(r.finished_s is not None for r in result.requests)
        assert result.index_in_sync == result.index_live == 4  # nothing lost, nothing behind
        hits[policy] = result.summary()["prefix_hit_rate"]
    assert hits["prefix_aware"] > hits["round_robin"] + 0.1


def test_the_many_tenant_trace_draws_tenants_by_a_zipf_law():
    trace = load_trace("conv", limit=400)
    skewed = build_workload(trace, max_model_len=8192, system_prompts=SystemPrompts(count=50, skew=1.0), seed=3)
    counts = [sum(r.system_prompt == k for r in skewed.requests) for k in range(50)]
    assert counts[0] > 3 * max(counts[25:])  # P(0) / P(k) = k + 1 under skew 1
    uniform = build_workload(trace, max_model_len=8192, system_prompts=SystemPrompts(count=50), seed=3)
    assert max(sum(r.system_prompt == k for r in uniform.requests) for k in range(50)) < counts[0]
    with pytest.raises(InvalidArgumentError):
        build_workload(trace, max_model_len=8192, system_prompts=SystemPrompts(skew=-1.0))
