"""HTTP serving benchmark: open-loop streaming clients against ``pagedkv serve``, the same load on
the in-process :class:`~pagedkv.Engine`, and the peers' servers: llama.cpp's (``--peer llama-server``)
and vLLM's CPU build (``--peer vllm``), both installed by ``make peers``.

Workload (:func:`~lab.serving.workload.build_workload`): the first ``--requests`` requests of
the Azure conversation trace, prompt and output lengths times ``--length-scale``, random token-id
prompts (nothing shared, so no prefix cache helps anyone), arriving at the trace's own times,
stretched or squeezed to a mean of ``--rate`` requests/s if given (the bursts keep their shape).

Open loop: each request is due at its arrival time whatever the others do; at most
``--concurrency`` are in flight, and a due request waits in the client for a free slot (reported
as ``client_wait``, outside TTFT, which starts when the request is sent). Every request is a
streamed ``POST /v1/completions`` of token ids: greedy, ``max_tokens`` from the trace,
``ignore_eos`` (vLLM's extension field, which pagedkv and llama-server both take) so that every
output has the trace's length, and ``stream_options.include_usage``.

Measured by the client, per request: TTFT (sent → the first chunk carrying text or a finish),
TPOT ((last such chunk − first) ÷ (tokens − 1)), tokens from ``usage.completion_tokens``. A
request is an error if it gets a status other than 200, an error event, a stream without
``[DONE]`` or usage, or a token count other than its ``max_tokens``. The in-process run sends the
same requests at the same times through :meth:`Engine.submit` and ``async for`` (tokens counted
as events; TTFT and TPOT timed on the events with text or a finish, the ones the server sends):
``overhead.tpot_mean_ratio`` (HTTP ÷ in-process mean TPOT, the per-output-token time) is the
server's own cost per token; the target is ≤ 1.10.

Client: httpx's ``AsyncClient`` streaming, SSE split by line and parsed with ``json``. The
``openai`` client runs on the same httpx and adds a pydantic object per chunk, client CPU taken
from the two cores the server uses; the client's CPU seconds per output token are reported, and
the server's (from /proc: the whole server process; in process, this process: the engine and its
consumers), whose HTTP ÷ in-process ratio is the overhead in CPU rather than in time.

The same footing for everyone: the pagedkv server and the in-process engine get the same engine
options (:func:`pagedkv.cli.add_engine_arguments`, tracing included), ``--threads`` threads like llama-server;
llama-server gets ``-np`` = the concurrency and ``-c`` = that many slots of the longest request
(llama-server splits its context evenly between slots), and pagedkv's pool holds as many tokens
(``--num-blocks`` unset; ``--max-num-seqs`` unset is the concurrency) with a float16 KV cache
by default, llama.cpp's default cache type.
llama-server's host-memory prompt cache is off (``-cram 0``): random prompts share nothing, and
it would hold up to 8 GiB of a shared machine.
vLLM (``vllm serve`` from .venv-vllm, :func:`vllm_command`) serves the same model converted to a
Hugging Face directory (float32 weights; ``--vllm-dtype``, bfloat16 by default, is what it computes
and caches in), with ``--max-num-seqs`` = the concurrency, its OpenMP threads bound to ``--threads``
cores (``VLLM_CPU_OMP_THREADS_BIND``), a KV cache of at least pagedkv's pool in whole GiB
(``VLLM_CPU_KVCACHE_SPACE``), tcmalloc and Intel OpenMP preloaded as its CPU docs ask, and its
default torch.compile mode (minutes at start, cached in ~/.cache/vllm). A server's CPU time is its
whole process tree's (vLLM serves from three processes). Every server this benchmark starts listens on
127.0.0.1 on a free port and is stopped when it ends, on error too. ``--rounds`` runs each
contender once per round in a rotated order; figures are medians over rounds (counts summed), each
with the load average when it ended.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes.util
import dataclasses
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lab.serving.workload import ServingRequest, build_workload
from pagedkv.cli import add_engine_arguments, engine_kwargs, positive_float, positive_int, trace_source
from pagedkv.errors import InvalidArgumentError, PagedKVError
from pagedkv.traces import SHIPPED_TRACES, load_trace

REPO = Path(__file__).resolve().parents[2]
PEERS = ("llama-server", "vllm")
TARGET_OVERHEAD = 1.10
BLOCK_SIZE = 16  # the engine's block size (EngineConfig's default, which add_engine_arguments keeps)
# Defaults of the full run and of --quick, for the flags left unset.
FULL = {"requests": 128, "length_scale": 0.25, "concurrency": 16, "rate": None, "max_model_len": 2048}
QUICK = {"requests": 8, "length_scale": 1 / 16, "concurrency": 4, "rate": 16.0, "max_model_len": 256}
STARTUP_SECONDS = 180.0  # a model load on a loaded 2-core machine
VLLM_STARTUP_SECONDS = 900.0  # vLLM compiles the model with torch inductor first (~1 min alone, more on a busy machine)
VLLM_MODELS = {"smollm2-135m": "smollm2-hf"}  # registered GGUF models -> the directory `make peers` converts them to
CHUNK_TIMEOUT_S = 120.0  # longest silence of a stream before the request counts as failed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    # None: derived from the load (see the module doc); float16 is llama.cpp's default KV type.
    parser.set_defaults(num_blocks=None, max_num_seqs=None, kv_dtype="float16")
    parser.add_argument("--json", action="store_true", help="print JSON only on stdout (the table goes to stderr)")
    parser.add_argument("--quick", action="store_true", help="a small smoke run (the quick defaults below)")
    parser.add_argument(
        "--trace", type=trace_source(list(SHIPPED_TRACES)), default="conv", help="'conv', 'code' or a CSV path"
    )

    def add(flag: str, kind: Callable[[str], object], what: str) -> None:
        key = flag[2:].replace("-", "_")
        full = "the trace's own times" if FULL[key] is None else f"{FULL[key]:g}"
        parser.add_argument(flag, type=kind, default=None, help=f"{what} (default {full}; quick {QUICK[key]:g})")

    add("--requests", positive_int, "trace requests to replay, from the start")
    add("--length-scale", positive_float, "multiplies prompt and output lengths")
    add("--rate", positive_float, "mean requests/s of the replayed arrivals")
    add("--concurrency", positive_int, "requests in flight at most (and llama-server's -np)")
    add("--max-model-len", positive_int, "prompt + output tokens at most")
    parser.add_argument("--threads", type=positive_int, default=2, help="compute threads of every server")
    parser.add_argument("--rounds", type=positive_int, default=1, help="runs of each contender, in rotated order")
    parser.add_argument("--peer", choices=PEERS, action="append", default=[], help="also run this peer's server")
    parser.add_argument("--peers-dir", type=Path, default=REPO / ".peers", help="what `make peers` built (default .peers/)")
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm",
                        help="vLLM's venv, from `make peers` (default .venv-vllm/)")
    parser.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="vLLM's --dtype: weights, compute and KV cache (default bfloat16)")


# ---- one request, timed by the client -------------------------------------------------------


class RequestFailed(Exception):
    """A request the server answered with something else than a complete stream."""


@dataclass(frozen=True)
class Timing:
    first_s: float  # perf_counter of the first chunk with text or a finish
    last_s: float  # and of the last
    tokens: int


@dataclass(frozen=True)
class Result:
    wait_s: float  # due → sent (waiting in the client for a free slot)
    ttft_s: float
    e2e_s: float
    tokens: int
    error: str | None

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


Send = Callable[[ServingRequest], Awaitable[Timing]]


async def replay(requests: Sequence[ServingRequest], concurrency: int, send: Send) -> tuple[list[Result], float]:
    """Sends each request at its arrival time (at most ``concurrency`` in flight); returns the
    results in request order and the wall time from the start to the last end."""
    slots = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def one(request: ServingRequest) -> Result:
        await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
        due = time.perf_counter()
        async with slots:
            sent = time.perf_counter()
            try:
                timing = await send(request)
            except RequestFailed as failure:
                return Result(sent - due, math.nan, time.perf_counter() - sent, 0, str(failure))
        error = None if timing.tokens == request.max_tokens else f"{timing.tokens} tokens, expected {request.max_tokens}"
        return Result(sent - due, timing.first_s - sent, timing.last_s - sent, timing.tokens, error)

    results = await asyncio.gather(*(one(r) for r in requests))
    return list(results), time.perf_counter() - start


class _Stamps:
    """The first and last time a visible chunk (text or a finish) arrived."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last = 0.0

    def mark(self, now: float) -> None:
        if self.first is None:
            self.first = now
        self.last = now

    def timing(self, tokens: int) -> Timing:
        if self.first is None:
            raise RequestFailed("no text and no finish")
        return Timing(self.first, self.last, tokens)


