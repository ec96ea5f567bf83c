"""What a request's output must match: :class:`StructuredOutputs`, a field of
:class:`~pagedkv.sampling.SamplingParams`.

Invariants:

- Exactly one constraint per value: a JSON schema (``json``), any JSON object (``json_object``),
  a regular expression, a set of choices, or a Lark grammar (llguidance's dialect). A value asking
  for none, or for two, is refused (:class:`~pagedkv.errors.InvalidArgumentError`) when built.
- A schema is kept as compact JSON text, keys in their given order (the order an object's
  properties are generated in), so two requests with the same schema spaced differently share
  one compiled grammar (:attr:`StructuredOutputs.key`).
- Its text is bounded (:data:`MAX_GRAMMAR_CHARS`): a client's schema is compiled in the engine's
  process, and the bound keeps one request from holding it for long. Whether it compiles is the
  compiler's to say (:mod:`pagedkv.grammar.compiler`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidArgumentError

__all__ = ["MAX_CHOICES", "MAX_GRAMMAR_CHARS", "StructuredOutputs"]

# The longest schema, regex or grammar text taken (characters). OpenAI's strict schemas stop at
# 5,000 properties; a tool list of a few dozen functions is ~20-60 kB of JSON.
MAX_GRAMMAR_CHARS = 128 * 1024
MAX_CHOICES = 4096

# A JSON schema allowing any object: what ``json_object`` compiles.
_ANY_OBJECT = '{"type":"object"}'


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of:

    - ``json``: a JSON schema (a mapping, or its JSON text); the output is one JSON value valid
      under it;
    - ``json_object``: True for any JSON object (OpenAI's ``json_object`` mode);
    - ``regex``: a regular expression the whole output matches;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a Lark grammar (llguidance's dialect, start rule ``start``).

    The names are vLLM's ``structured_outputs`` fields. ``continued_from``: token ids the output
    already has (a sample carried on by another engine, :func:`pagedkv.cluster.feed.continuation`):
    each sample's matcher starts past them; a token the grammar refuses there refuses the
    request. It is no part of the constraint (:attr:`key`).
    """

    json: Mapping[str, Any] | str | bool | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    continued_from: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        continued = self.continued_from
        if not isinstance(continued, (tuple, list)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in continued
        ):
            raise InvalidArgumentError(f"continued_from must be token ids, got {continued!r:.80}")
        object.__setattr__(self, "continued_from", tuple(continued))
        if not isinstance(self.json_object, bool):
            raise InvalidArgumentError(f"json_object must be a bool, got {self.json_object!r}")
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidArgumentError(
                f"structured outputs take exactly one of json, json_object, regex, choice or grammar, got {given or 'none'}"
            )
        if self.json is not None:
            object.__setattr__(self, "json", _canonical_schema(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgumentError(f"{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, Sequence) or not all(isinstance(c, str) for c in choice):
                raise InvalidArgumentError(f"choice must be a list of strings, got {choice!r:.80}")
            if not 1 <= len(choice) <= MAX_CHOICES:
                raise InvalidArgumentError(f"choice takes 1 to {MAX_CHOICES} strings, got {len(choice)}")
            object.__setattr__(self, "choice", tuple(choice))
        size = sum(len(text) for text in self._texts())
        if size > MAX_GRAMMAR_CHARS:
            raise InvalidArgumentError(f"the {given[0]} constraint is {size} characters long, past the {MAX_GRAMMAR_CHARS} taken")

    def _texts(self) -> tuple[str, ...]:
        value = self.key[1]
        return value if isinstance(value, tuple) else (value,)

    @property
    def kind(self) -> str:
        """Which constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        return self.key[0]

    @property
    def key(self) -> tuple[str, str | tuple[str, ...]]:
        """(kind, compact text): equal for constraints that compile to the same grammar."""
        if self.json_object:
            return ("json_object", _ANY_OBJECT)
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, name)
            if value is not None:
                return (name, value)
        raise AssertionError("__post_init__ keeps exactly one")

    def compile_arguments(self) -> dict[str, Any]:
        """The keyword arguments of :class:`pagedkv._core.Grammar` for this constraint."""
        kind, value = self.key
        return {
            "json": {"json_schema": value},
            "json_object": {"json_schema": value},
            "regex": {"regex": value},
            "choice": {"choice": list(value)},
            "grammar": {"lark": value},
        }[kind]


def _canonical_schema(schema: object) -> str:
    """A JSON schema (mapping, JSON text, or ``true``) as compact JSON text (sorting its keys
    would reorder the properties the output writes)."""
    if isinstance(schema, str):
        if len(schema) > MAX_GRAMMAR_CHARS:
            raise InvalidArgumentError(f"the JSON schema is {len(schema)} characters long, past the {MAX_GRAMMAR_CHARS} taken")
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise InvalidArgumentError(f"the JSON schema is not JSON: {error}") from None
        except RecursionError:
            raise InvalidArgumentError("the JSON schema nests too deep") from None
    if schema is True:
        schema = {}
    if not isinstance(schema, Mapping):
        raise InvalidArgumentError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise InvalidArgumentError(f"the JSON schema cannot be written as JSON: {error}") from None
