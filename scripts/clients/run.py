"""Outside CI (``make clients``): the clients people point at an OpenAI-compatible server, run
against ``pagedkv serve --model smollm2-135m`` as a new user would (issue 21).

1. guidellm's benchmark on the chat endpoint (its default request shape: text parts, streamed,
   ``stream_options.continuous_usage_stats``), synthetic prompts counted with the model's own
   tokenizer: its errors, TTFT and inter-token latency.
2. lm-eval's ``local-completions`` on a small multiple-choice task (``mc.jsonl``: loglikelihood
   requests, ``echo`` with ``logprobs``), and the same task scored from :class:`pagedkv.Engine`
   directly (the sum of each choice's prompt logprobs, as lm-eval sums them): the two accuracies
   and the choices made.

The clients live in their own venv (``CLIENTS_VENV``, default ``.clients/venv``, made and filled
here), never in pagedkv's. The server runs on 127.0.0.1 and is stopped at the end. Results go to
``.clients/`` (``CLIENTS_OUT``) and a summary to stdout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

import pagedkv
from pagedkv import SamplingParams

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
OUT = Path(os.environ.get("CLIENTS_OUT", REPO / ".clients"))
VENV = Path(os.environ.get("CLIENTS_VENV", OUT / "venv"))
MODEL = "smollm2-135m"
TASK = """task: pagedkv_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def clients_venv() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "guidellm", "lm-eval[api]"], check=True)
    return VENV / "bin"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagedkv", "serve", "--model", MODEL, "--port", str(port), "--max-num-seqs", "32"]
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    server.kill()
    raise TimeoutError(log.read_text())


def guidellm_summary(path: Path) -> dict:
    """Requests by status, and the median TTFT and inter-token latency (ms), of guidellm's report."""
    benchmark = json.loads(path.read_text())["benchmarks"][0]
    metrics = benchmark["metrics"]
    return {
        "requests": metrics["request_totals"],
        "ttft_ms_median": metrics["time_to_first_token_ms"]["successful"]["median"],
        "itl_ms_median": metrics["inter_token_latency_ms"]["successful"]["median"],
    }


def engine_scores(data: Path, tokenizer) -> list[list[float]]:
    """Each question's choices' summed logprobs, scored by the engine directly."""
    engine = pagedkv.Engine.from_pretrained(MODEL)
    scored = []
    try:
        for line in data.read_text().splitlines():
            doc = json.loads(line)
            context = tokenizer.encode(doc["question"], add_special_tokens=False)
            sums = []
            for choice in doc["choices"]:
                continuation = tokenizer.encode(choice, add_special_tokens=False)
                output = engine.generate([context + continuation], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
                scores = output.prompt_logprobs[len(context):]
                sums.append(sum(entry.logprob for entry in scores))
            scored.append(sums)
    finally:
        engine.shutdown()
    return scored


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    bin_dir = clients_venv()
    tokenizer_dir = OUT / "tokenizer"
    engine = pagedkv.Engine.from_pretrained(MODEL)
    tokenizer = engine.tokenizer
    tokenizer.save(tokenizer_dir)
    engine.shutdown()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(port, OUT / "server.log")
    summary: dict = {}
    try:
        guidellm_out = OUT / "guidellm.json"
        guidellm = subprocess.run(
            [str(bin_dir / "guidellm"), "run", "--backend", f"kind=openai_http,target={url}",
             "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=32",
             "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=64",
             "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
             "--output", f"kind=json,path={guidellm_out}", "--disable-console-interactive"],
            capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        (OUT / "guidellm.log").write_text(guidellm.stdout + guidellm.stderr)
        summary["guidellm_exit"] = guidellm.returncode
        summary["guidellm"] = guidellm_summary(guidellm_out) if guidellm_out.exists() else None
        task_dir = OUT / "task"
        task_dir.mkdir(exist_ok=True)
        (task_dir / "pagedkv_mc.yaml").write_text(TASK.format(data=HERE / "mc.jsonl"))
        lm_eval_out = OUT / "lm_eval"
        model_args = (f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                      f"tokenizer={tokenizer_dir},num_concurrent=1,max_retries=1")
        lm_eval = subprocess.run(
            [str(bin_dir / "lm_eval"), "--model", "local-completions", "--model_args", model_args, "--tasks", "pagedkv_mc",
             "--include_path", str(task_dir), "--output_path", str(lm_eval_out), "--log_samples"],
            capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
        )
        (OUT / "lm_eval.log").write_text(lm_eval.stdout + lm_eval.stderr)
        summary["lm_eval_exit"] = lm_eval.returncode
        results = sorted(lm_eval_out.rglob("results_*.json"))
        if results:
            summary["lm_eval_acc"] = json.loads(results[-1].read_text())["results"]["pagedkv_mc"]["acc,none"]
    finally:
        server.terminate()
        server.wait(timeout=60)
    direct = engine_scores(HERE / "mc.jsonl", tokenizer)
    answers = [json.loads(line)["answer"] for line in (HERE / "mc.jsonl").read_text().splitlines()]
    picks = [int(np.argmax(sums)) for sums in direct]
    summary["engine_acc"] = float(np.mean([p == a for p, a in zip(picks, answers, strict=True)]))
    samples = sorted(lm_eval_out.rglob("samples_pagedkv_mc_*.jsonl"))
    if samples:
        docs = sorted((json.loads(line) for line in samples[-1].read_text().splitlines()), key=lambda d: d["doc_id"])
        served = [[float(ll) for ll, _ in doc["filtered_resps"]] for doc in docs]
        summary["same_choices"] = [int(np.argmax(sums)) for sums in served] == picks
        summary["loglikelihood_max_abs_difference"] = float(np.max(np.abs(np.array(served) - np.array(direct))))
    print(json.dumps(summary, indent=1))
    return 0 if summary.get("guidellm_exit") == 0 and summary.get("lm_eval_exit") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
