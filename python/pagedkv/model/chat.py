"""Chat templates: a conversation (a list of ``{"role", "content"}`` messages) rendered to the
prompt text a chat model was trained on, with the Jinja template shipped with its tokenizer.

Rendered as transformers' ``apply_chat_template`` renders it: an immutable sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``tojson`` filter that keeps non-ASCII text, the globals ``raise_exception`` (a template refusing
a conversation) and ``strftime_now``, and the variables ``messages``, ``add_generation_prompt``,
``bos_token`` and ``eos_token``. The text is then tokenized without adding special tokens: the
template writes them.

Invariants: :func:`check_messages` is the one validator of a conversation; a conversation it
accepts that the template still refuses (``raise_exception``, or any template error) raises
:class:`InvalidArgumentError`, as it does; a template that does not compile raises
:class:`CheckpointError` naming where it came from. Compiled templates are cached by text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

from pagedkv.errors import CheckpointError, InvalidArgumentError

__all__ = ["check_messages", "render_chat"]


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
    source: object = "chat template",
) -> str:
    """The prompt text of ``messages`` (checked by :func:`check_messages`) under ``template``;
    ``add_generation_prompt`` ends it with the opening of the assistant's turn (templates that
    support it). Raises :class:`InvalidArgumentError` for messages refused by the checks or by
    the template, :class:`CheckpointError` (naming ``source``) for a template that does not
    compile."""
    import jinja2

    checked = check_messages(messages)
    compiled = _compile(template, str(source))
    try:
        return compiled.render(
            messages=checked, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token
        )
    except jinja2.TemplateError as error:
        raise InvalidArgumentError(f"the chat template refused the conversation: {error}") from None


@lru_cache(maxsize=16)
def _compile(template: str, source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.from_string(template)
    except jinja2.TemplateError as error:
        raise CheckpointError(source, f"the chat template does not compile: {error}") from None
