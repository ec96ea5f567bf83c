"""The FastAPI application: OpenAI's completions, chat completions and models endpoints over one
:class:`~pagedkv.Engine` or a cluster of replicas (an :class:`~pagedkv.server.client.EngineClient`),
plus ``/health``, ``/metrics``, ``/version`` and ``/ping``; optionally behind an API key
(:mod:`pagedkv.server.auth`) and open to browser origins (CORS).

FastAPI (on Starlette, served by uvicorn) is what vLLM and SGLang serve with: request bodies
validated by pydantic models (:mod:`pagedkv.server.protocol`), streaming responses whose generator
Starlette closes when the client goes away, and an ASGI receive channel on which a disconnect is
seen while a whole response is still being computed.

Invariants:

- A request's body is at most ``max_request_bytes`` (else a 413, read no further); it names the
  served model (or none) or gets a 404; a field it cannot honour is a 400, an unknown one is
  ignored and counted (:mod:`pagedkv.server.fields`); everything else about it is checked when its submissions are
  built, before any answer starts: a refused request queues nothing. Prompts are rendered and
  tokenized, and constraints compiled, off the event loop
  (:class:`~pagedkv.server.prompts.PromptEncoder`, :func:`~pagedkv.server.constraints.compile_constraint`):
  nothing a request sends costs the loop more than its validation.
- The client's going away aborts its generation, streaming or not (:func:`_until_disconnect`).
- The engine is never stepped here: submissions go through the client's ``submit``, which never
  blocks the event loop (a full queue is a 429 at once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from pagedkv._core import __version__
from pagedkv.engine import Engine, RequestOutput
from pagedkv.server.auth import ApiKeyAuth
from pagedkv.server.client import EngineClient, LocalEngine
from pagedkv.server.constraints import compile_constraint, request_constraint
from pagedkv.server.errors import BodyLimit, ModelNotFoundError, install_handlers
from pagedkv.server.fields import IgnoredFields, check_unhonoured
from pagedkv.server.formats import ChatFormat, CompletionFormat, Format
from pagedkv.server.generation import Generation, TokenText
from pagedkv.server.prompts import Prompt, PromptEncoder
from pagedkv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    sampling_params,
)
from pagedkv.server.responses import ResponsesRequest, response_object, stream_events
from pagedkv.server.streaming import stream

__all__ = ["COMPLETIONS_MAX_TOKENS", "DEFAULT_MAX_TOKENS", "MAX_REQUEST_BYTES", "build_app"]

# max_tokens of a chat request that gives none: the scheduler stops a sample earlier when the
# model's length runs out, so this caps what a request gets by default (vLLM gives all the room
# left, which on a 4096-token model is minutes of CPU decoding for a client that forgot the field).
DEFAULT_MAX_TOKENS = 1024

# max_tokens of a completions request that gives none: OpenAI's default for /v1/completions.
COMPLETIONS_MAX_TOKENS = 16

# The largest request body read: 8 MiB holds a prompt of 2 M tokens of English, far past any
# model's length (the prompt is refused later anyway), and bounds what parsing one body costs.
MAX_REQUEST_BYTES = 8 * 2**20

# The W3C trace-context headers handed to the engine's tracing.
_TRACE_HEADERS = ("traceparent", "tracestate")


def build_app(engine: Engine | EngineClient, model_name: str, *, default_max_tokens: int = DEFAULT_MAX_TOKENS,
              max_request_bytes: int = MAX_REQUEST_BYTES, api_key: str | None = None, protect_metrics: bool = False,
              allowed_origins: Sequence[str] = ()) -> FastAPI:
    """An app serving ``engine`` (an in-process :class:`Engine`, or any :class:`EngineClient`) as
    the model ``model_name``; with ``api_key``, only to clients that send it (``/health`` and
    ``/metrics`` stay open unless ``protect_metrics``); to browsers of ``allowed_origins``
    ("*": any)."""
    client: EngineClient = LocalEngine(engine) if isinstance(engine, Engine) else engine
    app = FastAPI(title="pagedkv", version=__version__)
    install_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=api_key, protect_metrics=protect_metrics)
    if allowed_origins:  # outermost: it answers a preflight before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])
    registry = CollectorRegistry(auto_describe=True)
    ignored = IgnoredFields(registry)
    text = TokenText(client.tokenizer)
    encoder = PromptEncoder(client.tokenizer, client.max_model_len)
    completion_format, chat_format = CompletionFormat(model_name, text), ChatFormat(model_name, text)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ModelNotFoundError(f"the model {name!r} does not exist (this server serves {model_name!r})")

    async def generate(http: Request, body: CompletionRequest | ChatCompletionRequest, prompts: Sequence[Prompt],
                       fmt: Format, chat: bool) -> Response:
        check_model(body.model)
        ignored.record(body.check(), http.url.path)
        constraint = request_constraint(body)
        params = sampling_params(body, client.default_params, default_max_tokens if chat else COMPLETIONS_MAX_TOKENS,
                                 constraint.structured_outputs)
        await compile_constraint(getattr(client, "grammars", None), constraint)
        trace = {k: v for k in _TRACE_HEADERS if (v := http.headers.get(k)) is not None}
        echo = isinstance(body, CompletionRequest) and body.echo
        generation = await Generation.submit(client, encoder, prompts, params, chat=chat, cache_salt=body.cache_salt,
                                             trace_headers=trace or None, prefix="chatcmpl" if chat else "cmpl",
                                             echo=echo, score_only=echo and body.score_only,  # type: ignore[union-attr]
                                             functions=constraint.functions, tools=constraint.tools)
        if body.stream:
            events = stream(generation, fmt, body.include_usage, body.continuous_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        outputs = await _until_disconnect(http, generation)
        if outputs is None:
            return Response(status_code=499)  # nobody is listening; the status is for the access log
        generation.check_ended(outputs)
        return JSONResponse(fmt.response(generation, outputs))

    @app.post("/v1/completions")
    async def completions(http: Request, body: CompletionRequest) -> Response:
        prompt = body.prompt
        prompts: list[Prompt] = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else list(prompt)  # type: ignore[arg-type, list-item]
        return await generate(http, body, prompts, completion_format, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request, body: ChatCompletionRequest) -> Response:
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        return await generate(http, body, [messages], chat_format, chat=True)

    @app.post("/v1/responses")
    async def responses(http: Request, body: ResponsesRequest) -> Response:
        """OpenAI's Responses API, text and function calls, nothing stored (:mod:`pagedkv.server.responses`)."""
        check_model(body.model)
        ignored.record(body.check(), http.url.path)
        constraint = body.constraint()
        params = body.params(client.default_params, default_max_tokens, constraint.structured_outputs)
        messages = body.messages()
        await compile_constraint(getattr(client, "grammars", None), constraint)
        trace = {k: v for k in _TRACE_HEADERS if (v := http.headers.get(k)) is not None}
        generation = await Generation.submit(client, encoder, [messages], params, chat=True, cache_salt=None,
                                             trace_headers=trace or None, prefix="resp", functions=constraint.functions,
                                             tools=constraint.tools)
        if body.stream:
            return StreamingResponse(stream_events(body, generation, model_name), media_type="text/event-stream")
        outputs = await _until_disconnect(http, generation)
        if outputs is None:
            return Response(status_code=499)
        generation.check_ended(outputs)
        return JSONResponse(response_object(body, generation, outputs[0], model_name))

    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "pagedkv", "max_model_len": client.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        check_model(model_id)
        return card

    @app.post("/tokenize")
    async def tokenize(http: Request, body: TokenizeRequest) -> dict:
        """vLLM's shape: ``{"count", "max_model_len", "tokens"}``."""
        check_model(body.model)
        ignored.record(check_unhonoured(body.model_extra or {}, n=1), http.url.path)
        conversation = body.conversation()
        prompt: Prompt = body.prompt if conversation is None else conversation  # type: ignore[assignment]
        tokens = await encoder.encode(prompt, conversation is not None, add_special_tokens=body.add_special_tokens,
                                      add_generation_prompt=body.add_generation_prompt)
        return {"count": len(tokens), "max_model_len": client.max_model_len, "tokens": list(tokens)}

    @app.post("/detokenize")
    async def detokenize(http: Request, body: DetokenizeRequest) -> dict:
        """vLLM's shape: ``{"prompt"}``."""
        check_model(body.model)
        ignored.record(check_unhonoured(body.model_extra or {}, n=1), http.url.path)
        return {"prompt": await encoder.decode(body.tokens)}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """Liveness only (vLLM's and SageMaker's route): 200 while the process answers."""
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Whether requests are served (200, else 503: a load balancer stops routing here once
        the engine has closed or no replica is alive), and what the engine holds now: a test
        reads the block counts here (a cluster: each replica's state too)."""
        state = client.health()
        return JSONResponse(state, status_code=200 if state["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(client.metrics_text() + generate_latest(registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    return app


def _is_ids(prompt: object) -> bool:
    """Whether a completions prompt is one list of token ids (not a list of prompts)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


async def _until_disconnect(http: Request, generation: Generation) -> list[RequestOutput] | None:
    """The generation's outputs, or None (the generation aborted) if the client disconnects
    first: the body is read, so the next ASGI message is the disconnect."""

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    result = asyncio.ensure_future(generation.outputs())
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({result, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not result.done():  # the client left (or this task was cancelled)
            generation.abort()
            result.cancel()
    return None if result.cancelled() or not result.done() else result.result()
