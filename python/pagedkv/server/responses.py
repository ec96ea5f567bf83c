"""OpenAI's Responses API (``POST /v1/responses``), text in and text out, whole or streamed as its
typed events: the request becomes a chat conversation (``instructions`` the system message,
``input`` a text or a list of messages) generated as a chat completion is.

Invariants:

- Nothing is stored: ``store`` must be false or absent (a response is never kept, so
  ``previous_response_id`` and ``store: true`` are 400s, as is every constraint pagedkv cannot
  honour: :mod:`pagedkv.server.fields`).
- A stream is ``response.created``, ``response.in_progress``, the output item and content part
  opened, one ``response.output_text.delta`` per text delta, the text, part and item done, then
  ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it; a failure
  ends with ``response.failed``); ``sequence_number`` counts from 0.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field

from pagedkv.engine import RequestOutput
from pagedkv.errors import PagedKVError
from pagedkv.sampling import SamplingParams
from pagedkv.server.errors import classify
from pagedkv.server.fields import NotSupportedError, check_unhonoured
from pagedkv.server.formats import SYSTEM_FINGERPRINT
from pagedkv.server.generation import Generation, finish_reason
from pagedkv.server.protocol import ChatMessage, RequestBody

__all__ = ["ResponsesRequest", "response_object", "stream_events"]


class ResponsesRequest(RequestBody):
    """The fields of a Responses request pagedkv honours (others: refused or ignored)."""

    model: str | None = None
    input: str | list[ChatMessage] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    user: str | None = None

    def check(self) -> list[str]:
        """Refuses what cannot be honoured; returns the names ignored."""
        if self.store:
            raise NotSupportedError("store is not supported: responses are not kept (send store: false)", "store")
        if self.previous_response_id is not None:
            raise NotSupportedError("previous_response_id is not supported: responses are not kept", "previous_response_id")
        return check_unhonoured(self.model_extra or {}, n=1)

    def messages(self) -> list[dict[str, Any]]:
        """The conversation: the instructions as a system message, then the input."""
        system = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return [*system, {"role": "user", "content": self.input}]
        turns = []
        for i, message in enumerate(self.input):
            if isinstance(message.content, list):  # input_text / output_text parts are text parts
                parts = [{**p, "type": "text"} if p.get("type") in ("input_text", "output_text") else p for p in message.content]
                message = message.model_copy(update={"content": parts})
            turns.append(message.for_template(i))
        return [*system, *turns]

    def params(self, default: SamplingParams, default_max_tokens: int) -> SamplingParams:
        """The engine's parameters: the request's where given, else ``default``'s
        (``max_output_tokens`` else ``default_max_tokens``)."""
        given = {"max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p}
        fields: dict[str, Any] = {name: value for name, value in given.items() if value is not None}
        fields.setdefault("max_tokens", default_max_tokens)
        return dataclasses.replace(default, **fields)


def _ids() -> tuple[str, str]:
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"


def _shell(request: ResponsesRequest, response_id: str, model: str, created: int, status: str) -> dict[str, Any]:
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": [], "usage": None, "error": None, "incomplete_details": None, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens, "temperature": request.temperature, "top_p": request.top_p,
        "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "store": False, "metadata": {},
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def _message(message_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": message_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _finished(shell: dict[str, Any], message_id: str, output: RequestOutput) -> dict[str, Any]:
    completion = output.outputs[0]
    cut = finish_reason(completion.finish_reason) == "length"
    prompt, generated = len(output.prompt_token_ids), len(completion.token_ids)
    return {
        **shell, "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": [_message(message_id, completion.text, "incomplete" if cut else "completed")],
        "usage": {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
                  "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def response_object(request: ResponsesRequest, generation: Generation, output: RequestOutput, model: str) -> dict[str, Any]:
    """The whole response of a finished generation."""
    response_id, message_id = _ids()
    return _finished(_shell(request, response_id, model, generation.created, "in_progress"), message_id, output)


async def stream_events(request: ResponsesRequest, generation: Generation, model: str) -> AsyncIterator[str]:
    """The generation as the Responses API's server-sent events (see the module doc)."""
    response_id, message_id = _ids()
    shell = _shell(request, response_id, model, generation.created, "in_progress")
    number = 0

    def event(kind: str, **body: Any) -> str:
        nonlocal number
        payload = {"type": kind, "sequence_number": number, **body}
        number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    where = {"item_id": message_id, "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        yield event("response.output_item.added", output_index=0, item={**_message(message_id, "", "in_progress"), "content": []})
        yield event("response.content_part.added", **where, part={"type": "output_text", "text": "", "annotations": []})
        async for _, token in generation.events():
            if token.text:
                yield event("response.output_text.delta", **where, delta=token.text, logprobs=[])
        (output,) = await generation.outputs()
        generation.check_ended([output])
        done = _finished(shell, message_id, output)
        text = output.outputs[0].text
        yield event("response.output_text.done", **where, text=text, logprobs=[])
        yield event("response.content_part.done", **where, part={"type": "output_text", "text": text, "annotations": []})
        yield event("response.output_item.done", output_index=0, item=done["output"][0])
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        yield event(kind, response=done)
    except PagedKVError as error:
        _, name = classify(error)
        failed = {**shell, "status": "failed", "error": {"code": name, "message": str(error)}}
        yield event("response.failed", response=failed)
    finally:
        generation.abort()
