"""Tool calling: the functions a chat request offers (``tools``, ``tool_choice``,
``parallel_tool_calls``) as a :class:`ToolUse`; how the model is told of them and of past calls
(:func:`prepare_conversation`); the grammar its calls are held to (:meth:`ToolUse.grammar`); its
output read back as OpenAI's ``tool_calls`` (:class:`ToolCallParser`).

The model writes calls in the Hermes / Qwen 2.5 format, one call per pair of tags, calls
separated by a newline::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Invariants:

- The format is written down once, here (:data:`TOOL_CALL_OPEN`, :data:`TOOL_CALL_CLOSE`,
  :func:`call_text` and the pieces it joins): the system prompt, past calls in the history, the
  grammar and the parser are all built from it.
- A call's JSON has ``json.dumps``'s separators (``", "`` and ``": "``) and no other whitespace:
  the grammar allows nothing else, so the parser reads literal text and a call's ``arguments`` is
  the model's own text, a JSON object valid under the function's ``parameters``. The schemas in
  the grammar are held as the core holds a JSON schema constraint (one line; an object listing
  ``properties`` allows no others unless it says so).
- ``required``: one call or more (exactly one without ``parallel_tool_calls``); a named function:
  exactly one call of it; ``auto``: free text, or free text then calls — once the text writes
  :data:`TOOL_CALL_OPEN`, a valid call must follow (a text never begins a malformed call); with a
  ``response_format``, either the answer it asks for or calls alone. ``none``: no constraint,
  nothing parsed, and the functions are not shown to the model.
- Parsing is incremental, and a whole response is the same parser fed the whole text: a stream
  and a whole response say the same (but for the calls' random ids).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedkv._core import prepared_json_schema
from pagedkv.errors import PagedKVError
from pagedkv.server.fields import FieldError

__all__ = [
    "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "TOOL_RESPONSE_CLOSE", "TOOL_RESPONSE_OPEN", "Function", "ToolCall",
    "ToolCallFormatError", "ToolCallParser", "ToolUse", "call_arguments", "call_text", "prepare_conversation",
    "tools_prompt",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# A tool's result, as the fallback rendering shows it to the model (Qwen 2.5's tags).
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

# The pieces of a call between its tags: call_text joins them; the grammar and the parser expect them.
_TAG_GAP = "\n"  # between a tag and the call's JSON
_CALL_SEPARATOR = "\n"  # between one call's closing tag and the next one's opening tag
_NAME_KEY = '{"name": '
_ARGUMENTS_KEY = ', "arguments": '
_CALL_END = "}" + _TAG_GAP + TOOL_CALL_CLOSE

# OpenAI's rule for a function's name; it also keeps names free of anything to escape.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it: ``arguments`` is the JSON text of the arguments object."""
    return TOOL_CALL_OPEN + _TAG_GAP + _NAME_KEY + json.dumps(name) + _ARGUMENTS_KEY + arguments + _CALL_END


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # json.dumps's separators are the format's


def _json_rule(schema: Mapping[str, Any]) -> str:
    """A Lark rule body holding ``schema`` as the core holds a ``json_schema`` constraint (its
    objects closed, its output on one line: ``prepared_json_schema``, the rule's one owner)."""
    return f"%json {prepared_json_schema(_compact(schema))}"


