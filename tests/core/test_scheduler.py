"""The Python face of the continuous-batching scheduler, scenario by scenario, with exact figures:
budget splitting, chunked prefill beside decodes, admission order, preemption and resume, abort
in every state, stop tokens, prefix hits, parallel sampling, the aging bound, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import (
    DuplicateSequenceError,
    InvalidArgumentError,
    Scheduler,
    ShapeError,
    UnknownSequenceError,
)


def next_token(last: int, position: int) -> int:
    """A deterministic stand-in for a model: depends on the last token and its position only."""
    return (last * 31 + position * 7) % 997 + 3


def step(s: Scheduler):
    """Schedules a step, samples with `next_token` (+ sample index), updates; returns both."""
    out = s.schedule()
    rows = out.logits_indices
    sampled = [
        next_token(int(out.input_ids[r]), int(out.positions[r])) + int(k)
        for r, k in zip(rows, out.sample_seq_indices, strict=True)
    ]
    produced = s.update(out, sampled)
    s.check_invariants()
    return out, produced


def run_to_end(s: Scheduler, max_steps: int = 10_000) -> dict[tuple[str, int], list[int]]:
    tokens: dict[tuple[str, int], list[int]] = {}
    for _ in range(max_steps):
        if not s.has_unfinished():
            return tokens
        _, produced = step(s)
        for request_id, seq_index, token, _reason in produced:
            tokens.setdefault((request_id, seq_index), []).append(token)
    raise AssertionError("not finished")


def used_blocks(s: Scheduler, num_blocks: int) -> int:
    return num_blocks - s.num_free_blocks


def test_step_arrays_have_the_documented_dtypes_and_shapes():
    s = Scheduler(num_blocks=8, block_size=4)
    s.add_request("a", [10, 11, 12, 13, 14, 15], max_tokens=2)
    s.add_request("b", np.array([20, 21], dtype=np.int64), max_tokens=2)
    out = s.schedule()
    for name, dtype, shape in [
        ("input_ids", np.int64, (8,)),
        ("positions", np.int64, (8,)),
        ("slot_mapping", np.int64, (8,)),
        ("query_start_loc", np.int32, (3,)),
        ("context_lens", np.int32, (2,)),
        ("block_tables", np.int32, (2, 2)),
        ("copy_ops", np.int64, (0, 2)),
        ("logits_indices", np.int64, (2,)),
    ]:
        array = getattr(out, name)
        assert array.dtype == dtype and array.shape == shape, name
    assert out.query_start_loc.tolist() == [0, 6, 8]
    assert out.context_lens.tolist() == [6, 2]
    assert out.logits_indices.tolist() == [5, 7]
    assert out.request_ids == ["a", "b"] and out.sample_request_ids == ["a", "b"]
    tables = out.block_tables
    assert tables[1, 1] == -1
    expected_slots = [tables[0, p // 4] * 4 + p % 4 for p in range(6)] + [tables[1, 0] * 4, tables[1, 0] * 4 + 1]
    assert out.slot_mapping.tolist() == expected_slots
    produced = s.update(out, np.array([100, 200]))
    assert list(produced) == [("a", 0, 100, None), ("b", 0, 200, None)]


def test_budget_is_split_across_long_prompts_in_chunks():
    s = Scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=100, long_prefill_token_threshold=40)
    for i, name in enumerate("ABC"):
        s.add_request(name, list(range(1000 * i, 1000 * i + 90)), max_tokens=5)
    contexts, samples = [], []
    for _ in range(4):
        out, _ = step(s)
        contexts.append(out.context_lens.tolist())
        samples.append(out.logits_indices.tolist())
    assert contexts == [[40, 40, 20], [80, 80, 40], [90, 90, 80], [91, 91, 90]]
    assert samples == [[], [], [9, 19], [0, 1, 11]]


def test_a_prompt_far_larger_than_the_budget_is_chunked_while_others_decode():
    s = Scheduler(num_blocks=128, block_size=16, max_num_batched_tokens=64)
    s.add_request("d1", list(range(8)), max_tokens=50)
    s.add_request("d2", list(range(100, 108)), max_tokens=50)
    s.add_request("big", list(range(1000, 2000)), max_tokens=1)
    scheduled, big_context = [], []
    for _ in range(17):
        out, produced = step(s)
        scheduled.append(out.num_scheduled_tokens)
        big_context.append(int(out.context_lens[2]))
        assert [p[0] for p in produced][:2] == ["d1", "d2"], "decodes run every step"
    # 48 + 15 x 62 = 978 tokens, then the last 22 in step 16.
    assert scheduled == [64] * 16 + [24]
    assert big_context == [48 + 62 * k for k in range(16)] + [1000]
    assert "big" not in s  # it sampled its one token in step 16 and finished


@pytest.mark.parametrize("policy, expected", [("fcfs", ["a", "b", "c"]), ("priority", ["b", "c", "a"])])
def test_admission_order_follows_the_policy(policy, expected):
    s = Scheduler(num_blocks=16, block_size=4, max_num_seqs=1, policy=policy, aging_steps=1000)
    for name, priority in [("a", 5), ("b", 0), ("c", 1)]:
        s.add_request(name, [1, 2, 3, 4], max_tokens=1, priority=priority)
    order = [step(s)[0].request_ids[0] for _ in range(3)]
    assert order == expected
    assert not s.has_unfinished()


def test_aging_bounds_how_long_a_low_priority_request_waits():
    # One sequence at a time, a new priority-0 request every step: without aging "low" starves.
    s = Scheduler(num_blocks=64, block_size=4, max_num_seqs=1, policy="priority", aging_steps=4)
    s.add_request("low", [1, 2], max_tokens=2, priority=3)
    ahead = []
    for t in range(40):
        s.add_request(f"hi{t}", [1, 2], max_tokens=2, priority=0)
        out, _ = step(s)
        if out.stats["num_admitted"]:
            if out.request_ids[0] == "low":
                break
            ahead.append(out.request_ids[0])
    # Bound: no request added after step 0 + (3 - 0) * 4 = 12 is admitted before "low".
    assert ahead == [f"hi{t}" for t in range(12)]


def test_preemption_recomputes_and_resumes_with_the_same_tokens():
    def workload(s: Scheduler) -> None:
        for r in range(6):
            s.add_request(f"r{r}", [t * 13 + r for t in range(20)], max_tokens=30)

    roomy = Scheduler(num_blocks=96, block_size=4)
    workload(roomy)
    expected = run_to_end(roomy)
    assert roomy.stats()["preemptions"] == 0

    tight = Scheduler(num_blocks=20, block_size=4, admission_lookahead_tokens=None)  # no headroom
    workload(tight)
    assert run_to_end(tight) == expected
    assert tight.stats()["preemptions"] > 0
    assert tight.num_free_blocks == 20

    # The default headroom (32 tokens, capped by max_tokens: 8 blocks each) runs them one at a time.
    headroom = Scheduler(num_blocks=20, block_size=4)
    workload(headroom)
    assert run_to_end(headroom) == expected
    assert headroom.stats()["preemptions"] == 0 and headroom.stats()["peak_running"] == 1


def test_admission_keeps_headroom_for_running_sequences_except_in_an_empty_batch():
    s = Scheduler(num_blocks=16, block_size=4, admission_lookahead_tokens=8)
    s.add_request("a", [1] * 10, max_tokens=50)  # 3 blocks, then 2 of headroom
    s.add_request("b", [2] * 12, max_tokens=50)  # 3 + 2 + 2 <= 13 free
    s.add_request("c", [3] * 20, max_tokens=50)  # 5 + 2 + 4 > 10 free: waits
    out, _ = step(s)
    assert out.stats["num_admitted"] == 2 and out.request_ids == ["a", "b"]
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (2, 1, 10)

    legacy = Scheduler(num_blocks=16, block_size=4, admission_lookahead_tokens=None)
    for rid, prompt in (("a", [1] * 10), ("b", [2] * 12), ("c", [3] * 20)):
        legacy.add_request(rid, prompt, max_tokens=50)
    out, _ = step(legacy)
    assert out.stats["num_admitted"] == 3 and legacy.num_free_blocks == 5

    # 60 tokens take 15 of 16 blocks and the headroom does not fit, but nothing runs: admitted.
    s = Scheduler(num_blocks=16, block_size=4, admission_lookahead_tokens=8)
    s.add_request("big", [7] * 60, max_tokens=4)
    s.add_request("small", [8] * 2, max_tokens=4)
    out, _ = step(s)
    assert out.request_ids == ["big"] and s.num_free_blocks == 1
    run_to_end(s)
    assert s.stats()["preemptions"] == 0 and s.stats()["generated_tokens"] == 8

    with pytest.raises(InvalidArgumentError):
        Scheduler(num_blocks=16, admission_lookahead_tokens=-1)


def test_the_most_recently_admitted_sequence_is_preempted_and_waits_at_the_head():
    s = Scheduler(num_blocks=4, block_size=4, admission_lookahead_tokens=None)  # no headroom: c fits
    s.add_request("a", [1] * 7, max_tokens=10)
    s.add_request("b", [2] * 3, max_tokens=10)
    s.add_request("c", [3] * 3, max_tokens=10)
    step(s)
    step(s)  # a holds 8 tokens (2 blocks), b and c 4 each: the cache is full
    out, _ = step(s)
    assert out.stats["num_preempted"] == 2  # a's third block: c goes, then b
    assert out.request_ids == ["a"]
    assert (s.num_running, s.num_waiting) == (1, 2)
    assert s.sequence_tokens("c")[:3] == [3, 3, 3] and len(s.sequence_tokens("c")) == 5  # kept its output


def test_abort_in_every_state_returns_every_block():
    s = Scheduler(num_blocks=8, block_size=4)
    s.add_request("running", [1] * 9, max_tokens=100)
    s.add_request("waiting", [2] * 25, max_tokens=100)
    step(s)
    assert (s.num_running, s.num_waiting) == (1, 1)
    s.abort("waiting")
    s.abort("running")
    assert s.num_free_blocks == 8 and not s.has_unfinished()
    with pytest.raises(UnknownSequenceError):
        s.abort("running")

    s.add_request("prefilling", [3] * 20, max_tokens=5)
    s = Scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    s.add_request("prefilling", [3] * 20, max_tokens=5)
    step(s)
    assert s.num_free_blocks == 6  # 8 of 20 prompt tokens computed
    s.abort("prefilling")
    assert s.num_free_blocks == 8

    # Aborted between schedule and update: its sample is skipped, the other goes through.
    s.add_request("x", [1, 2, 3], max_tokens=5)
    s.add_request("y", [4, 5, 6], max_tokens=5)
    out = s.schedule()
    s.abort("x")
    produced = s.update(out, [7, 8])
    assert list(produced) == [("y", 0, 8, None)]
    s.abort("y")
    s.check_invariants()
    assert s.num_free_blocks == 8


def test_stop_tokens_eos_and_length_limits():
    s = Scheduler(num_blocks=16, block_size=4, max_model_len=6, eos_token_ids=[2])
    s.add_request("eos", [9, 9, 9], max_tokens=100)
    s.add_request("ignore", [9, 9, 9], max_tokens=100, ignore_eos=True)
    s.add_request("stop", [9, 9, 9], max_tokens=100, stop_token_ids=[5], ignore_eos=True)
    s.add_request("short", [9, 9, 9], max_tokens=1)
    produced = s.update(s.schedule(), [2, 2, 5, 4])
    assert produced.finish_reasons == ["stop", None, "stop", "length"]
    assert produced.finished_request_ids == ["eos", "stop", "short"]
    assert s.update(s.schedule(), [2]).finish_reasons == [None]
    assert list(s.update(s.schedule(), [2])) == [("ignore", 0, 2, "max_model_len")]  # 6 tokens
    assert s.num_free_blocks == 16


def test_any_of_several_eos_ids_finishes_a_sequence():
    s = Scheduler(num_blocks=16, block_size=4, eos_token_ids=[2, 465])
    for request_id in ("a", "b"):
        s.add_request(request_id, [9, 9, 9], max_tokens=4)
    s.add_request("c", [9, 9, 9], max_tokens=4, ignore_eos=True)
    produced = s.update(s.schedule(), [465, 2, 465])
    assert produced.finish_reasons == ["stop", "stop", None]
    assert produced.finished_request_ids == ["a", "b"]


def test_requests_sharing_a_system_prompt_hit_its_full_blocks():
    system = list(range(1000, 1040))  # 40 tokens: two full blocks of 16, then 8 more
    s = Scheduler(num_blocks=64, block_size=16)
    s.add_request("A", system + list(range(10)), max_tokens=4)
    step(s)
    s.add_request("B", system + list(range(50, 60)), max_tokens=4)
    out, _ = step(s)
    assert out.request_ids == ["A", "B"]
    # B's row starts after the 32 cached tokens: 18 tokens computed, context 50.
    assert out.query_start_loc.tolist() == [0, 1, 19]
    assert out.positions[1:].tolist() == list(range(32, 50))
    assert out.block_tables[0, :2].tolist() == out.block_tables[1, :2].tolist()
    stats = s.stats()
    assert (stats["prefix_queried_tokens"], stats["prefix_hit_tokens"]) == (100, 32)
    assert stats["prefix_hit_rate"] == pytest.approx(0.32)


def test_a_shared_prefix_shorter_than_a_block_gives_no_hit_but_counts_the_lookup():
    s = Scheduler(num_blocks=64, block_size=16)
    s.add_request("A", list(range(10)) + [500] * 30, max_tokens=4)
    step(s)
    s.add_request("B", list(range(10)) + [600] * 30, max_tokens=4)
    out, _ = step(s)
    assert out.positions[1] == 0
    stats = s.stats()
    assert (stats["prefix_queried_tokens"], stats["prefix_hit_tokens"]) == (80, 0)


def test_cache_salt_separates_tenants():
    s = Scheduler(num_blocks=64, block_size=16)
    s.add_request("A", list(range(40)), max_tokens=4, cache_salt="tenant-a")
    step(s)
    s.add_request("B", list(range(40)), max_tokens=4, cache_salt="tenant-b")
    s.add_request("C", list(range(40)), max_tokens=4, cache_salt="tenant-a")
    step(s)
    assert s.stats()["prefix_hit_tokens"] == 32  # only C hits A's two full blocks


def test_parallel_samples_share_the_prompt_blocks_until_they_diverge():
    s = Scheduler(num_blocks=16, block_size=16)
    prompt = list(range(20))  # one full block and a partial one
    s.add_request("p", prompt, max_tokens=3, n=3)
    out = s.schedule()
    assert out.num_seqs == 1 and out.logits_indices.tolist() == [19, 19, 19]
    assert out.sample_request_ids == ["p"] * 3 and out.sample_seq_indices.tolist() == [0, 1, 2]
    s.update(out, [100, 200, 300])
    assert used_blocks(s, 16) == 2 and s.num_running == 3
    out = s.schedule()
    assert out.input_ids.tolist() == [100, 200, 300] and out.positions.tolist() == [20, 20, 20]
    # The partial block is copied for two samples; the third keeps it; the full block stays shared.
    assert out.copy_ops.shape == (2, 2)
    assert len(set(out.block_tables[:, 0].tolist())) == 1
    assert len(set(out.block_tables[:, 1].tolist())) == 3
    assert used_blocks(s, 16) == 4
    s.update(out, [101, 201, 301])
    assert s.sequence_tokens("p", 1) == prompt + [200, 201]
    produced = s.update(s.schedule(), [102, 202, 302])
    assert produced.finished_request_ids == ["p"]
    assert s.num_free_blocks == 16


def test_bad_input_raises_typed_errors_and_changes_nothing():
    with pytest.raises(InvalidArgumentError):
        Scheduler(num_blocks=4, block_size=4, max_model_len=17)  # more than the cache holds
    with pytest.raises(InvalidArgumentError):
        Scheduler(num_blocks=4, policy="lottery")
    s = Scheduler(num_blocks=8, block_size=4, max_model_len=16, max_num_seqs=4)
    s.add_request("a", [1, 2, 3], max_tokens=4)
    bad = [
        (DuplicateSequenceError, dict(request_id="a", prompt_token_ids=[1])),
        (InvalidArgumentError, dict(request_id="b", prompt_token_ids=[])),
        (InvalidArgumentError, dict(request_id="b", prompt_token_ids=[1] * 16)),
        (InvalidArgumentError, dict(request_id="b", prompt_token_ids=[1], max_tokens=0)),
        (InvalidArgumentError, dict(request_id="b", prompt_token_ids=[1], n=5)),
        (InvalidArgumentError, dict(request_id="b", prompt_token_ids=[-1])),
    ]
    for error, kwargs in bad:
        with pytest.raises(error):
            s.add_request(**kwargs)
    assert len(s) == 1 and "b" not in s and s.num_waiting == 1
    with pytest.raises(UnknownSequenceError):
        s.abort("b")
    out = s.schedule()
    with pytest.raises(InvalidArgumentError):
        s.schedule()  # the step awaits its update
    with pytest.raises(ShapeError):
        s.update(out, [1, 2])
    assert s.update(out, [7]).token_ids.tolist() == [7]  # the failed call changed nothing
    with pytest.raises(InvalidArgumentError):
        s.update(out, [7])  # already updated
    assert s.sequence_tokens("a") == [1, 2, 3, 7]
    s.check_invariants()


@pytest.mark.parametrize(
    "kwargs",
    [
        # Item 2: each of these killed the engine's worker with TypeError / OverflowError.
        dict(priority="high"),
        dict(priority=1.5),
        dict(priority=2**63),
        dict(cache_salt=123),
        dict(cache_salt=b"x"),
        dict(cache_salt="\udc80"),
        dict(request_id=5),
        dict(request_id=("a",)),
        dict(request_id="\udc80"),
        dict(max_tokens=2**63),
        dict(max_tokens=-1),
        dict(max_tokens=1.0),
        dict(n=2**63),
        dict(n=True),
        dict(arrival_time=float("nan")),
        dict(arrival_time="now"),
        dict(arrival_time=True),
        dict(ignore_eos=1),
        dict(ignore_eos=None),
        dict(stop_token_ids=5),
        # Item 19: bools and bytes are not token ids.
        dict(prompt_token_ids=[True, 2]),
        dict(prompt_token_ids=b"hi"),
        dict(prompt_token_ids=np.array([True])),
        dict(stop_token_ids=[False]),
        dict(stop_token_ids=b"\x02"),
    ],
)
def test_every_bad_add_request_argument_is_invalid_argument_and_changes_nothing(kwargs):
    s = Scheduler(num_blocks=8, block_size=4)
    s.add_request("a", [1, 2, 3])
    before = (s.stats(), len(s), s.num_waiting)
    call = dict(request_id="b", prompt_token_ids=[1, 2]) | kwargs
    with pytest.raises(InvalidArgumentError):
        s.add_request(**call)
    assert (s.stats(), len(s), s.num_waiting) == before
    s.add_request("b", [1, 2])  # nothing of the refused call remains


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_blocks=2**63),
        dict(num_blocks=8.0),
        dict(block_size="16"),
        dict(max_num_seqs=-1),
        dict(max_num_batched_tokens=2**31),  # query_start_loc is int32
        dict(max_model_len=2**31),  # context_lens is int32
        dict(enable_prefix_caching="yes"),
        dict(policy=1),
        dict(policy="priority", aging_steps=0),
        dict(aging_steps=1.5),
        dict(long_prefill_token_threshold=2**64),
        dict(eos_token_ids=2),
        dict(eos_token_ids=[True]),
        dict(eos_token_ids=[-1]),
        dict(admission_lookahead_tokens="32"),
    ],
)
def test_every_bad_constructor_argument_is_invalid_argument(kwargs):
    with pytest.raises(InvalidArgumentError):
        Scheduler(**(dict(num_blocks=8) | kwargs))


def test_bad_arguments_of_the_other_methods_are_invalid_argument():
    s = Scheduler(num_blocks=8, block_size=4)
    s.add_request("a", [1, 2, 3])
    out = s.schedule()
    for call in (
        lambda: s.update(out, [True]),
        lambda: s.update(out, b"\x07"),
        lambda: s.update(out, [2**32]),
        lambda: s.update({"step": out.step}, [7]),
        lambda: s.abort(5),
        lambda: s.sequence_tokens("a", -1),
        lambda: s.sequence_tokens("a", 2**32),
        lambda: s.sequence_tokens(b"a"),
    ):
        with pytest.raises(InvalidArgumentError):
            call()
    assert s.update(out, [7]).token_ids.tolist() == [7]
    # Membership answers False for anything that cannot be a request id (item 18).
    assert "a" in s
    for key in (5, b"a", "\udc80", None):
        assert key not in s


def test_update_refuses_another_schedulers_output_of_the_same_step_number():
    """Item 20: step numbers matched, so the other scheduler's output was accepted."""
    mine, other = (Scheduler(num_blocks=8, block_size=4) for _ in range(2))
    mine.add_request("a", [1, 2, 3])
    other.add_request("a", [1, 2, 3])
    out, foreign = mine.schedule(), other.schedule()
    assert out.step == foreign.step == 0
    with pytest.raises(InvalidArgumentError, match="another scheduler"):
        mine.update(foreign, [7])
    assert mine.sequence_tokens("a") == [1, 2, 3]
    assert mine.update(out, [7]).token_ids.tolist() == [7]
    mine.check_invariants()


