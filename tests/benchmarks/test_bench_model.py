"""The peers of `python -m lab bench model` that run as scripts (transformers, vLLM): the JSON-lines
protocol they speak to the bench, and vLLM's command and environment, checked with stand-in
scripts (the real peers are installed by `make peers`, outside CI)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from lab.bench import model

STAND_IN = """
import json, sys
print("INFO a library writing to stdout", flush=True)
print(json.dumps({"ready": True, "argv": sys.argv[1:]}), flush=True)
for n, _ in enumerate(sys.stdin, 1):
    print("INFO another log line", flush=True)
    print(json.dumps({"decode": 10.0 * n, "batch_4": 40.0 * n}), flush=True)
"""


def test_a_script_peer_skips_its_library_logs_and_answers_one_round_per_request(tmp_path: Path) -> None:
    script = tmp_path / "peer.py"
    script.write_text(STAND_IN)
    peer = model.ScriptPeer([sys.executable, str(script), "--x"])
    try:
        assert peer.info == {"ready": True, "argv": ["--x"]}
        assert peer.round() == {"decode": 10.0, "batch_4": 40.0}
        assert peer.round() == {"decode": 20.0, "batch_4": 80.0}
    finally:
        peer.close()
    assert peer.process.returncode == 0


def test_a_peer_that_dies_is_an_error_naming_it(tmp_path: Path) -> None:
    script = tmp_path / "dies.py"
    script.write_text("import sys; print('no JSON here'); sys.exit(3)")
    with pytest.raises(RuntimeError, match=r"dies\.py exited \(3\)"):
        model.ScriptPeer([sys.executable, str(script)])


def test_the_vllm_peer_runs_its_script_in_its_venv_with_logs_on_stderr(tmp_path: Path, monkeypatch) -> None:
    venv, peers = tmp_path / "venv", tmp_path / "peers"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.symlink_to(sys.executable)
    directory = peers / "models" / "smollm2-hf"
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9,
                                                       "num_key_value_heads": 3, "hidden_size": 576}))
    seen: dict = {}

    def fake(command, env=None):
        seen.update(command=command, env=env)
        return "peer"

    monkeypatch.setattr(model, "ScriptPeer", fake)
    args = argparse.Namespace(vllm_venv=venv, vllm_dtype="bfloat16", model="smollm2-135m", peers_dir=peers)
    assert model.vllm_peer(args, (4, 16)) == "peer"
    command, env = seen["command"], seen["env"]
    assert command[:2] == [str(python), str(model.REPO / "scripts" / "bench_vllm.py")]
    assert command[command.index("--model") + 1] == str(directory)
    assert command[command.index("--dtype") + 1] == "bfloat16" and command[command.index("--batches") + 1] == "4,16"
    assert env["VLLM_LOGGING_STREAM"] == "ext://sys.stderr" and env["HF_HUB_OFFLINE"] == "1"
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) >= 1
