"""``python -m pagedkv serve``: the OpenAI-compatible server (:func:`pagedkv.server.build_app`) on
uvicorn, over an engine built from the shared engine options (``--otlp-traces-endpoint`` traces
each request, a child of the HTTP request's ``traceparent``). With ``--replicas N``, over N engine
replicas as Ray actors instead (:class:`pagedkv.cluster.frontend.Cluster`, routed by
``--routing-policy``), on the Ray cluster at ``--ray-address`` or on a local Ray started on
127.0.0.1 for the server's lifetime (:func:`pagedkv.cluster.ray_runtime.connect`).

Shutdown, on SIGTERM or SIGINT (:class:`_Server`):

1. the engine (or cluster) stops accepting (``shutdown(drain=True)``: a request arriving now is a 503)
   and uvicorn closes its listening socket and its idle connections;
2. in-flight requests go on for up to ``--shutdown-timeout`` seconds;
3. then the engine aborts the rest: each open stream ends with an error event and ``[DONE]``, each
   waiting whole response with a 503. uvicorn's own graceful timeout, a little longer, is only a
   backstop.

The process then exits 0. A second SIGINT forces the exit (uvicorn's behaviour).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import resource
import signal
import socket
import threading
from collections.abc import Sequence
from types import FrameType

import uvicorn

from pagedkv.cli import (
    add_engine_arguments,
    byte_size,
    engine_kwargs,
    existing_file,
    port,
    positive_float,
    positive_int,
    seconds,
)
from pagedkv.cluster.router import POLICIES
from pagedkv.engine import Engine
from pagedkv.errors import CheckpointError, InvalidArgumentError, PagedKVError
from pagedkv.observability import tracing
from pagedkv.observability.metrics import EngineMetrics
from pagedkv.server.app import DEFAULT_MAX_TOKENS, MAX_REQUEST_BYTES, build_app
from pagedkv.server.client import EngineClient
from pagedkv.server.connections import GuardedH11Protocol, quiet_accept_errors
from pagedkv.text.chat import check_template

# How long --replicas waits for every replica to answer its first heartbeat before serving.
_REPLICA_START_SECONDS = 300.0

__all__ = ["add_arguments", "run", "serve"]

# Descriptors kept free of connections: the engine's files (a disk tier), its log, the listening
# socket, Ray's pipes; the server starts with about 30 open.
_SPARE_DESCRIPTORS = 64

# How much longer than --shutdown-timeout uvicorn waits before cancelling what is still open: the
# streams aborted at the timeout need a moment to send their last events.
_BACKSTOP_SECONDS = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=port, default=8000, help="port to listen on (0: any free one)")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    parser.add_argument("--max-waiting", type=positive_int, default=1024,
                        help="requests waiting for admission before new ones get 429")
    parser.add_argument("--default-max-tokens", type=positive_int, default=DEFAULT_MAX_TOKENS,
                        help="max_tokens of a chat request that gives none (the model's length still bounds it; "
                             "/v1/completions defaults to 16, as OpenAI's)")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest sequence, prompt and output (default: the model's, capped by the KV blocks)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY") or None,
                        help="serve only clients sending 'Authorization: Bearer KEY' (default: $PAGEDKV_API_KEY; "
                             "none: anyone who reaches the port); /health and /metrics stay open")
    parser.add_argument("--protect-metrics", action="store_true",
                        help="with --api-key: /health and /metrics need the key too")
    parser.add_argument("--allowed-origins", type=_origins, default=(),
                        help="comma-separated browser origins allowed to call the server (CORS), or '*'; default none")
    parser.add_argument("--chat-template", type=chat_template_file, default=None,
                        help="a Jinja chat template file, replacing the tokenizer's (needed for a model without one)")
    parser.add_argument("--shutdown-timeout", type=seconds, default=30.0,
                        help="seconds in-flight requests may run after SIGTERM before they are aborted")
    parser.add_argument("--max-request-bytes", type=byte_size, default=MAX_REQUEST_BYTES,
                        help="the largest request body read (a larger one is a 413), e.g. 8M (the default)")
    parser.add_argument("--head-timeout", type=positive_float, default=10.0,
                        help="seconds a connection has to send a complete request head, from its opening or "
                             "its previous response, before it is closed")
    parser.add_argument("--max-connections", type=positive_int, default=1024,
                        help="open connections at most (a new one past it is closed at once); kept 64 below the "
                             "process's open-file limit")
    parser.add_argument("--replicas", type=positive_int, default=None,
                        help="run N engine replicas as Ray actors behind this front end, at most one per CPU of "
                             "the machine or of the --ray-address cluster (needs pagedkv[cluster])")
    parser.add_argument("--ray-address", default=None,
                        help="with --replicas: join this Ray cluster (default: start a local Ray on 127.0.0.1)")
    parser.add_argument("--routing-policy", default="prefix_aware", choices=POLICIES,
                        help="with --replicas: how the front end picks a replica (default prefix_aware)")


class _Server(uvicorn.Server):
    """uvicorn's server, whose exit signal first drains the engine (see the module doc), and
    which does not re-raise the signal after its graceful exit (so the process exits 0)."""

    def __init__(self, config: uvicorn.Config, engine: Engine | EngineClient, model_name: str, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.model_name = model_name
        self.shutdown_timeout = shutdown_timeout
        self._abort_timer: threading.Timer | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        await super().startup(sockets)
        for server in self.servers:  # the bound address (with --port 0, the port the system chose)
            for listener in server.sockets:
                host, bound_port = listener.getsockname()[:2]
                print(f"pagedkv serving {self.model_name!r} on http://{host}:{bound_port}", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if self._abort_timer is None:
            self.engine.shutdown(drain=True, timeout=0)  # stop accepting; the worker goes on
            abort = {"drain": False, "timeout": 0}
            self._abort_timer = threading.Timer(self.shutdown_timeout, self.engine.shutdown, kwargs=abort)
            self._abort_timer.daemon = True
            self._abort_timer.start()


def serve(engine: Engine | EngineClient, model_name: str, host: str, port: int, *, shutdown_timeout: float = 30.0,
          default_max_tokens: int = DEFAULT_MAX_TOKENS, max_request_bytes: int = MAX_REQUEST_BYTES,
          head_timeout: float = 10.0, max_connections: int = 1024, api_key: str | None = None,
          protect_metrics: bool = False, allowed_origins: Sequence[str] = ()) -> None:
    """Serves ``engine`` until SIGTERM / SIGINT, then shuts down as the module doc says (the
    engine is shut down on return). Connections: see :mod:`pagedkv.server.connections`
    (``max_connections`` lowered to 64 below the open-file limit if it is not already); the key
    and origins: see :func:`~pagedkv.server.app.build_app`."""
    app = build_app(engine, model_name, default_max_tokens=default_max_tokens, max_request_bytes=max_request_bytes,
                    api_key=api_key, protect_metrics=protect_metrics, allowed_origins=allowed_origins)
    if isinstance(engine, Engine):  # a cluster's replicas build theirs
        engine.grammars.prepare_in_background()
    soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit != resource.RLIM_INFINITY:
        max_connections = max(1, min(max_connections, soft_limit - _SPARE_DESCRIPTORS))
    protocol = functools.partial(GuardedH11Protocol, head_timeout=head_timeout, max_connections=max_connections)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, http=protocol,  # type: ignore[arg-type]
                            timeout_graceful_shutdown=shutdown_timeout + _BACKSTOP_SECONDS)
    server = _Server(config, engine, model_name, shutdown_timeout)
    try:
        server.run()
    finally:
        engine.shutdown(drain=False)


def run(args: argparse.Namespace) -> int:
    if args.protect_metrics and args.api_key is None:
        raise InvalidArgumentError("--protect-metrics needs --api-key (or PAGEDKV_API_KEY)")
    if args.replicas is not None:
        return _run_cluster(args)
    if args.ray_address is not None:
        raise InvalidArgumentError("--ray-address needs --replicas")
    name = args.served_model_name or str(args.model)
    tracer = tracing.configure(otlp_endpoint=args.otlp_traces_endpoint)
    engine = Engine.from_pretrained(args.model, max_waiting=args.max_waiting, metrics=EngineMetrics(name), tracer=tracer,
                                    **_engine_options(args))
    if args.chat_template is not None:
        engine.tokenizer.chat_template = args.chat_template
    try:
        serve(engine, name, args.host, args.port, **_serve_options(args))
    finally:
        if tracer is not None:
            tracer.shutdown()  # flushes the spans of the requests served
    return 0


def _run_cluster(args: argparse.Namespace) -> int:
    """``--replicas N``: the replicas on Ray, this process their front end."""
    try:
        from pagedkv.cluster import ray_runtime
        from pagedkv.cluster.frontend import Cluster, spawn_replicas
    except ModuleNotFoundError as error:
        raise PagedKVError(f"--replicas needs {error.name}, which is not installed (pip install 'pagedkv[cluster]')") from None

    name = args.served_model_name or str(args.model)
    replica_kwargs = {**_engine_options(args), "max_waiting": args.max_waiting}
    if args.ray_address is None:
        _check_replicas(args.replicas, len(os.sched_getaffinity(0)), "this machine")
    with ray_runtime.connect(args.ray_address, num_cpus=args.replicas if args.ray_address is None else None) as took:
        print(f"pagedkv: Ray {'joined' if args.ray_address else 'started on 127.0.0.1'} in {took:.1f} s", flush=True)
        if args.ray_address is not None:
            _check_replicas(args.replicas, ray_runtime.cluster_cpus(), f"the Ray cluster at {args.ray_address}")
        actors = spawn_replicas(args.replicas, args.model, replica_kwargs, otlp_endpoint=args.otlp_traces_endpoint)
        cluster = Cluster(actors, policy=args.routing_policy, chat_template=args.chat_template, metrics=EngineMetrics(name))
        try:
            cluster.wait_ready(_REPLICA_START_SECONDS)
            serve(cluster, name, args.host, args.port, **_serve_options(args))
        finally:
            cluster.shutdown(drain=False)  # a no-op once serve has shut it down
    return 0


def chat_template_file(text: str) -> str:
    """The ``--chat-template`` flag: the text of a UTF-8 file holding a Jinja template that
    compiles (checked here: a usage error at start-up, not a failure of every chat request)."""
    try:
        template = existing_file(text).read_bytes().decode("utf-8")
        check_template(template, text)
    except UnicodeDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    except (OSError, CheckpointError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return template


def _engine_options(args: argparse.Namespace) -> dict:
    """The engine's options from the flags: the shared ones and serve's ``--max-model-len``."""
    return {**engine_kwargs(args), "max_model_len": args.max_model_len}


def _serve_options(args: argparse.Namespace) -> dict:
    """:func:`serve`'s options from the flags (one engine or replicas alike)."""
    return {"shutdown_timeout": args.shutdown_timeout, "default_max_tokens": args.default_max_tokens,
            "max_request_bytes": args.max_request_bytes, "head_timeout": args.head_timeout,
            "max_connections": args.max_connections, "api_key": args.api_key,
            "protect_metrics": args.protect_metrics, "allowed_origins": args.allowed_origins}


def _origins(text: str) -> tuple[str, ...]:
    """The ``--allowed-origins`` flag: "*" or comma-separated origins (scheme://host[:port])."""
    origins = tuple(o.strip() for o in text.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and ("://" not in origin or origin.endswith("/")):
            raise argparse.ArgumentTypeError(f"{origin!r} is not an origin (scheme://host[:port], no path) nor '*'")
    if not origins:
        raise argparse.ArgumentTypeError("no origin given")
    return origins


def _check_replicas(replicas: int, cpus: int, where: str) -> None:
    """One replica per CPU at most: each is a process stepping its own engine, and more than the
    CPUs only share them (a local Ray is also sized by the count, and fails past what it can hold)."""
    if replicas > cpus:
        raise InvalidArgumentError(f"--replicas {replicas} exceeds the {cpus} CPUs of {where}")
