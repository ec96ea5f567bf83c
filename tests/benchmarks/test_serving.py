"""The serving benchmark's parts: reservation baselines (exact figures on hand-made traces), the
replay driver, paged accounting, workloads, the ``bench serve --quick --json`` contract, and the
engine's Prometheus endpoint scraped over HTTP."""

from __future__ import annotations

import contextlib
import io
import json
import math
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lab.__main__ import main
from lab.serving.replay import PagedPolicy, SimulatedTime, replay
from lab.serving.report import summarize
from lab.serving.reservation import ContinuousReservationPolicy, StaticBatchingPolicy
from lab.serving.workload import ServingRequest, SystemPrompts, build_workload, ideal_prefill_tokens
from pagedkv.engine import EngineConfig, EngineCore, SimulatedRunner
from pagedkv.models.simulated import SimulatedModel, StepCostModel
from pagedkv.traces import TraceRequest, load_trace

ONE_SECOND_PER_STEP = StepCostModel(fixed=1.0, per_token=0.0, per_context_token=0.0)


def request(name: str, prompt_len: int, max_tokens: int, arrival_s: float = 0.0, first_token: int = 3) -> ServingRequest:
    tokens = np.arange(first_token, first_token + prompt_len, dtype=np.int64)
    return ServingRequest(name, arrival_s, tokens, max_tokens)


# A: 3-token prompt, 2 outputs; B: 4-token prompt, 4 outputs; C: 2-token prompt, 1 output.
ABC = [request("A", 3, 2), request("B", 4, 4), request("C", 2, 1)]


def finish_times(result) -> dict[str, float]:
    return {r.request_id: r.metrics.finished_time for r in result.requests}


def run_reservation(kind, requests, capacity=20, max_model_len=10, budget=100):
    clock = SimulatedTime()
    policy = kind(capacity, max_model_len, clock, cost=ONE_SECOND_PER_STEP, max_num_batched_tokens=budget)
    return replay(policy, requests, clock)


def test_static_batching_holds_the_batch_until_its_last_request_finishes():
    # Two reservations of 10 slots: {A, B} form the batch; C waits for B although A's seat is free.
    result = run_reservation(StaticBatchingPolicy, ABC)
    assert finish_times(result) == {"A": 2.0, "B": 4.0, "C": 5.0}
    assert {r.request_id: r.metrics.ttft for r in result.requests} == {"A": 1.0, "B": 1.0, "C": 5.0}
    assert [s.reserved_slots for s in result.steps] == [20, 20, 20, 20, 10]
    # Live K/V after each step: prompts, then one more token per decode; A's slots are dead once done.
    assert [s.live_tokens for s in result.steps] == [7, 9, 6, 7, 2]
    assert [s.num_running for s in result.steps] == [2, 2, 1, 1, 1]
    summary = summarize(result, "hand-made")
    assert summary.kv_utilization == pytest.approx((7 / 20 + 9 / 20 + 6 / 20 + 7 / 20 + 2 / 10) / 5)
    assert summary.prefill_tokens == 9 and summary.generated_tokens == 7
    assert summary.peak_running == 2 and summary.preemptions == 0


def test_continuous_reservation_admits_into_a_freed_seat_at_the_next_iteration():
    result = run_reservation(ContinuousReservationPolicy, ABC)
    assert finish_times(result) == {"A": 2.0, "B": 4.0, "C": 3.0}
    assert [s.reserved_slots for s in result.steps] == [20, 20, 20, 10]
    assert [s.live_tokens for s in result.steps] == [7, 9, 8, 7]
    assert summarize(result, "hand-made").kv_utilization == pytest.approx((7 / 20 + 9 / 20 + 8 / 20 + 7 / 10) / 4)


def test_reservations_chunk_prompts_under_the_token_budget():
    # Budget 4, one second per token: B's 6-token prompt takes three steps; A (admitted first)
    # goes first at every step. Step 1: A's prompt 2 + B's chunk 2 (4 s); step 2: A decodes 1 +
    # B's chunk 3 (4 s); step 3: A decodes 1 + B's last token 1, both sample and finish (2 s).
    clock = SimulatedTime()
    policy = ContinuousReservationPolicy(
        20, 10, clock, cost=StepCostModel(fixed=0.0, per_token=1.0, per_context_token=0.0), max_num_batched_tokens=4
    )
    result = replay(policy, [request("A", 2, 3), request("B", 6, 1)], clock)
    assert [s.scheduled_tokens for s in result.steps] == [4, 4, 2]
    assert [s.prefill_tokens for s in result.steps] == [4, 3, 1]
    assert finish_times(result) == {"A": 10.0, "B": 10.0}
    assert {r.request_id: r.metrics.ttft for r in result.requests} == {"A": 4.0, "B": 10.0}


