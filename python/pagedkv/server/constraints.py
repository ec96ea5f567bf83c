"""What a request's output must match: the fields that ask for a constraint (``response_format``,
vLLM's ``structured_outputs``, the legacy ``guided_*`` aliases, ``tools``) read into one
:class:`Constraint`, a :class:`~pagedkv.grammar.StructuredOutputs` for the engine, compiled off
the event loop before the request is queued (:func:`compile_constraint`).

Invariants:

- Never fail open: every field naming a constraint is honoured or refused with a 400 naming it;
  none is dropped. (``guided_decoding_backend`` names an implementation: it is ignored.)
- At most one constraint per request: two fields asking for one are a 400 naming both, except
  ``tools`` with ``response_format``: "auto" then answers with calls or with the text the format
  asks for (:meth:`~pagedkv.server.tools.ToolUse.grammar`).
- A whitespace option (``guided_whitespace_pattern``, ``structured_outputs.whitespace_pattern`` or
  ``disable_any_whitespace``) applies to a JSON constraint only, as llguidance's ``x-guidance``
  options of its schema; elsewhere it is a 400.
- A constraint that is malformed, too large, does not compile or matches nothing is a
  :class:`~pagedkv.server.fields.FieldError` naming its field, raised before anything is queued.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidArgumentError
from pagedkv.grammar import GrammarCompiler, StructuredOutputs
from pagedkv.server.fields import FieldError
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv.server.tools import Function, ToolUse

__all__ = ["Constraint", "combined_constraint", "compile_constraint", "format_constraint", "request_constraint"]

# The legacy vLLM fields and the StructuredOutputs field each one is an alias of.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
           "guided_json_object": "json_object"}


@dataclass(frozen=True)
class Constraint:
    """A request's constraint: ``structured_outputs`` for the engine (None: none), ``param`` the
    field it came from (what its errors name), ``tools`` how calls are read out of the output,
    ``functions`` those the prompt shows (None: no tools offered, or ``tool_choice`` "none")."""

    structured_outputs: StructuredOutputs | None = None
    param: str | None = None
    tools: ToolUse | None = None
    functions: tuple[Function, ...] | None = None


def request_constraint(request: CompletionRequest | ChatCompletionRequest) -> Constraint:
    """The constraint ``request`` asks for (see the module doc); :class:`FieldError` if it asks
    for two, or for one that is malformed."""
    sources = _text_constraints(request)
    if len(sources) > 1:
        (first, _), (second, _) = sources[:2]
        raise FieldError(f"{first} and {second} both constrain the output: give one of them", second)
    text = _with_whitespace(request, sources[0] if sources else None)
    functions, tools = _tool_use(request)
    return combined_constraint(text, functions, tools, "response_format")


def combined_constraint(text: tuple[str, dict[str, Any]] | None, functions: tuple[Function, ...],
                        tools: ToolUse | None, format_param: str) -> Constraint:
    """The constraint of a request asking for ``text`` (the field asking for a constraint on the
    text and its StructuredOutputs fields; None: none) and offering ``functions`` to use as
    ``tools`` says. With tools, the only text constraint allowed is the output format (the
    request's ``format_param``), the answer "auto" gives instead of calls; any other is a
    :class:`FieldError`."""
    if tools is None:
        if text is None:
            return Constraint()
        param, fields = text
        return Constraint(_spec(param, **fields), param)
    answer = None
    if text is not None:
        param, fields = text
        if param != format_param:
            raise FieldError(f"tools and {param} both constrain the output: give one of them (or {format_param})", param)
        answer = _schema_object(param, fields["json"]) if "json" in fields else {"type": "object"}
    return Constraint(_spec("tools", grammar=tools.grammar(answer)), "tools", tools, functions)


def format_constraint(kind: str, schema: dict[str, Any] | None, param: str, schema_field: str) -> dict[str, Any] | None:
    """The StructuredOutputs fields of an OpenAI output format of type ``kind`` ("text": none,
    "json_object", "json_schema" with its ``schema``): chat's ``response_format``, the Responses
    API's ``text.format`` (``param``; ``schema_field`` where it holds the schema)."""
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        if schema is None:
            raise FieldError(f"{param} of type json_schema needs {schema_field}", param)
        return {"json": schema}
    return None


async def compile_constraint(grammars: GrammarCompiler | None, constraint: Constraint) -> None:
    """Compiles the constraint in a worker thread (a large schema takes tens of ms), so that the
    engine, compiling it again when the request is added, finds it in its cache. Raises
    :class:`FieldError` naming the constraint's field if it does not compile or matches nothing.
    ``grammars`` None (a cluster: its replicas compile in their own processes and refuse a bad
    constraint when it is submitted): nothing is done here."""
    if grammars is None or constraint.structured_outputs is None:
        return
    try:
        await asyncio.to_thread(grammars.compile, constraint.structured_outputs)
    except InvalidArgumentError as error:
        raise FieldError(str(error), constraint.param) from None


def _spec(param: str, **fields: Any) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)
    except InvalidArgumentError as error:
        raise FieldError(str(error), param) from None