def http_sender(client, model: str) -> Send:
    """Streams ``POST /v1/completions`` on ``client`` (an ``httpx.AsyncClient`` with the base URL)."""
    import httpx

    async def send(request: ServingRequest) -> Timing:
        body = {"model": model, "prompt": request.prompt_token_ids.tolist(), "max_tokens": request.max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        stamps, tokens, done = _Stamps(), None, False
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RequestFailed(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now, data = time.perf_counter(), line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise RequestFailed(f"error event: {chunk['error']}")
                    if any(c.get("text") or c.get("finish_reason") for c in chunk.get("choices") or ()):
                        stamps.mark(now)
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
        except httpx.HTTPError as error:
            raise RequestFailed(f"{type(error).__name__}: {error}") from None
        if not done or tokens is None:
            raise RequestFailed("the stream ended without [DONE]" if not done else "no usage in the stream")
        return stamps.timing(tokens)

    return send


def engine_sender(engine) -> Send:
    """Submits to the in-process ``engine`` with the parameters the server would build."""
    params = dataclasses.replace(engine.default_params, temperature=0.0, ignore_eos=True)

    async def send(request: ServingRequest) -> Timing:
        stamps, tokens = _Stamps(), 0
        try:
            handle = engine.submit(request.prompt_token_ids.tolist(), dataclasses.replace(params, max_tokens=request.max_tokens),
                                   timeout=0)
            async for event in handle:
                tokens += 1
                if event.text or event.finish_reason is not None:
                    stamps.mark(time.perf_counter())
            output = await handle
        except PagedKVError as error:
            raise RequestFailed(f"{type(error).__name__}: {error}") from None
        if output.outputs[0].finish_reason not in ("length", "stop"):
            raise RequestFailed(f"finish_reason {output.outputs[0].finish_reason!r}")
        return stamps.timing(tokens)

    return send


# ---- servers started here -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def server_process(name: str, command: list[str], port: int, env: dict[str, str] | None = None,
                   startup_s: float = STARTUP_SECONDS) -> Iterator[tuple[str, int]]:
    """Runs ``command`` (a server listening on 127.0.0.1:``port``) until ``GET /health`` answers
    200, yields its base URL and pid, and always stops it (SIGTERM, then SIGKILL after 10 s, and
    SIGKILL to whatever of its process tree outlives it). Raises ``ChildProcessError`` if it exits
    first, ``TimeoutError`` if it is not up in ``startup_s``; any error, raised here or in the body,
    gets the end of its log as a note."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        failure: BaseException | None = None
        try:
            deadline = time.monotonic() + startup_s
            while True:
                if process.poll() is not None:
                    raise ChildProcessError(f"{name} exited with {process.returncode}: {command}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not answer /health in {startup_s:.0f} s")
                time.sleep(0.1)
            yield url, process.pid
        except BaseException as error:
            failure = error
            raise
        finally:
            tree = _process_tree(process.pid)
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            for pid in tree - {process.pid}:  # children a killed server left behind (vLLM's engine and worker)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if failure is not None and hasattr(failure, "add_note"):  # Python ≥ 3.11; `python -m pagedkv` prints notes
                log.seek(0)
                failure.add_note(f"the end of {name}'s log:\n{log.read()[-2000:]}")


def pagedkv_command(args: argparse.Namespace, port: int) -> list[str]:
    """``python -m pagedkv serve`` with the engine options of ``args``."""
    options = engine_kwargs(args) | {"otlp_traces_endpoint": args.otlp_traces_endpoint}
    flags = []
    for key, value in options.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):  # a switch, on by default: only its --no- form is a flag
            flags += [] if value else [f"--no-{flag}"]
        elif value is not None:
            flags += [f"--{flag}", str(value)]
    return [sys.executable, "-m", "pagedkv", "serve", "--model", str(args.model), "--host", "127.0.0.1", "--port", str(port),
            *flags]


def llama_server_command(args: argparse.Namespace, port: int, slot_tokens: int) -> list[str]:
    binary = args.peers_dir / "bin" / "llama-server"
    if not binary.is_file():
        raise FileNotFoundError(f"{binary} does not exist: build it with `make peers` (or give --peers-dir)")
    return [str(binary), "-m", str(gguf_of(args.model)), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(args.concurrency), "-c", str(args.concurrency * slot_tokens), "-t", str(args.threads),
            "-tb", str(args.threads), "-cram", "0", "--seed", str(args.seed)]


def vllm_paths(args: argparse.Namespace) -> tuple[Path, Path]:
    """The python of vLLM's venv and the Hugging Face directory of ``args.model`` it serves (for a
    registered GGUF model, the one `make peers` wrote; a checkpoint directory as it is). Raises
    ``FileNotFoundError`` naming `make peers` when either is missing."""
    python = args.vllm_venv / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(f"{python} does not exist: install vLLM with `make peers` (or `make peers-vllm`; "
                                "or give --vllm-venv)")
    model = str(args.model)
    if model in VLLM_MODELS:
        directory = args.peers_dir / "models" / VLLM_MODELS[model]
    elif Path(model).is_dir():
        directory = Path(model)
    else:
        raise InvalidArgumentError(f"--peer vllm needs {', '.join(VLLM_MODELS)} or a checkpoint directory, got {model!r}")
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory / 'config.json'} does not exist: convert the model with `make peers` "
                                "(or give --peers-dir)")
    return python, directory


def vllm_command(args: argparse.Namespace, port: int) -> list[str]:
    """``vllm serve`` (through scripts/vllm_serve.py: see there why) on the model of :func:`vllm_paths`,
    named as the client names it."""
    python, directory = vllm_paths(args)
    return [str(python), str(REPO / "scripts" / "vllm_serve.py"), str(directory), "--served-model-name", str(args.model),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", args.vllm_dtype, "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.concurrency), "--seed", str(args.seed), "--disable-uvicorn-access-log"]


def vllm_env(args: argparse.Namespace, pool_tokens: int) -> dict[str, str]:
    """The environment of :func:`vllm_command`: vLLM's CPU settings (see the module doc), and no
    network (usage reports, the model hub)."""
    _, directory = vllm_paths(args)
    config = json.loads((directory / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    token_bytes = 2 * config["num_hidden_layers"] * heads * head_dim * (2 if args.vllm_dtype == "bfloat16" else 4)
    kv_gib = max(1, math.ceil(pool_tokens * token_bytes / 2**30))
    cpus = sorted(os.sched_getaffinity(0))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if args.threads <= len(cpus):
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[:args.threads]))
    else:  # more threads than cores: unbound, as llama-server's and pagedkv's are
        env |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(args.threads)}
    preload = [str(p) for p in (args.vllm_venv / "lib").glob("libiomp5.so")]
    if tcmalloc := ctypes.util.find_library("tcmalloc_minimal"):
        preload.append(tcmalloc)
    if preload:
        env["LD_PRELOAD"] = ":".join(filter(None, [*preload, os.environ.get("LD_PRELOAD", "")]))
    return env


def peer_server(peer: str, args: argparse.Namespace, slot_tokens: int) -> tuple[list[str], int, dict[str, str] | None, float]:
    """The command, port, environment and startup timeout of ``peer``'s server."""
    port = free_port()
    if peer == "vllm":
        return vllm_command(args, port), port, vllm_env(args, args.concurrency * slot_tokens), VLLM_STARTUP_SECONDS
    return llama_server_command(args, port, slot_tokens), port, None, STARTUP_SECONDS