@dataclass(frozen=True)
class Function:
    """A function the model may call: ``parameters`` is a JSON schema of an object; ``path`` the
    request field defining it (what errors about it name: chat's ``tools[0].function``, the
    Responses API's ``tools[0]``)."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]
    path: str = field(default="tools", compare=False)

    @classmethod
    def of(cls, index: int, name: str, description: str | None, parameters: Mapping[str, Any] | None, *,
           path: str | None = None) -> Function:
        """Tool ``index``'s function, defined at ``path`` (default: chat's ``tools[index].function``).
        ``parameters`` must be an object's schema (without one, the function takes no arguments);
        one giving no ``type`` is given ``"type": "object"``. :class:`FieldError` otherwise (the
        name is checked by :meth:`ToolUse.of`)."""
        path = f"tools[{index}].function" if path is None else path
        schema = dict(parameters) if parameters is not None else {"properties": {}}
        kind = schema.setdefault("type", "object")
        if kind != "object":
            raise FieldError(f"a function's parameters must be the JSON schema of an object, got type {kind!r:.80}",
                             f"{path}.parameters")
        return cls(name, description, schema, path)

    def definition(self) -> dict[str, Any]:
        """OpenAI's tool definition (what chat templates read in ``tools``)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """The functions of a request and how they must be used: ``mode`` "auto" (text or calls),
    "required" (calls) or "named" (one call of ``functions[0]``, the one named);
    ``parallel``: more than one call allowed."""

    functions: tuple[Function, ...]
    mode: Literal["auto", "required", "named"]
    parallel: bool

    @classmethod
    def of(cls, functions: Sequence[Function], tool_choice: Literal["none", "auto", "required"] | None,
           named: str | None, parallel: bool, *, choice_field: str = "tool_choice") -> ToolUse | None:
        """The use of ``functions`` under ``tool_choice`` (None: "auto" with functions, else
        "none") or the function ``named``, or None when nothing is to be called. Raises
        :class:`FieldError` for a bad name, two functions of one name, a choice (the request's
        ``choice_field``) asking for functions that are not offered, or naming one that is not."""
        names = [f.name for f in functions]
        for i, (function, name) in enumerate(zip(functions, names, strict=True)):
            if not _FUNCTION_NAME.fullmatch(name):
                raise FieldError(f"a function's name is 1 to 64 letters, digits, '_' or '-', got {name!r:.80}",
                                 f"{function.path}.name")
            if name in names[:i]:
                raise FieldError(f"two functions are named {name!r}", f"{function.path}.name")
        if named is not None:
            if named not in names:
                offered = ", ".join(names) or "no tools are given"
                raise FieldError(f"{choice_field} names the function {named!r}, which is not among the tools ({offered})",
                                 choice_field)
            return cls(tuple(f for f in functions if f.name == named), "named", False)
        choice = tool_choice or ("auto" if functions else "none")
        if choice == "none" or (choice == "auto" and not functions):
            return None
        if not functions:
            raise FieldError(f"{choice_field} {choice!r} needs tools, and none are given", choice_field)
        return cls(tuple(functions), choice, parallel)

    @property
    def text_allowed(self) -> bool:
        """Whether the model may answer with text instead of calls ("auto")."""
        return self.mode == "auto"

    def grammar(self, answer_schema: Mapping[str, Any] | None = None) -> str:
        """The Lark grammar (llguidance's dialect) of the output. ``answer_schema`` (with "auto"):
        the JSON schema a text answer must match instead of free text (``response_format``)."""
        calls = "call (" + json.dumps(_CALL_SEPARATOR) + " call)*" if self.parallel else "call"
        rules = [
            f"calls: {calls}",
            f"call: {json.dumps(TOOL_CALL_OPEN)} call_body",
            "call_body: " + " | ".join(f"function_{i}" for i in range(len(self.functions))),
        ]
        for i, function in enumerate(self.functions):
            head = _TAG_GAP + _NAME_KEY + json.dumps(function.name) + _ARGUMENTS_KEY
            rules.append(f"function_{i}: {json.dumps(head)} arguments_{i} {json.dumps(_CALL_END)}")
            rules.append(f"arguments_{i}: {_json_rule(function.parameters)}")
        if not self.text_allowed:
            start = "start: calls"
        elif answer_schema is not None:
            start = f"start: answer | calls\nanswer: {_json_rule(answer_schema)}"
        else:
            # A lazy lexeme ends at the first opening tag: text holding one is always a call's start.
            opened = "call_body (" + json.dumps(_CALL_SEPARATOR) + " call)*" if self.parallel else "call_body"
            start = (f"start: TEXT | text_then_open {opened}\nTEXT: /(?s:.*)/\n"
                     f"text_then_open[lazy]: /(?s:.*){re.escape(TOOL_CALL_OPEN)}/")
        return "\n".join([start, *rules]) + "\n"

    def parser(self) -> ToolCallParser:
        """A parser of one output of this use."""
        return ToolCallParser(text_before_calls=self.text_allowed)


class ToolCallFormatError(PagedKVError):
    """The model's output left the tool-call format its grammar holds it to: a bug of pagedkv."""


@dataclass
class ToolCall:
    """A call read from the output; ``arguments`` grows as the text arrives."""

    id: str
    name: str
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _held_tag_prefix(text: str) -> int:
    """The length of the longest end of ``text`` that may begin :data:`TOOL_CALL_OPEN`."""
    for size in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ToolCallParser:
    """Reads one output as it arrives (:meth:`feed`, then :meth:`finish`), giving the chat
    ``delta``\\ s it amounts to: ``{"content": …}`` for text, ``{"tool_calls": [{index, id,
    type, function: {name, arguments: ""}}]}`` when a call's name is known, then ``{"tool_calls":
    [{index, function: {arguments: …}}]}`` fragments. ``text_before_calls``: text may precede the
    calls (the first :data:`TOOL_CALL_OPEN` starts them), else calls start the output or there are
    none. Text just before the calls, whitespace only, is no content."""

    text_before_calls: bool
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    # Where the output is (its _read_ method): "text" (before any call; _held: text not given out
    # yet), "answer" (no call will come), "literal" (expecting _literal), "name", "arguments",
    # "after_call".
    _state: str = "text"
    _held: str = ""
    _literal: str = ""
    _then: str = ""  # the state after the literal
    _depth: int = 0  # of the arguments' JSON
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas ``text`` completes."""
        deltas: list[dict[str, Any]] = []
        rest = text
        while rest:
            rest = getattr(self, f"_read_{self._state}")(rest, deltas)
        return deltas

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left at the output's end: held text (a call cut short by ``max_tokens``
        stays as far as it went; one cut before its name is dropped)."""
        deltas: list[dict[str, Any]] = []
        if self._state == "text" and self._held:
            self._give_text(self._held, deltas)
            self._held = ""
        return deltas

    def message(self) -> dict[str, Any]:
        """The chat ``message`` of the output read so far: ``content`` null when only calls."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.calls:
            message["tool_calls"] = [call.as_openai() for call in self.calls]
        return message

    def _give_text(self, text: str, deltas: list[dict[str, Any]]) -> None:
        if text:
            self.content += text
            deltas.append({"content": text})

    def _expect(self, literal: str, then: str) -> None:
        self._state, self._literal, self._then = "literal", literal, then

    def _read_text(self, text: str, deltas: list[dict[str, Any]]) -> str:
        held = self._held + text
        if not self.text_before_calls:  # calls open the output, or it is an answer
            if held.startswith(TOOL_CALL_OPEN):
                self._held = ""
                self._expect(_TAG_GAP + _NAME_KEY, "name")
                return held[len(TOOL_CALL_OPEN):]
            if TOOL_CALL_OPEN.startswith(held):
                self._held = held
                return ""
            self._held, self._state = "", "answer"
            return held
        opened = held.find(TOOL_CALL_OPEN)
        if opened >= 0:
            self._give_text(held[:opened].rstrip(), deltas)
            self._held = ""
            self._expect(_TAG_GAP + _NAME_KEY, "name")
            return held[opened + len(TOOL_CALL_OPEN):]
        # Held back: what may begin the tag, and the whitespace before it (no content if a call follows).
        given = held[:len(held) - _held_tag_prefix(held)].rstrip()
        self._give_text(given, deltas)
        self._held = held[len(given):]
        return ""

    def _read_answer(self, text: str, deltas: list[dict[str, Any]]) -> str:
        self._give_text(text, deltas)
        return ""

    def _read_literal(self, text: str, deltas: list[dict[str, Any]]) -> str:
        size = min(len(text), len(self._literal))
        if text[:size] != self._literal[:size]:
            raise ToolCallFormatError(f"expected {self._literal!r} in a tool call, got {text[:size]!r}")
        self._literal = self._literal[size:]
        if not self._literal:
            self._state = self._then
        return text[size:]

    def _read_name(self, text: str, deltas: list[dict[str, Any]]) -> str:
        # The name is a JSON string of letters, digits, '_' and '-' (ToolUse.of): it ends at its second quote.
        held = self._held + text
        end = held.find('"', 1)
        if end < 0:
            self._held = held
            return ""
        self._held = ""
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", json.loads(held[:end + 1]))
        self.calls.append(call)
        deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}}]})
        self._expect(_ARGUMENTS_KEY, "arguments")
        self._depth, self._in_string, self._escaped = 0, False, False
        return held[end + 1:]

    def _read_arguments(self, text: str, deltas: list[dict[str, Any]]) -> str:
        end = len(text)
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    self._expect(_CALL_END, "after_call")
                    break
        fragment = text[:end]
        self.calls[-1].arguments += fragment
        deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": fragment}}]})
        return text[end:]

    def _read_after_call(self, text: str, deltas: list[dict[str, Any]]) -> str:
        self._expect(_CALL_SEPARATOR + TOOL_CALL_OPEN + _TAG_GAP + _NAME_KEY, "name")
        return text


def tools_prompt(functions: Sequence[Function]) -> str:
    """The system prompt telling a model without a tool-aware template of ``functions`` and of
    the call format (Qwen 2.5's wording)."""
    listed = "\n".join(_compact(f.definition()) for f in functions)
    example = TOOL_CALL_OPEN + _TAG_GAP + _NAME_KEY + "<function-name>" + _ARGUMENTS_KEY + "<args-json-object>" + _CALL_END
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
            f"For each function call, return a json object with function name and arguments within "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n{example}")


def prepare_conversation(messages: Sequence[Mapping[str, Any]], functions: Sequence[Function] | None,
                         template_has_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and ``tools`` variable a chat template renders. Past calls' ``arguments``
    (JSON text on the wire) become objects, as templates expect (vLLM does the same). A template
    that reads ``tools`` (``template_has_tools``) gets the tool definitions and the history as it
    is; any other gets none: :func:`tools_prompt` joins the system message, past calls become the
    assistant's text in the call format, and ``tool`` messages user turns of
    :data:`TOOL_RESPONSE_OPEN` ... :data:`TOOL_RESPONSE_CLOSE` (consecutive ones in one turn).
    Raises :class:`FieldError` for a malformed past call."""
    checked = [_with_parsed_calls(i, m) for i, m in enumerate(messages)]
    if template_has_tools:
        return checked, None if functions is None else [f.definition() for f in functions]
    rendered: list[dict[str, Any]] = []
    responding = False  # the last rendered message holds tool responses
    for message in checked:
        if message.get("role") == "tool":
            response = f"{TOOL_RESPONSE_OPEN}\n{message.get('content', '')}\n{TOOL_RESPONSE_CLOSE}"
            if responding:
                rendered[-1]["content"] += "\n" + response
            else:
                rendered.append({"role": "user", "content": response})
            responding = True
            continue
        responding = False
        if message.get("tool_calls"):
            calls = [call_text(c["function"]["name"], _compact(c["function"]["arguments"])) for c in message["tool_calls"]]
            text = "\n".join(filter(None, [message.get("content", ""), _CALL_SEPARATOR.join(calls)]))
            rendered.append({k: v for k, v in message.items() if k != "tool_calls"} | {"content": text})
        else:
            rendered.append(message)
    if functions:
        prompt = tools_prompt(functions)
        if rendered and rendered[0].get("role") == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{prompt}"
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _with_parsed_calls(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """``message`` with its ``tool_calls``' arguments as objects; :class:`FieldError` if a call
    is not ``{"function": {"name": str, "arguments": JSON text of an object}}``."""
    copied = dict(message)
    calls = copied.get("tool_calls")
    if calls is None:
        return copied
    if not isinstance(calls, list):
        raise FieldError("tool_calls must be a list", f"messages[{index}].tool_calls")
    parsed = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise FieldError("a tool call needs function.name, a string", where)
        arguments = call_arguments(function.get("arguments", "{}"), f"{where}.function.arguments")
        parsed.append({**call, "function": {**function, "arguments": arguments}})
    copied["tool_calls"] = parsed
    return copied


def call_arguments(arguments: Any, param: str) -> dict[str, Any]:
    """A past call's ``arguments`` (JSON text on the wire, or already an object) as an object;
    :class:`FieldError` naming ``param`` if they are not a JSON object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as error:
            raise FieldError(f"a tool call's arguments must be JSON: {error}", param) from None
    if not isinstance(arguments, Mapping):
        raise FieldError("a tool call's arguments must be a JSON object", param)
    return dict(arguments)