def _text_constraints(request: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, dict[str, Any]]]:
    """Each field of ``request`` asking for a constraint on the text, with its StructuredOutputs fields."""
    sources: list[tuple[str, dict[str, Any]]] = []
    response_format = request.response_format
    if response_format is not None:
        schema = None if response_format.json_schema is None else response_format.json_schema.schema_
        fields = format_constraint(response_format.type, schema, "response_format", "json_schema.schema")
        if fields is not None:
            sources.append(("response_format", fields))
    if request.structured_outputs is not None:
        constraint = request.structured_outputs.constraint()
        if not constraint:
            raise FieldError("structured_outputs gives none of json, regex, choice, grammar or json_object",
                             "structured_outputs")
        sources.append(("structured_outputs", constraint))
    for name, field in _GUIDED.items():
        value = getattr(request, name)
        if value is not None and value is not False:
            sources.append((name, {field: value}))
    return sources


def _with_whitespace(request: CompletionRequest | ChatCompletionRequest,
                     source: tuple[str, dict[str, Any]] | None) -> tuple[str, dict[str, Any]] | None:
    """``source`` with the request's whitespace option among its JSON schema's ``x-guidance``."""
    options: list[tuple[str, dict[str, Any]]] = []
    if request.guided_whitespace_pattern is not None:
        options.append(("guided_whitespace_pattern", {"whitespace_pattern": request.guided_whitespace_pattern}))
    structured = request.structured_outputs
    if structured is not None and structured.whitespace_pattern is not None:
        options.append(("structured_outputs.whitespace_pattern", {"whitespace_pattern": structured.whitespace_pattern}))
    if structured is not None and structured.disable_any_whitespace:
        options.append(("structured_outputs.disable_any_whitespace", {"whitespace_flexible": False}))
    if not options:
        return source
    if len(options) > 1:
        raise FieldError(f"{options[0][0]} and {options[1][0]} both set the JSON whitespace: give one", options[1][0])
    option, guidance = options[0]
    if source is None or not source[1].keys() & {"json", "json_object"}:
        raise FieldError(f"{option} applies to a JSON constraint (json, json_object, a json_schema response_format) only",
                         option)
    param, fields = source
    schema = _schema_object(param, fields["json"]) if "json" in fields else {"type": "object"}
    given = schema.get("x-guidance")
    return param, {"json": {**schema, "x-guidance": {**(given if isinstance(given, Mapping) else {}), **guidance}}}


def _schema_object(param: str, schema: Mapping[str, Any] | str | bool) -> dict[str, Any]:
    """A JSON schema given as a mapping, JSON text or ``true``, as a dict."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise FieldError(f"the JSON schema is not JSON: {error}", param) from None
    if schema is True:
        return {}
    if not isinstance(schema, Mapping):
        raise FieldError(f"a JSON schema must be an object, got {type(schema).__name__}", param)
    return dict(schema)


def _tool_use(request: CompletionRequest | ChatCompletionRequest) -> tuple[tuple[Function, ...], ToolUse | None]:
    """The functions a chat request offers, and their use (None: none to call)."""
    if not isinstance(request, ChatCompletionRequest):
        return (), None
    functions = tuple(Function.of(i, t.function.name, t.function.description, t.function.parameters)
                      for i, t in enumerate(request.tools or ()))
    choice = request.tool_choice
    named = None if choice is None or isinstance(choice, str) else choice.function.name
    mode = choice if isinstance(choice, str) else None
    return functions, ToolUse.of(functions, mode, named, request.parallel_tool_calls)
