"""`python -m lab bench http --quick --json` on the tiny model: it starts its own server, replays
a few trace requests over HTTP and in process, and reports every figure with no error; and the
pieces it is made of (the open-loop replay, the SSE client against a fake server's stream)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from lab.bench.http import RequestFailed, Timing, combine, http_sender, replay
from lab.serving.workload import ServingRequest

FIGURES = ("throughput_output_tokens_per_s", "throughput_requests_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s",
           "tpot_p99_s", "tpot_mean_s", "load_avg")


def test_quick_run_reports_every_figure_without_errors() -> None:
    command = [sys.executable, "-m", "lab", "bench", "http", "--quick", "--json", "--model", "tiny"]
    # Its own session, so that on a timeout the benchmark and the server it started go together.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               cwd=Path(__file__).resolve().parents[2])
    try:
        out, err = process.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    assert process.returncode == 0, err
    report = json.loads(out)
    assert set(report["contenders"]) == {"pagedkv http", "pagedkv in-process"}
    requests = report["config"]["requests"]
    for name, figures in report["contenders"].items():
        assert figures["errors"] == 0 and figures["completed"] == requests, (name, figures["error_samples"])
        assert figures["output_tokens"] == round(report["config"]["mean_output_tokens"] * requests)
        for key in FIGURES:
            assert isinstance(figures[key], float) and figures[key] > 0, (name, key, figures[key])
        assert figures["ttft_p50_s"] <= figures["ttft_p99_s"] and figures["tpot_p50_s"] <= figures["tpot_p99_s"]
    assert report["overhead"]["tpot_mean_ratio"] > 0 and isinstance(report["overhead"]["target_met"], bool)
    assert "TPOT p50 ms" in err and "pagedkv in-process" in err  # the table, on stderr with --json


def _request(i: int, arrival_s: float, max_tokens: int = 3) -> ServingRequest:
    return ServingRequest(f"r{i}", arrival_s, np.arange(3, 8, dtype=np.int64), max_tokens)


def test_replay_keeps_arrival_times_and_bounds_concurrency() -> None:
    in_flight, peak, sent_at = 0, 0, {}

    async def send(request: ServingRequest) -> Timing:
        nonlocal in_flight, peak
        sent_at[request.request_id] = time.perf_counter()
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.05)
        in_flight -= 1
        now = time.perf_counter()
        if request.request_id == "r3":
            raise RequestFailed("refused")
        return Timing(now - 0.04, now, request.max_tokens if request.request_id != "r2" else 1)

    requests = [_request(0, 0.0), _request(1, 0.0), _request(2, 0.0), _request(3, 0.2)]
    results, wall = asyncio.run(replay(requests, 2, send))
    assert peak == 2
    assert results[2].wait_s >= 0.04  # r2 waited for a slot
    assert sent_at["r3"] - sent_at["r0"] >= 0.19  # not sent before it was due
    assert [r.error for r in results] == [None, None, "1 tokens, expected 3", "refused"]
    assert results[0].tpot_s == pytest.approx(0.02, abs=0.005) and 0.2 <= wall < 1.0


def _sse(*chunks: object) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


def _send_with(body: bytes, status: int = 200) -> Timing:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def go() -> Timing:
        async with httpx.AsyncClient(base_url="http://test", transport=transport) as client:
            return await http_sender(client, "m")(_request(0, 0.0))

    return asyncio.run(go())


def test_http_sender_reads_tokens_from_usage_and_refuses_incomplete_streams() -> None:
    text = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    end = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 3}}
    timing = _send_with(_sse({"choices": [{"index": 0, "text": "", "finish_reason": None}]}, text, end, usage, b"[DONE]"))
    assert timing.tokens == 3 and timing.first_s <= timing.last_s
    for body, message in [
        (_sse(text, end, usage), "without \\[DONE\\]"),
        (_sse(text, end, b"[DONE]"), "no usage"),
        (_sse(text, {"error": {"message": "boom"}}, b"[DONE]"), "boom"),
    ]:
        with pytest.raises(RequestFailed, match=message):
            _send_with(body)
    with pytest.raises(RequestFailed, match="HTTP 503"):
        _send_with(b'{"error": {}}', status=503)


def test_combine_sums_counts_and_takes_medians() -> None:
    rounds = [{"errors": 1, "error_samples": ["x"], "tpot_mean_s": 1.0, "ttft_p50_s": None},
              {"errors": 0, "error_samples": [], "tpot_mean_s": 3.0, "ttft_p50_s": 2.0}]
    assert combine(rounds) == {"errors": 1, "error_samples": ["x"], "tpot_mean_s": 2.0, "ttft_p50_s": 2.0}


def test_llama_server_command_needs_the_built_binary_and_a_gguf(tmp_path) -> None:
    from lab.__main__ import build_parser
    from lab.bench.http import llama_server_command
    from pagedkv.errors import InvalidArgumentError

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    args = build_parser().parse_args(["bench", "http", "--model", str(gguf), "--peer", "llama-server",
                                      "--peers-dir", str(tmp_path), "--concurrency", "3"])
    with pytest.raises(FileNotFoundError, match="make peers"):
        llama_server_command(args, 1234, 64)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("")
    command = llama_server_command(args, 1234, 64)
    flags = dict(zip(command[1::2], command[2::2], strict=False))
    assert flags["-m"] == str(gguf) and flags["--host"] == "127.0.0.1" and flags["--port"] == "1234"
    assert flags["-np"] == "3" and flags["-c"] == str(3 * 64) and flags["-t"] == "2"
    args.model = "tiny"
    with pytest.raises(InvalidArgumentError, match="GGUF"):
        llama_server_command(args, 1234, 64)


def test_peer_vllm_without_its_venv_fails_first_naming_make_peers(tmp_path, capsys) -> None:
    from lab.__main__ import main

    with pytest.raises(SystemExit) as stop:  # before any model loads or server starts
        main(["bench", "http", "--quick", "--peer", "vllm", "--vllm-venv", str(tmp_path / "none")])
    assert stop.value.code == 1
    assert "make peers" in capsys.readouterr().err


def test_vllm_command_serves_the_converted_model_under_the_client_name(tmp_path) -> None:
    from lab.__main__ import build_parser
    from lab.bench.http import vllm_command, vllm_env
    from pagedkv.errors import InvalidArgumentError

    venv, peers = tmp_path / "venv", tmp_path / "peers"
    args = build_parser().parse_args(["bench", "http", "--peer", "vllm", "--vllm-venv", str(venv), "--peers-dir", str(peers),
                                      "--concurrency", "3", "--max-model-len", "512", "--threads", "1"])
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    with pytest.raises(FileNotFoundError, match="make peers"):  # the model not converted yet
        vllm_command(args, 1234)
    model = peers / "models" / "smollm2-hf"
    model.mkdir(parents=True)
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576}
    (model / "config.json").write_text(json.dumps(config))
    command = vllm_command(args, 1234)
    assert command[:3] == [str(venv / "bin" / "python"), str(Path(__file__).resolve().parents[2] / "scripts" / "vllm_serve.py"),
                           str(model)]
    flags = dict(zip(command[3::2], command[4::2], strict=False))
    assert flags["--served-model-name"] == "smollm2-135m" and flags["--port"] == "1234" and flags["--dtype"] == "bfloat16"
    assert flags["--max-num-seqs"] == "3" and flags["--max-model-len"] == "512"
    env = vllm_env(args, pool_tokens=100_000)  # 100k tokens × 23,040 bytes in bfloat16: 2.1 GiB
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == 1
    args.model = "tiny"
    with pytest.raises(InvalidArgumentError, match="--peer vllm"):
        vllm_command(args, 1234)
