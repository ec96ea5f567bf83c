"""The fields of a request an endpoint does not declare: refused when they ask for what that
endpoint cannot do, else ignored (and counted, by :class:`IgnoredFields`).

What chat and completions honour is declared by their request models (:mod:`pagedkv.server.protocol`)
and never reaches this table: ``response_format``, vLLM's ``structured_outputs`` and the legacy
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``, ``guided_json_object`` and
``guided_whitespace_pattern`` (both endpoints), ``tools``, ``tool_choice`` and
``parallel_tool_calls`` (chat; ``/v1/responses`` declares its own ``text.format`` and tools):
:mod:`pagedkv.server.constraints`. The table still lists them for the endpoints that do not
(``response_format``, ``structured_outputs`` and ``guided_*`` on ``/v1/responses``, ``/tokenize``,
``tools`` on completions), where they stay refused.

Invariants:

- A field whose meaning is a constraint on the answer (a JSON schema, a grammar, tools…) is never
  silently dropped: a value asking for anything is a 400 naming the field, "… is not supported"
  (:class:`NotSupportedError`). vLLM ignores its removed ``guided_*``
  keys and answers unconstrained text with a 200; a client then parses what it never asked for.
- A value that asks for nothing is accepted: ``response_format: {"type": "text"}``,
  ``tool_choice: "none"``, an empty ``tools`` list, ``best_of`` equal to ``n``.
- Every other name is ignored, as vLLM and llama.cpp ignore it: SDKs add fields of their own
  (``store``, ``metadata``, ``service_tier``…) that change nothing an answer says, and
  ``guided_decoding_backend`` names an implementation, not a constraint. Each ignored name is
  logged once and counted, under a bounded set of labels (the names come from clients).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from pagedkv.errors import InvalidArgumentError

__all__ = ["MAX_NAMED_FIELDS", "REFUSED", "FieldError", "IgnoredFields", "NotSupportedError", "check_unhonoured"]

_log = logging.getLogger("pagedkv.server")


class FieldError(InvalidArgumentError):
    """A request field's value is refused (a 400 naming ``param``, the field's path)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NotSupportedError(FieldError):
    """A request asked for something pagedkv cannot do yet (a 400 naming ``param``)."""


def _not_none(value: Any) -> bool:
    return value is not None


def _not_true(value: Any) -> bool:
    return value is not None and value is not True


def _choice(value: Any) -> bool:
    return value not in (None, "none", "auto")


# Field -> whether its value asks for something the endpoint cannot do. bool: any value but an
# empty or false one asks.
REFUSED: Mapping[str, Callable[[Any], bool]] = {
    "response_format": lambda v: v is not None and not (isinstance(v, dict) and v.get("type") == "text"),
    "tools": bool,
    "tool_choice": _choice,
    "functions": bool,
    "function_call": _choice,
    "suffix": bool,
    "structured_outputs": _not_none,
    "guided_json": _not_none,
    "guided_regex": _not_none,
    "guided_choice": _not_none,
    "guided_grammar": _not_none,
    "guided_json_object": bool,
    "guided_whitespace_pattern": _not_none,
    "min_tokens": bool,
    "include_stop_str_in_output": bool,
    "skip_special_tokens": _not_true,
    "spaces_between_special_tokens": _not_true,
    "truncate_prompt_tokens": _not_none,
    "add_generation_prompt": _not_true,
    "continue_final_message": bool,
    "chat_template": _not_none,
    "chat_template_kwargs": bool,
    "documents": bool,
    "audio": _not_none,
    "modalities": lambda v: v is not None and v != ["text"],
    "prediction": _not_none,
    "web_search_options": _not_none,
}


def check_unhonoured(extra: Mapping[str, Any], *, n: int) -> list[str]:
    """Raises :class:`NotSupportedError` for the first field of ``extra`` (the names a request
    model does not declare) asking for what pagedkv cannot do, :class:`InvalidArgumentError` for
    ``best_of`` below ``n`` (OpenAI's refusal); returns the names ignored."""
    ignored = []
    for name, value in extra.items():
        if name == "best_of":
            if value is None or value == n:
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value < n:
                raise InvalidArgumentError(f"best_of ({value}) must be at least n ({n})")
            raise NotSupportedError(f"best_of other than n is not supported (got {value!r}, n = {n})", name)
        refused = REFUSED.get(name)
        if refused is None:
            ignored.append(name)
        elif refused(value):
            raise NotSupportedError(f"{name} is not supported{_value_note(name, value)}", name)
    return ignored


def _value_note(name: str, value: Any) -> str:
    if name == "response_format" and isinstance(value, dict) and isinstance(value.get("type"), str):
        return f" (type {value['type']!r}; only 'text')"
    return ""


# Distinct ignored names counted under their own label; the rest count as "other". Client-chosen
# names must not grow the metric's label set (or the log) without bound.
MAX_NAMED_FIELDS = 64
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class IgnoredFields:
    """The ignored request fields of one server: logged once per name, counted in
    ``pagedkv:request_fields_ignored_total{field}``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter("pagedkv:request_fields_ignored", "Request fields ignored, by name (first 64 names; then other).",
                                ["field"], registry=registry)
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def record(self, names: list[str], endpoint: str) -> None:
        for name in names:
            label = self._label(name, endpoint)
            self._counter.labels(label).inc()

    def _label(self, name: str, endpoint: str) -> str:
        with self._lock:
            if name in self._named:
                return name
            if len(self._named) >= MAX_NAMED_FIELDS or not _NAME.fullmatch(name):
                return "other"
            self._named.add(name)
        _log.warning("ignoring the request field %r (first seen on %s): pagedkv does not use it", name, endpoint)
        return name
