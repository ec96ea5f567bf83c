"""Chat templates: a conversation (a list of ``{"role", "content"}`` messages) rendered to the
prompt text a chat model was trained on, with the Jinja template shipped with its tokenizer.

Rendered as transformers' ``apply_chat_template`` renders it: an immutable sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that keeps non-ASCII text, the globals ``raise_exception`` (a template refusing
a conversation) and ``strftime_now``, and the variables ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` and, when functions are offered, ``tools`` (OpenAI's tool
definitions; :func:`template_reads` tells whether a template uses it). The text is then tokenized
without adding special tokens: the template writes them.

Invariants: :func:`check_messages` is the one validator of a conversation; a conversation it
accepts that the template still refuses (``raise_exception``) or fails on (any error: a
ZeroDivisionError, a RecursionError...) raises :class:`InvalidArgumentError`; a template that does
not compile raises :class:`CheckpointError` naming where it came from. Compiled templates are
cached by text.

A template comes from a checkpoint or a flag, not from this code: its cost is bounded, as a
request's, past a bound it is refused with :class:`InvalidArgumentError`. Rendering stops after
:data:`MAX_RENDER_SECONDS` (a deadline checked at each line the template's code runs, through
``sys.settrace`` in the rendering thread; a loop of 1e10 turns froze the server before, issue 23)
and at :data:`MAX_RENDERED_CHARS` of output; ``*`` and ``**`` refuse results past those sizes
(``"x" * 10**10``, ``10**10**10``) and ``tojson`` an indent past :data:`MAX_JSON_INDENT`. (A
single string method given a huge width, ``center`` or ``format``, is still one C call the
deadline cannot stop.)
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from types import FrameType
from typing import Any

from pagedkv.errors import CheckpointError, InvalidArgumentError

__all__ = [
    "MAX_JSON_INDENT", "MAX_RENDERED_CHARS", "MAX_RENDER_SECONDS", "check_messages", "check_template", "render_chat",
    "template_reads",
]

# Bounds of one rendering. SmolLM2's template renders a four-message conversation in 30 µs (105 µs
# traced); a template needing a second is a loop gone wrong. The output bound is four times the
# body limit of the server (8 MiB), whose messages a template may repeat a few times.
MAX_RENDER_SECONDS = 1.0
MAX_RENDERED_CHARS = 32 * 2**20
MAX_INT_BITS = 65_536  # ``**`` and ``*`` on integers: 10**19728 at most (Python's own str() bound is 4300 digits)
MAX_JSON_INDENT = 64

_TEMPLATE_FILE = "<template>"  # the file name of the code jinja compiles a template string to


class _RenderTimeout(Exception):
    pass


def check_messages(messages: object) -> list[dict[str, Any]]:
    """``messages`` as a list of dicts, or :class:`InvalidArgumentError`: it must be a non-empty
    list (or tuple) of mappings, each with a string ``role`` and a string ``content`` (other keys
    are passed to the template as they are)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgumentError(f"messages must be a non-empty list of {{role, content}} dicts, got {type(messages).__name__}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgumentError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidArgumentError(f"message {i}: {key!r} must be a string, got {message.get(key)!r}")
        checked.append(dict(message))
    return checked


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    source: object = "chat template",
) -> str:
    """The prompt text of ``messages`` (checked by :func:`check_messages`) under ``template``;
    ``add_generation_prompt`` ends it with the opening of the assistant's turn (templates that
    support it); ``tools``: the tool definitions offered, as transformers passes them. Raises
    :class:`InvalidArgumentError` for messages refused by the checks or by the template,
    :class:`CheckpointError` (naming ``source``) for a template that does not compile."""
    import jinja2

    checked = check_messages(messages)
    compiled = _compile(template, str(source))
    variables: dict[str, Any] = {"messages": checked, "add_generation_prompt": add_generation_prompt,
                                 "bos_token": bos_token, "eos_token": eos_token}
    if tools is not None:
        variables["tools"] = [dict(tool) for tool in tools]
    try:
        return _render_bounded(compiled, variables)
    except _RenderTimeout:
        raise InvalidArgumentError(f"the chat template took longer than {MAX_RENDER_SECONDS} s to render") from None
    except jinja2.TemplateError as error:
        raise InvalidArgumentError(f"the chat template refused the conversation: {error}") from None
    except InvalidArgumentError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the template's code raises is this request's fault
        raise InvalidArgumentError(f"the chat template failed: {type(error).__name__}: {error}") from None


def _render_bounded(compiled: Any, variables: dict[str, Any]) -> str:
    """The rendered text, within :data:`MAX_RENDER_SECONDS` and :data:`MAX_RENDERED_CHARS`."""
    deadline = time.monotonic() + MAX_RENDER_SECONDS

    def each_line(frame: FrameType, event: str, arg: object) -> Any:
        if time.monotonic() > deadline:
            raise _RenderTimeout
        return each_line

    def on_call(frame: FrameType, event: str, arg: object) -> Any:
        # Lines are traced in the template's own code only (the sandbox's checks are not ours to slow).
        return each_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        pieces, size = [], 0
        for piece in compiled.generate(**variables):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise InvalidArgumentError(f"the chat template rendered more than {MAX_RENDERED_CHARS} characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        sys.settrace(previous)


def _check_binop(operator: str, left: object, right: object) -> None:
    """Refuses a ``*`` or ``**`` whose result would pass the rendering's bounds."""
    def is_int(value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if operator == "**" and is_int(left) and is_int(right) and right > 0 and abs(left) > 1:  # type: ignore[operator]
        if left.bit_length() * right > MAX_INT_BITS:  # type: ignore[union-attr, operator]
            raise InvalidArgumentError(f"the chat template computes {left} ** {right}: past {MAX_INT_BITS} bits")
    if operator == "*":
        if is_int(left) and is_int(right):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:  # type: ignore[union-attr]
                raise InvalidArgumentError(f"the chat template multiplies integers past {MAX_INT_BITS} bits")
            return
        sequence, count = (left, right) if is_int(right) else (right, left)
        if is_int(count) and isinstance(sequence, (str, list, tuple)) and len(sequence) * count > MAX_RENDERED_CHARS:  # type: ignore[operator]
            raise InvalidArgumentError(f"the chat template repeats a {type(sequence).__name__} past {MAX_RENDERED_CHARS} items")


@lru_cache(maxsize=16)
def template_reads(template: str, variable: str) -> bool:
    """Whether ``template`` reads the variable ``variable`` (``tools``: whether it renders tool
    definitions itself). A template that does not parse reads nothing (rendering it reports why)."""
    import jinja2
    import jinja2.meta

    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return False
    return variable in jinja2.meta.find_undeclared_variables(parsed)


def check_template(template: str, source: object = "chat template") -> None:
    """Raises :class:`CheckpointError` (naming ``source``) if ``template`` does not compile."""
    _compile(template, str(source))


@lru_cache(maxsize=16)
def _compile(template: str, source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        if indent is not None and not (isinstance(indent, int) and 0 <= indent <= MAX_JSON_INDENT):
            raise InvalidArgumentError(f"tojson's indent must be an integer in [0, {MAX_JSON_INDENT}], got {indent!r}")
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

    environment = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as error:
        raise CheckpointError(source, f"the chat template does not compile: {error}") from None
