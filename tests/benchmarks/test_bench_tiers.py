"""``python -m lab bench tiers --quick --json`` runs end to end on the tiny model: every
variant serves the whole workload, and the warm restart finds on disk what the cold start
recomputes."""

from __future__ import annotations

import json

import pytest

from lab.__main__ import main
from lab.bench.tiers import build_sessions
from pagedkv.traces import load_trace


def test_sessions_share_growing_prefixes() -> None:
    sessions = build_sessions(load_trace("conv", limit=12), sessions=3, turns=4, length_scale=0.1, max_prompt_len=10_000,
                              vocab=(3, 512))
    for session in sessions:
        assert len(session.prompts) == 4
        for before, after in zip(session.prompts, session.prompts[1:], strict=False):
            assert len(after) > len(before) and after[: len(before)] == before
    assert sessions[0].prompts[0][:8] != sessions[1].prompts[0][:8]


def test_bench_tiers_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "tiers", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    requests = report["workload"]["requests"]
    assert report["model"] == "tiny" and report["workload"]["working_set_blocks"] > report["workload"]["ram_blocks"]
    for variant in ("ram_lru", "ram_slru", "ram_disk"):
        assert report["variants"][variant]["requests"] == requests
    assert report["variants"]["ram_disk"]["disk"]["disk_offloads"] > 0
    cold, warm = report["restart"]["cold"], report["restart"]["warm"]
    assert warm["opened"]["recovered"] > 0 and cold["opened"]["recovered"] == 0
    assert warm["prefix_hit_rate"] > cold["prefix_hit_rate"]
    assert all(row["disk_loads"] == row["blocks"] for row in report["crossover"]["rows"])
    assert set(report["targets"]) >= {"ttft_p50_met", "warm_restart_met"}