def check_peers(args: argparse.Namespace) -> None:
    """Fails now, before any model loads, if a peer of ``args.peer`` is not installed."""
    if "llama-server" in args.peer:
        llama_server_command(args, 0, BLOCK_SIZE)
        gguf_of(args.model)
    if "vllm" in args.peer:
        vllm_paths(args)


def gguf_of(model: str) -> Path:
    """The GGUF file llama-server loads for ``model`` (a registered name or a .gguf path)."""
    from pagedkv.loaders.registry import REGISTRY, locate_registered

    if model in REGISTRY:
        return locate_registered(model)
    if model.endswith(".gguf"):
        return Path(model)
    raise InvalidArgumentError(f"--peer llama-server needs a GGUF model (a registered name or a .gguf file), got {model!r}")


# ---- the run --------------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: Sequence[Result], wall_s: float, *, server_cpu_s: float | None,
              client_cpu_s: float | None) -> dict[str, object]:
    """A contender's figures; CPU seconds per output token of the server (or of the in-process
    engine with its consumers) and of the HTTP client (None in process)."""
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttft = [r.ttft_s for r in ok]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    waits = [r.wait_s for r in results]
    return {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": [r.error for r in results if r.error is not None][:3],
        "output_tokens": tokens,
        "wall_s": wall_s,
        "throughput_output_tokens_per_s": tokens / wall_s,
        "throughput_requests_per_s": len(ok) / wall_s,
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "tpot_p50_s": _percentile(tpot, 50),
        "tpot_p99_s": _percentile(tpot, 99),
        "tpot_mean_s": statistics.fmean(tpot) if tpot else None,
        "client_wait_p50_s": _percentile(waits, 50),
        "client_wait_max_s": max(waits) if waits else None,
        "server_cpu_s_per_output_token": server_cpu_s / tokens if tokens and server_cpu_s is not None else None,
        "client_cpu_s_per_output_token": client_cpu_s / tokens if tokens and client_cpu_s is not None else None,
        "load_avg": os.getloadavg()[0],
    }


