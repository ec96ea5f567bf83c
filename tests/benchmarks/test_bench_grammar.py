"""``python -m lab bench grammar --quick --json`` on SmolLM2 with a short decode: the report's
structure and figures that must hold on any machine (not its speed): every corpus schema
compiled, distributions ordered, compile + first mask never below the compile alone, each batch's
constrained outputs running to the token limit (so both runs decoded the same tokens), and its
ratios and percentages consistent with the figures they come from."""

from __future__ import annotations

import json

import pytest

from lab.__main__ import main
from lab.bench.grammar import CORPUS, PAYLOADS


def test_bench_grammar_quick_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "grammar", "--quick", "--models", "smollm2-135m", "--batches", "1,3", "--new-tokens", "8", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["models"]) == ["smollm2-135m"] and report["threads"] >= 1
    figures = report["models"]["smollm2-135m"]
    assert figures["vocab_size"] == 49_152 and figures["vocabulary_ms"] > 0

    corpus = json.loads(CORPUS.read_text())
    assert set(PAYLOADS) <= {entry["name"] for entry in corpus}
    compiled = figures["compile"]
    assert compiled["schemas"] == len(corpus) and compiled["repeats"] == 1 and compiled["goal_ms"] == 50
    alone, first = compiled["compile_ms"], compiled["compile_and_first_mask_ms"]
    for d in (alone, first):
        assert 0 < d["median"] <= d["p95"] <= d["max"]
        assert d["slowest"] in {entry["name"] for entry in corpus}
    assert first["median"] >= alone["median"] and first["max"] >= alone["max"]

    assert [d["batch"] for d in figures["decode"]] == [1, 3]
    for d in figures["decode"]:
        assert d["new_tokens"] == 8 and d["constrained_finish"] == ["length"]
        assert d["unconstrained_tok_s"] > 0 and d["constrained_tok_s"] > 0
        assert d["ratio"] == pytest.approx(d["constrained_tok_s"] / d["unconstrained_tok_s"], abs=2e-3)
        assert d["mask_mean_ms"] > 0 and d["mask_p95_ms"] > 0
        assert d["mask_percent_of_step"] == pytest.approx(100 * d["mask_mean_ms"] / d["unconstrained_step_ms"], abs=0.02)
        assert d["advance_mean_ms"] > 0 and d["engine_mask_compute_ms"] > 0 and d["engine_mask_wait_ms"] >= 0
        assert d["goal_percent"] == 5
