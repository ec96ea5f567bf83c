"""OpenAI's Responses API (``POST /v1/responses``), whole or streamed as its typed events: the
request becomes a chat conversation (``instructions`` the system message, ``input`` a text or a
list of items: messages, past function calls and their outputs) generated as a chat completion
is, with chat's constraints and tools.

Invariants:

- Nothing is stored: ``store`` must be false or absent (a response is never kept, so
  ``previous_response_id`` and ``store: true`` are 400s, as is every field pagedkv cannot
  honour: :mod:`pagedkv.server.fields`).
- ``text.format`` is chat's ``response_format`` and ``tools`` (flat function definitions),
  ``tool_choice`` and ``parallel_tool_calls`` are chat's: the same
  :class:`~pagedkv.server.constraints.Constraint`, grammar and parser
  (:mod:`pagedkv.server.constraints`, :mod:`pagedkv.server.tools`). Errors name the Responses
  fields (``text.format``, ``tools[0].name``, ``input[2].arguments``). Tools of other types are
  a 400. Past ``function_call`` items are rendered as an assistant turn's ``tool_calls`` (joining
  the assistant message just before them), ``function_call_output`` items as ``tool`` messages.
- The output is a ``message`` item holding the text (none when the model only called), then one
  ``function_call`` item per call (``id`` ``fc_…``, ``call_id`` ``call_…``, ``arguments`` its
  JSON text), in the order written. When ``max_output_tokens`` cut the output, its last item is
  ``incomplete``. A whole response and a stream build their items with one :class:`_Output`, so
  they say the same (but for the random ids).
- A stream is ``response.created``, ``response.in_progress``, then for each item in turn
  ``response.output_item.added``; for a message its content part added, one
  ``response.output_text.delta`` per text delta, the text and part done; for a call one
  ``response.function_call_arguments.delta`` per fragment and ``…arguments.done``; then
  ``response.output_item.done``; at last ``response.completed`` (``response.incomplete`` when
  ``max_output_tokens`` cut it; a failure ends with ``response.failed``). ``sequence_number``
  counts from 0; ``output_index`` is the item's place in the final output.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from pagedkv.engine import RequestOutput
from pagedkv.errors import PagedKVError
from pagedkv.grammar import StructuredOutputs
from pagedkv.sampling import SamplingParams
from pagedkv.server.constraints import Constraint, combined_constraint, format_constraint
from pagedkv.server.errors import classify
from pagedkv.server.fields import NotSupportedError, check_unhonoured
from pagedkv.server.formats import SYSTEM_FINGERPRINT
from pagedkv.server.generation import Generation, finish_reason
from pagedkv.server.protocol import ChatMessage, ClosedObject, FunctionDefinition, RequestBody
from pagedkv.server.tools import Function, ToolUse, call_arguments

__all__ = [
    "FunctionCallItem", "FunctionCallOutputItem", "FunctionTool", "ResponsesRequest", "TextConfig", "TextFormat",
    "response_object", "stream_events",
]

_STATUS = Literal["in_progress", "completed", "incomplete"]


class TextFormat(ClosedObject):
    """``text.format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` with its ``schema`` (enforced whether ``strict`` is true or false)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(ClosedObject):
    """``text``: its ``format``; ``verbosity`` (a hint pagedkv's models have no use for) is ignored
    and counted."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class FunctionTool(FunctionDefinition):
    """A function the model may call, in the Responses API's flat shape: chat's
    :class:`~pagedkv.server.protocol.FunctionDefinition` with its ``type`` beside it (chat nests
    the same fields under ``function``)."""

    type: Literal["function"]


class FunctionChoice(ClosedObject):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    name: str


class FunctionCallItem(ClosedObject):
    """A past call in ``input`` (a ``function_call`` output item sent back; ``id`` and ``status``
    say nothing the prompt shows)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: _STATUS | None = None


class FunctionCallOutputItem(ClosedObject):
    """A past call's result in ``input``: ``output`` a text or a list of text parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: _STATUS | None = None


def _item_type(item: Any) -> Any:
    """An input item's tag: its ``type``, "message" when it gives none (an easy input message)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


_InputItem = Annotated[
    Annotated[ChatMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


def _text_parts(content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
    """Content with the Responses API's ``input_text`` / ``output_text`` parts as chat's text parts."""
    if not isinstance(content, list):
        return content
    return [{**p, "type": "text"} if p.get("type") in ("input_text", "output_text") else p for p in content]


class ResponsesRequest(RequestBody):
    """The fields of a Responses request pagedkv honours (others: refused or ignored)."""

    model: str | None = None
    input: list[_InputItem] = Field(min_length=1)  # a text is one user message (_text_is_a_message)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # not OpenAI's here (chat's, as vLLM takes it): a sampled response repeatable
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    user: str | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_message(cls, given: Any) -> Any:
        if given == "":
            raise ValueError("input must not be empty")
        return [{"role": "user", "content": given}] if isinstance(given, str) else given

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, tools: Any) -> Any:
        for i, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{i}] is of type {kind!r:.40}: only function tools are supported")
        return tools

    def check(self) -> list[str]:
        """Refuses what cannot be honoured; returns the names ignored."""
        if self.store:
            raise NotSupportedError("store is not supported: responses are not kept (send store: false)", "store")
        if self.previous_response_id is not None:
            raise NotSupportedError("previous_response_id is not supported: responses are not kept", "previous_response_id")
        verbosity = ["text.verbosity"] if self.text is not None and self.text.verbosity is not None else []
        return check_unhonoured(self.model_extra or {}, n=1) + verbosity

    def constraint(self) -> Constraint:
        """What the output must match: ``text.format`` as chat's ``response_format``, the tools
        as chat's (:func:`~pagedkv.server.constraints.combined_constraint`)."""
        form = None if self.text is None else self.text.format
        fields = None if form is None else format_constraint(form.type, form.schema_, "text.format", "schema")
        functions = tuple(Function.of(i, t.name, t.description, t.parameters, path=f"tools[{i}]")
                          for i, t in enumerate(self.tools or ()))
        choice = self.tool_choice
        named = choice.name if isinstance(choice, FunctionChoice) else None
        mode = choice if isinstance(choice, str) else None
        tools = ToolUse.of(functions, mode, named, self.parallel_tool_calls is not False)
        return combined_constraint(None if fields is None else ("text.format", fields), functions, tools, "text.format")

    def messages(self) -> list[dict[str, Any]]:
        """The conversation: the instructions as a system message, then the input (see the
        module doc)."""
        system = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        turns: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            if isinstance(item, FunctionCallItem):
                arguments = call_arguments(item.arguments, f"input[{i}].arguments")
                call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
                if turns and turns[-1]["role"] == "assistant":  # the calls of the turn whose text came before
                    turns[-1].setdefault("tool_calls", []).append(call)
                else:
                    turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                result = ChatMessage.model_validate(
                    {"role": "tool", "content": _text_parts(item.output), "tool_call_id": item.call_id})
                turns.append(result.for_template(i))
            else:
                turns.append(item.model_copy(update={"content": _text_parts(item.content)}).for_template(i))
        return [*system, *turns]

    def params(self, default: SamplingParams, default_max_tokens: int,
               structured_outputs: StructuredOutputs | None) -> SamplingParams:
        """The engine's parameters: the request's where given, else ``default``'s
        (``max_output_tokens`` else ``default_max_tokens``), held to ``structured_outputs``."""
        given = {"max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                 "seed": self.seed}
        fields: dict[str, Any] = {name: value for name, value in given.items() if value is not None}
        fields.setdefault("max_tokens", default_max_tokens)
        return dataclasses.replace(default, **fields, structured_outputs=structured_outputs)


# A stream event before it is numbered: its type and its fields.
_Event = tuple[str, dict[str, Any]]


class _Output:
    """The output items of one response, built as its text arrives (see the module doc):
    :meth:`feed` and :meth:`finish` return the stream events that build them; :attr:`items` are
    the items, each as the final response lists it once closed. Only the last item is ever open."""

    def __init__(self, tools: ToolUse | None) -> None:
        self._parser = None if tools is None else tools.parser()
        self.items: list[dict[str, Any]] = []
        self._open = False

    def feed(self, text: str) -> list[_Event]:
        deltas = [{"content": text}] if self._parser is None else self._parser.feed(text)
        return [event for delta in deltas for event in self._delta(delta)]

    def finish(self, cut: bool) -> list[_Event]:
        """The events closing the output; ``cut``: ``max_output_tokens`` ended it."""
        events = [] if self._parser is None else [e for delta in self._parser.finish() for e in self._delta(delta)]
        if not self.items:  # nothing was written: the text is empty
            events += self._add_message()
        return events + self._close("incomplete" if cut else "completed")

    def _delta(self, delta: dict[str, Any]) -> list[_Event]:
        """The events of a chat delta (:class:`~pagedkv.server.tools.ToolCallParser`'s shape)."""
        if "content" in delta:
            text = delta["content"]
            if not text:
                return []
            # Text comes before any call: only the first item is a message, opened by the first text.
            events = [] if self._open else self._add_message()
            self.items[-1]["content"][0]["text"] += text
            return [*events, ("response.output_text.delta", {**self._where(), "content_index": 0, "delta": text, "logprobs": []})]
        (call,) = delta["tool_calls"]
        if "id" in call:  # a call opens: the item before it is whole
            return self._close("completed") + self._add({
                "type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
        fragment = call["function"]["arguments"]
        self.items[-1]["arguments"] += fragment
        return [("response.function_call_arguments.delta", {**self._where(), "delta": fragment})] if fragment else []

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _add_message(self) -> list[_Event]:
        return self._add({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress", "role": "assistant",
                          "content": [{"type": "output_text", "text": "", "annotations": []}]})

    def _add(self, item: dict[str, Any]) -> list[_Event]:
        self.items.append(item)
        self._open = True
        if item["type"] != "message":
            return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)})]
        # A message is added empty; its part is added by an event of its own.
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": {**item, "content": []}}),
                ("response.content_part.added", {**self._where(), "content_index": 0, "part": dict(item["content"][0])})]

    def _close(self, status: str) -> list[_Event]:
        if not self._open:
            return []
        self._open = False
        item = self.items[-1]
        item["status"] = status
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            events: list[_Event] = [
                ("response.output_text.done", {**where, "content_index": 0, "text": part["text"], "logprobs": []}),
                ("response.content_part.done", {**where, "content_index": 0, "part": dict(part)}),
            ]
        else:
            events = [("response.function_call_arguments.done", {**where, "arguments": item["arguments"]})]
        return [*events, ("response.output_item.done", {"output_index": where["output_index"], "item": copy.deepcopy(item)})]


def _shell(request: ResponsesRequest, response_id: str, model: str, created: int, status: str) -> dict[str, Any]:
    form = None if request.text is None else request.text.format
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": [], "usage": None, "error": None, "incomplete_details": None, "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens, "temperature": request.temperature, "top_p": request.top_p,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "tool_choice": "auto" if request.tool_choice is None else (
            request.tool_choice if isinstance(request.tool_choice, str) else request.tool_choice.model_dump()),
        "tools": [t.model_dump() for t in request.tools or ()], "store": False, "metadata": {},
        "text": {"format": {"type": "text"} if form is None else form.model_dump(by_alias=True, exclude_none=True)},
        "truncation": "disabled", "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def _cut(output: RequestOutput) -> bool:
    """Whether ``max_output_tokens`` (or the model's length) ended the output."""
    return finish_reason(output.outputs[0].finish_reason) == "length"


def _finished(shell: dict[str, Any], items: list[dict[str, Any]], output: RequestOutput) -> dict[str, Any]:
    cut = _cut(output)
    prompt, generated = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {
        **shell, "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": items,
        "usage": {"input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
                  "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
                  "output_tokens_details": {"reasoning_tokens": 0}},
    }


def response_object(request: ResponsesRequest, generation: Generation, output: RequestOutput, model: str) -> dict[str, Any]:
    """The whole response of a finished generation."""
    items = _Output(generation.tools)
    items.feed(output.outputs[0].text)
    items.finish(_cut(output))
    shell = _shell(request, f"resp_{uuid.uuid4().hex}", model, generation.created, "in_progress")
    return _finished(shell, items.items, output)


async def stream_events(request: ResponsesRequest, generation: Generation, model: str) -> AsyncIterator[str]:
    """The generation as the Responses API's server-sent events (see the module doc)."""
    shell = _shell(request, f"resp_{uuid.uuid4().hex}", model, generation.created, "in_progress")
    items = _Output(generation.tools)
    number = 0

    def event(kind: str, **body: Any) -> str:
        nonlocal number
        payload = {"type": kind, "sequence_number": number, **body}
        number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    try:
        yield event("response.created", response=shell)
        yield event("response.in_progress", response=shell)
        async for _, token in generation.events():
            if token.text:
                for kind, body in items.feed(token.text):
                    yield event(kind, **body)
        (output,) = await generation.outputs()
        generation.check_ended([output])
        for kind, body in items.finish(_cut(output)):
            yield event(kind, **body)
        done = _finished(shell, items.items, output)
        yield event("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)
    except PagedKVError as error:
        _, name = classify(error)
        failed = {**shell, "status": "failed", "error": {"code": name, "message": str(error)}}
        yield event("response.failed", response=failed)
    finally:
        generation.abort()
