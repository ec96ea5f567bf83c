"""The eviction policy of cached blocks from Python: ``eviction_policy`` is validated where the
scheduler is made, and under ``"slru"`` a system prompt that was hit survives one-off prompts that
evict it under ``"lru"`` (the same scenario as the Rust test, through the scheduler's loop)."""

from __future__ import annotations

import argparse

import pytest

from pagedkv import InvalidArgumentError, Scheduler
from pagedkv.cli import add_engine_arguments, engine_kwargs
from pagedkv.engine import EngineConfig


def serve(s: Scheduler, request_id: str, prompt: list[int]) -> None:
    """Runs one request of one output token to the end."""
    s.add_request(request_id, prompt_token_ids=prompt, max_tokens=1)
    while s.has_unfinished():
        out = s.schedule()
        s.update(out, [7] * len(out.logits_indices))
        s.check_invariants()


@pytest.mark.parametrize(("policy", "hits_after"), [("lru", 0), ("slru", 8)])
def test_slru_keeps_a_hit_system_prompt(policy: str, hits_after: int) -> None:
    s = Scheduler(num_blocks=14, block_size=4, max_model_len=48, eviction_policy=policy, admission_lookahead_tokens=None)
    system = list(range(3, 12))  # two full blocks and one token
    serve(s, "first", system)
    serve(s, "hit", system)
    assert s.stats()["prefix_hit_tokens"] == 8
    for i in range(3):
        serve(s, f"once{i}", [100 * (i + 1) + t for t in range(9)])
    serve(s, "big", list(range(1000, 1045)))  # needs every block but the system prompt's two
    before = s.stats()["prefix_hit_tokens"]
    serve(s, "again", system)
    assert s.stats()["prefix_hit_tokens"] - before == hits_after


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="eviction_policy"):
        Scheduler(num_blocks=8, eviction_policy="arc")


def test_the_engine_and_its_cli_default_to_slru() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert EngineConfig().eviction_policy == "slru"
    assert engine_kwargs(parser.parse_args([]))["eviction_policy"] == "slru"