_SUMMED = ("requests", "completed", "errors", "output_tokens")


def combine(rounds: Sequence[dict[str, object]]) -> dict[str, object]:
    """One contender over its rounds: counts summed, error samples joined, other figures' medians."""
    out: dict[str, object] = {}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        if key in _SUMMED:
            out[key] = sum(values)  # type: ignore[arg-type]
        elif key == "error_samples":
            out[key] = [e for v in values for e in v][:3]  # type: ignore[union-attr]
        else:
            present = [v for v in values if v is not None]
            out[key] = statistics.median(present) if present else None  # type: ignore[type-var]
    return out


async def measure(send: Send, requests: Sequence[ServingRequest], concurrency: int,
                  server: int | None) -> dict[str, object]:
    """``concurrency`` warm-up requests at once (they page the weights in and open the client's
    connections, which the replay then reuses; each is the last tokens of a request, so that no
    prefix cache serves a measured request from it), then the replay. ``server``: the server's
    pid, whose CPU time is read from /proc; None for the engine in this process."""
    warmups = [dataclasses.replace(r, prompt_token_ids=r.prompt_token_ids[-16:], max_tokens=4) for r in requests]
    try:
        await asyncio.gather(*(send(r) for r in (warmups * concurrency)[:concurrency]))
    except RequestFailed as failure:
        raise ChildProcessError(f"a warm-up request failed: {failure}") from None
    own, theirs = time.process_time(), _cpu_seconds(server)
    results, wall = await replay(requests, concurrency, send)
    own = time.process_time() - own
    if server is None:
        return summarize(results, wall, server_cpu_s=own, client_cpu_s=None)
    after = _cpu_seconds(server)
    return summarize(results, wall, server_cpu_s=None if theirs is None or after is None else after - theirs, client_cpu_s=own)