def test_reservation_refuses_a_request_longer_than_a_reservation():
    policy = StaticBatchingPolicy(20, 10, SimulatedTime())
    with pytest.raises(Exception, match="max_model_len"):
        policy.add_request(request("long", 8, 3))


def test_replay_waits_for_arrivals_and_measures_from_arrival():
    requests = [request("early", 2, 2, arrival_s=0.0), request("late", 2, 1, arrival_s=10.0)]
    result = run_reservation(ContinuousReservationPolicy, requests)
    assert [s.start_s for s in result.steps] == [0.0, 1.0, 10.0]  # the clock jumps the idle gap
    late = next(r.metrics for r in result.requests if r.request_id == "late")
    assert late.arrival_time == 10.0 and late.ttft == 1.0 and late.e2e_latency == 1.0
    summary = summarize(result, "hand-made")
    assert summary.duration_s == 11.0
    assert summary.throughput_requests_per_s == pytest.approx(2 / 11)
    assert summary.throughput_tokens_per_s == pytest.approx(3 / 11)


def test_requests_arriving_during_a_step_join_after_it():
    clock = SimulatedTime()
    policy = ContinuousReservationPolicy(20, 10, clock, cost=ONE_SECOND_PER_STEP)
    result = replay(policy, [request("a", 2, 3), request("b", 2, 1, arrival_s=0.5)], clock)
    b = next(r.metrics for r in result.requests if r.request_id == "b")
    assert b.first_token_time == 2.0  # queued at t=1, after the step it arrived during


def paged_policy(num_blocks=8, block_size=16, prefix_caching=False, max_model_len=128):
    clock = SimulatedTime()
    config = EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=8, max_num_batched_tokens=512,
                             max_model_len=max_model_len, enable_prefix_caching=prefix_caching)
    runner = SimulatedRunner(SimulatedModel(cost=ONE_SECOND_PER_STEP), clock, max_model_len=max_model_len)
    return PagedPolicy("paged", EngineCore(runner, config, clock=clock), clock), clock


def test_paged_accounting_counts_the_unwritten_tail_of_the_last_block():
    policy, clock = paged_policy()
    result = replay(policy, [request("a", 20, 3)], clock)
    # 20 prompt tokens, then 21 and 22 cached: always 2 blocks (32 slots) reserved.
    assert [s.reserved_slots for s in result.steps] == [32, 32, 32]
    assert [s.live_tokens for s in result.steps] == [20, 21, 22]
    assert summarize(result, "one").kv_utilization == pytest.approx(63 / 96)
    assert finish_times(result) == {"a": 3.0}
    assert result.totals.prefill_tokens == 20


def test_paged_prefix_cache_reuses_whole_blocks_of_a_shared_system_prompt():
    system = np.arange(100, 140, dtype=np.int64)  # 40 tokens: two full blocks of 16 are reusable
    requests = [
        ServingRequest(f"r{i}", 10.0 * i, np.concatenate([system, np.arange(1000 * (i + 1), 1000 * (i + 1) + 5)]), 2, 0, 40)
        for i in range(3)
    ]
    policy, clock = paged_policy(prefix_caching=True)
    result = replay(policy, requests, clock)
    assert result.totals.prefix_hit_tokens == 2 * 32
    assert result.totals.prefill_tokens == 3 * 45 - 2 * 32 == ideal_prefill_tokens(requests, 16)


def test_ideal_prefill_keeps_the_last_prompt_token_and_whole_blocks():
    system_only = ServingRequest("x", 0.0, np.arange(3, 35), 1, 0, 32)  # the prompt is the system prompt
    first = ServingRequest("y", 0.0, np.arange(3, 43), 1, 0, 32)
    assert ideal_prefill_tokens([first], 16) == 40  # nothing seen before
    # Seen: 32 reusable tokens, but the last must be recomputed, so only one block of 16 counts.
    assert ideal_prefill_tokens([first, system_only], 16) == 40 + 16
    assert ideal_prefill_tokens([first, first], 16) == 40 + 8
    unrelated = ServingRequest("z", 0.0, np.arange(3, 43), 1, None, 0)
    assert ideal_prefill_tokens([first, unrelated], 16) == 80