def test_stats_track_steps_tokens_and_occupancy():
    s = Scheduler(num_blocks=16, block_size=4)
    s.add_request("a", list(range(10)), max_tokens=3)
    run_to_end(s)
    stats = s.stats()
    assert stats["steps"] == 3
    assert stats["scheduled_tokens"] == 12 and stats["prefill_tokens"] == 10
    assert stats["generated_tokens"] == 3 and stats["finished_requests"] == 1
    assert stats["kv_usage"] == 0.0 and stats["peak_running"] == 1


def test_step_events_report_admissions_with_their_hit_preemptions_and_resumptions():
    s = Scheduler(num_blocks=4, block_size=4, admission_lookahead_tokens=None)
    s.add_request("a", [1] * 7, max_tokens=10)
    s.add_request("b", [2] * 3, max_tokens=10)
    s.add_request("c", [3] * 3, max_tokens=10)
    out, _ = step(s)
    assert out.events == [("a", 0, "admitted", 0), ("b", 0, "admitted", 0), ("c", 0, "admitted", 0)]
    out, _ = step(s)
    assert out.events == []
    out, _ = step(s)
    assert out.events == [("c", 0, "preempted", 0), ("b", 0, "preempted", 0)]
    later = []
    while s.has_unfinished():
        out, _ = step(s)
        later += out.events
        kinds = [kind for _, _, kind, _ in out.events]
        assert kinds.count("preempted") == out.stats["num_preempted"]
        assert len(kinds) - kinds.count("preempted") == out.stats["num_admitted"]
        assert sum(hit for *_, hit in out.events) == out.stats["prefix_hit_tokens"]
    # a's growth evicted b's and c's cached blocks; c, preempted again by b, finds its first block.
    assert later == [("b", 0, "resumed", 0), ("c", 0, "resumed", 0), ("c", 0, "preempted", 0), ("c", 0, "resumed", 4)]
    # A prompt sharing two full blocks with a finished one is admitted with that hit.
    s = Scheduler(num_blocks=16, block_size=4)
    s.add_request("x", list(range(10)), max_tokens=2)
    run_to_end(s)
    s.add_request("y", list(range(10)) + [99], max_tokens=2)
    out, _ = step(s)
    assert out.events == [("y", 0, "admitted", 8)]
