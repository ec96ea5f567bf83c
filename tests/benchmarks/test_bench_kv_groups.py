"""``python -m lab bench kv-groups --json`` on Gemma 3 270M's layout: the hybrid cache holds a
long sequence in less than a third of the uniform cache's bytes (never below the full layers'
share, 3 of 18), fits more sequences in the same budget, and hits the prefix cache as often."""

from __future__ import annotations

import json

import pytest

from lab.__main__ import main


def test_bench_kv_groups_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kv-groups", "--contexts", "512,8192", "--budget-mib", "256", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # Pages of 16 tokens of 3 layers: the full group (first: group 0 is the one a router hashes),
    # two sliding groups carving theirs into blocks of 8 tokens of 6 layers, and the last 3
    # sliding layers in whole pages.
    layout = [(len(g["layers"]), g["window"], g["block_size"]) for g in report["layout"]]
    assert layout == [(3, None, 16), (6, 512, 8), (6, 512, 8), (3, 512, 16)]
    short, long = report["bytes_per_sequence"]
    # Within one window the sliding groups keep everything: the layouts hold the same tokens.
    assert short["hybrid_bytes"] <= short["uniform_bytes"]
    assert 3 / 18 < long["ratio"] < 1 / 3
    # Smaller sliding blocks hold less of what left the window.
    assert long["hybrid_bytes"] < long["hybrid_one_size_bytes"] < long["uniform_bytes"]
    fits = report["concurrency"]
    assert fits["hybrid"]["peak_running"] > 2 * fits["uniform"]["peak_running"] > 0
    for rates in report["prefix_hit_rate"].values():
        assert rates["hybrid"] == rates["uniform"] > 0
    # Larger blocks waste more of the window (a sliding group's edge blocks) and narrow the tables.
    by_size = report["fragmentation_by_block_size"]
    rows = [by_size[f"{bs}/{bs}"] for bs in (8, 16, 32, 64)]
    for small, large in zip(rows, rows[1:], strict=False):
        assert 0 <= small["sliding_fragmentation"] < large["sliding_fragmentation"]
        assert small["mean_table_width"] > large["mean_table_width"]
    assert all(row["full_fragmentation"] < row["sliding_fragmentation"] for row in rows)
    # Carving the sliding pages: their waste falls with their blocks, the full group's stays.
    one_size, carved = by_size["16/16"], by_size["16/8"]
    assert carved["sliding_fragmentation"] < one_size["sliding_fragmentation"]
    assert carved["full_fragmentation"] == one_size["full_fragmentation"]
    assert carved["groups"] < one_size["groups"]