def test_workload_truncates_shares_and_draws_poisson_arrivals():
    trace = [TraceRequest(0.0, 50, 10), TraceRequest(1.0, 200, 300), TraceRequest(2.0, 30, 5)]
    plain = build_workload(trace, max_model_len=256)
    assert [r.arrival_s for r in plain.requests] == [0.0, 1.0, 2.0]
    assert [r.max_tokens for r in plain.requests] == [10, 128, 5]  # outputs capped at half the context
    assert plain.requests[1].prompt_len == 128 and plain.truncated_prompts == 1
    shared = build_workload(trace, max_model_len=4096, system_prompts=SystemPrompts(count=1, min_len=64, max_len=64))
    prompts = [r.prompt_token_ids for r in shared.requests]
    assert all(np.array_equal(p[:64], prompts[0][:64]) for p in prompts)
    assert [len(p) for p in prompts] == [114, 264, 94]
    assert not np.array_equal(prompts[0][64:94], prompts[2][64:94])  # own tokens are not shared
    many = load_trace(limit=2000)
    poisson = build_workload(many, max_model_len=8192, rate=5.0)
    gaps = np.diff([r.arrival_s for r in poisson.requests])
    assert np.mean(gaps) == pytest.approx(0.2, rel=0.1)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)
    assert poisson.offered_rate == pytest.approx(5.0, rel=0.1)


def test_code_trace_is_shipped():
    code = load_trace("code", limit=5)
    assert len(code) == 5 and code[0].arrival_s == 0.0


def test_quick_bench_json_contract():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "serve", "--quick", "--json", "--real-requests", "2"]) == 0
    report = json.loads(out.getvalue())
    names = [p["name"] for p in report["policies"]]
    assert names == ["static-reservation", "continuous-reservation", "paged", "paged-prefix-cache"]
    keys = {"name", "throughput_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
            "kv_utilization", "peak_running", "prefix_hit_rate", "preemptions"}
    for policy in report["policies"]:
        assert keys <= policy.keys()
        assert policy["requests"] == 60
        assert 0.0 < policy["kv_utilization"] <= 1.0
        assert policy["ttft_p50_s"] <= policy["ttft_p99_s"]
    by_name = {p["name"]: p for p in report["policies"]}
    assert report["paged_throughput_over_static"] == pytest.approx(
        by_name["paged"]["throughput_tokens_per_s"] / by_name["static-reservation"]["throughput_tokens_per_s"])
    assert by_name["paged-prefix-cache"]["prefix_hit_rate"] > 0
    assert by_name["paged"]["prefix_hit_rate"] == 0
    prefix = report["prefix_caching"]
    assert prefix["within_ideal"] == (prefix["prefill_tokens"] <= prefix["ideal_prefill_tokens"])
    assert prefix["ideal_prefill_tokens"] < prefix["prompt_tokens"]
    assert [p["name"] for p in report["shared_prefix_workload"]] == names
    real = report["real_model"]
    assert [p["name"] for p in real["policies"]] == ["paged", "paged-prefix-cache"]
    assert all(p["requests"] == 2 for p in real["policies"])


def scrape(port: int) -> dict[str, float]:
    """Samples of ``/metrics`` by name (one model label, so names are unique)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples if not s.labels.get("le")}


def test_prometheus_endpoint_matches_the_engine_counts():
    from pagedkv.engine import Engine
    from pagedkv.sampling import SamplingParams

    shared = list(range(10, 74))  # 64 tokens: four full blocks shared by every prompt
    prompts = [shared + [100 + i, 200 + i, 300 + i] for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with Engine.from_pretrained("tiny", num_blocks=128, block_size=16) as engine:
        port = engine.metrics.serve(0)
        engine.submit(prompts[0], params).result(timeout=60)  # caches the shared blocks
        handles = [engine.submit(p, params) for p in prompts[1:]]
        during = scrape(port)
        outputs = [h.result(timeout=60) for h in handles]
        after = scrape(port)
        stats = engine.stats()

    assert during["pagedkv:request_success_total"] >= 1
    assert during["pagedkv:generation_tokens_total"] <= after["pagedkv:generation_tokens_total"]
    assert after["pagedkv:request_success_total"] == len(prompts) == stats["finished_requests"]
    generated = 24 * len(prompts)
    assert sum(len(o.token_ids) for o in outputs) == 24 * len(outputs)
    assert after["pagedkv:generation_tokens_total"] == generated == stats["generated_tokens"]
    assert after["pagedkv:prompt_tokens_total"] == stats["prefill_tokens"]
    assert after["pagedkv:prefix_cache_queries_total"] == stats["prefix_queried_tokens"] == sum(map(len, prompts))
    assert after["pagedkv:prefix_cache_hits_total"] == stats["prefix_hit_tokens"] >= 64 * (len(prompts) - 1)
    assert after["pagedkv:num_preemptions_total"] == stats["preemptions"]
    assert after["pagedkv:e2e_request_latency_seconds_count"] == len(prompts)
    assert after["pagedkv:time_to_first_token_seconds_count"] == len(prompts)
    assert after["pagedkv:num_requests_running"] == 0 and after["pagedkv:num_requests_waiting"] == 0
    assert math.isfinite(after["pagedkv:e2e_request_latency_seconds_sum"])