def _proc_stats() -> dict[int, tuple[int, int]]:
    """Every process's parent pid and user + system CPU ticks so far (empty without a Linux /proc)."""
    stats = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue  # it has just exited
                stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
    return stats


def _process_tree(pid: int, stats: dict[int, tuple[int, int]] | None = None) -> set[int]:
    """``pid`` and its live descendants."""
    stats = _proc_stats() if stats is None else stats
    children: dict[int, list[int]] = {}
    for child, (parent, _) in stats.items():
        children.setdefault(parent, []).append(child)
    tree, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds so far of process ``pid`` and its live descendants (None without
    a Linux /proc)."""
    stats = _proc_stats() if pid is not None else {}
    if pid not in stats:
        return None
    return sum(stats[p][1] for p in _process_tree(pid, stats)) / os.sysconf("SC_CLK_TCK")


def _workload(args: argparse.Namespace, vocab: tuple[int, int]) -> list[ServingRequest]:
    """The trace requests; their lengths and arrivals do not depend on ``vocab``."""
    trace = load_trace(args.trace, limit=args.requests)
    if not trace:
        raise InvalidArgumentError(f"--trace {args.trace}: no requests")
    requests = build_workload(trace, max_model_len=args.max_model_len, length_scale=args.length_scale,
                              vocab=vocab, seed=args.seed).requests
    span = requests[-1].arrival_s
    if args.rate is not None and span > 0:
        stretch = (len(requests) - 1) / args.rate / span
        requests = [dataclasses.replace(r, arrival_s=r.arrival_s * stretch) for r in requests]
    return requests


def run(args: argparse.Namespace) -> int:
    import httpx

    import pagedkv
    from pagedkv.engine import Engine
    from pagedkv.observability import tracing

    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_peers(args)
    pagedkv.set_num_threads(args.threads)
    table = sys.stderr if args.json else sys.stdout
    # Sized on the lengths first: the pool holds `concurrency` of the longest request.
    longest = max(r.prompt_len + r.max_tokens for r in _workload(args, vocab=(3, 4)))
    slot_tokens = -(-longest // BLOCK_SIZE) * BLOCK_SIZE
    args.max_num_seqs = args.max_num_seqs or args.concurrency
    args.num_blocks = args.num_blocks or args.concurrency * slot_tokens // BLOCK_SIZE
    timeout = httpx.Timeout(CHUNK_TIMEOUT_S, connect=10.0)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)

    def over_http(server: tuple[str, int], model: str) -> Callable[[], dict[str, object]]:
        base_url, pid = server

        async def go() -> dict[str, object]:
            async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
                return await measure(http_sender(client, model), requests, args.concurrency, pid)

        return lambda: asyncio.run(go())

    with contextlib.ExitStack() as stack:
        # SIGTERM unwinds like an error, so that the servers started here are stopped too.
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        stack.callback(signal.signal, signal.SIGTERM, previous)
        tracer = tracing.configure(otlp_endpoint=args.otlp_traces_endpoint)  # as `serve` does
        if tracer is not None:
            stack.callback(tracer.shutdown)
        engine = Engine.from_pretrained(args.model, tracer=tracer, **engine_kwargs(args))
        stack.callback(engine.shutdown, drain=False)
        if args.max_model_len > engine.core.max_model_len:
            raise InvalidArgumentError(f"--max-model-len {args.max_model_len} exceeds the model's {engine.core.max_model_len}")
        requests = _workload(args, vocab=(3, engine.tokenizer.vocab_size))
        port = free_port()
        env = {**os.environ, "PAGEDKV_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
        served = stack.enter_context(server_process("pagedkv serve", pagedkv_command(args, port), port, env))
        contenders: list[tuple[str, Callable[[], dict[str, object]]]] = [
            ("pagedkv http", over_http(served, str(args.model))),
            ("pagedkv in-process", lambda: asyncio.run(measure(engine_sender(engine), requests, args.concurrency, None))),
        ]
        for peer in args.peer:
            command, peer_port, peer_env, startup_s = peer_server(peer, args, slot_tokens)
            server = stack.enter_context(server_process(peer, command, peer_port, peer_env, startup_s))
            contenders.append((peer, over_http(server, str(args.model))))

        rounds: dict[str, list[dict[str, object]]] = {name: [] for name, _ in contenders}
        for index in range(args.rounds):
            shift = index % len(contenders)
            for name, run_once in contenders[shift:] + contenders[:shift]:
                print(f"round {index + 1}/{args.rounds}: {name} (load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
                rounds[name].append(run_once())

    figures = {name: combine(values) for name, values in rounds.items()}
    report = _report(args, requests, slot_tokens, figures, rounds)
    _print_table(report, table)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _ratio(a: object, b: object) -> float | None:
    return a / b if isinstance(a, float) and isinstance(b, float) and b > 0 else None


def _report(args: argparse.Namespace, requests: Sequence[ServingRequest], slot_tokens: int,
            figures: dict[str, dict[str, object]], rounds: dict[str, list[dict[str, object]]]) -> dict[str, object]:
    http, local = figures["pagedkv http"], figures["pagedkv in-process"]
    overhead = {
        "tpot_mean_ratio": _ratio(http["tpot_mean_s"], local["tpot_mean_s"]),
        "tpot_p50_ratio": _ratio(http["tpot_p50_s"], local["tpot_p50_s"]),
        "ttft_p50_ratio": _ratio(http["ttft_p50_s"], local["ttft_p50_s"]),
        "server_cpu_per_token_ratio": _ratio(http["server_cpu_s_per_output_token"], local["server_cpu_s_per_output_token"]),
        "throughput_ratio": _ratio(http["throughput_output_tokens_per_s"], local["throughput_output_tokens_per_s"]),
        "target_tpot_mean_ratio": TARGET_OVERHEAD,
    }
    ratio = overhead["tpot_mean_ratio"]
    overhead["target_met"] = ratio is not None and ratio <= TARGET_OVERHEAD  # type: ignore[operator]
    span = requests[-1].arrival_s
    return {
        "config": {
            "model": str(args.model),
            "trace": str(args.trace),
            "requests": len(requests),
            "length_scale": args.length_scale,
            "mean_prompt_tokens": statistics.fmean(r.prompt_len for r in requests),
            "mean_output_tokens": statistics.fmean(r.max_tokens for r in requests),
            "arrival_span_s": span,
            "offered_rate_requests_per_s": (len(requests) - 1) / span if span > 0 else None,
            "concurrency": args.concurrency,
            "threads": args.threads,
            "rounds": args.rounds,
            "engine": engine_kwargs(args),
            "slot_tokens": slot_tokens,
            "peers": list(args.peer),
            **({"vllm_dtype": args.vllm_dtype} if "vllm" in args.peer else {}),
        },
        "contenders": figures,
        "overhead": overhead,
        "rounds": rounds,
    }


_ROWS = (
    ("throughput_output_tokens_per_s", "output tok/s", "{:.1f}"),
    ("throughput_requests_per_s", "requests/s", "{:.2f}"),
    ("ttft_p50_s", "TTFT p50 ms", "ms"),
    ("ttft_p99_s", "TTFT p99 ms", "ms"),
    ("tpot_p50_s", "TPOT p50 ms", "ms"),
    ("tpot_p99_s", "TPOT p99 ms", "ms"),
    ("tpot_mean_s", "TPOT mean ms", "ms"),
    ("client_wait_p50_s", "client wait p50 ms", "ms"),
    ("server_cpu_s_per_output_token", "server CPU µs/token", "us"),
    ("client_cpu_s_per_output_token", "client CPU µs/token", "us"),
    ("errors", "errors", "{}"),
    ("load_avg", "load average", "{:.1f}"),
)


def _cell(value: object, form: str) -> str:
    if value is None:
        return "-"
    if form == "ms":
        return f"{value * 1e3:.1f}"  # type: ignore[operator]
    if form == "us":
        return f"{value * 1e6:.0f}"  # type: ignore[operator]
    return form.format(value)


def _print_table(report: dict, file) -> None:
    config, figures = report["config"], report["contenders"]
    print(
        f"{config['model']}, {config['trace']} trace × {config['length_scale']:g}: {config['requests']} requests "
        f"(mean {config['mean_prompt_tokens']:.0f} prompt + {config['mean_output_tokens']:.0f} output tokens) over "
        f"{config['arrival_span_s']:.1f} s, concurrency {config['concurrency']}, {config['threads']} threads, "
        f"medians of {config['rounds']} round(s)",
        file=file,
    )
    names = list(figures)
    print(f"{'':22}" + "".join(f"{n:>20}" for n in names), file=file)
    for key, label, form in _ROWS:
        print(f"{label:22}" + "".join(f"{_cell(figures[n][key], form):>20}" for n in names), file=file)
    overhead = report["overhead"]
    ratio = overhead["tpot_mean_ratio"]
    verdict = "met" if overhead["target_met"] else "NOT met"
    print(f"HTTP / in-process time per output token (mean TPOT): "
          f"{'-' if ratio is None else f'{ratio:.3f}'} (target ≤ {TARGET_OVERHEAD:.2f}: {verdict})", file=file)
