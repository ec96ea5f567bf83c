"""The OpenAI API's request bodies, as pydantic models (the parts pagedkv serves).

Invariants:

- These models check shape and type of the fields pagedkv honours; no value is coerced across
  types (``strict``: "3" is not an int, true is not a number; an int is a float). Ranges
  (temperature ≥ 0, n ≥ 1, top_p in (0, 1], …) are checked once, by
  :class:`~pagedkv.sampling.SamplingParams` and the scheduler, when the request is built
  (:func:`sampling_params`), so the server and the library can never disagree.
- Constraints on the output are honoured, never dropped (:mod:`pagedkv.server.constraints`):
  ``response_format`` (``text``, ``json_object``, ``json_schema``), vLLM's ``structured_outputs``
  and its legacy ``guided_*`` aliases on both endpoints; ``tools``, ``tool_choice`` and
  ``parallel_tool_calls`` on chat (:mod:`pagedkv.server.tools`). Their nested objects refuse
  unknown keys: a key naming a constraint pagedkv does not know is a 400, not ignored.
- Every other field is either refused or ignored, never half-honoured (:mod:`pagedkv.server.fields`):
  one whose meaning pagedkv cannot honour yet (``functions``, ``suffix``, ``min_tokens``…) is a
  400 saying it is not supported unless its value asks for nothing; any other name is ignored, as
  vLLM and llama.cpp ignore it, and counted. Clients add fields of their own (``store``,
  ``metadata``…), so refusing unknown names refused them.
- A refused body becomes FastAPI's ``RequestValidationError``, which :mod:`pagedkv.server.errors`
  answers with OpenAI's 400.

Extensions beyond OpenAI, with vLLM's names: ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``cache_salt``, ``structured_outputs``, ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, ``guided_json_object``,
``guided_whitespace_pattern``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedkv.errors import InvalidArgumentError
from pagedkv.grammar import StructuredOutputs
from pagedkv.sampling import SamplingParams
from pagedkv.server.fields import NotSupportedError, check_unhonoured

__all__ = [
    "ChatCompletionRequest", "ChatMessage", "ClosedObject", "CompletionRequest", "DetokenizeRequest", "FunctionDefinition",
    "JsonSchemaFormat", "NamedToolChoice", "RequestBody", "ResponseFormat", "StreamOptions", "StructuredOutputsRequest",
    "TokenizeRequest", "ToolDefinition", "sampling_params",
]


# Empty prompts are refused here: a tokenizer that adds a BOS token would make "" a prompt.
_Text = Annotated[str, Field(min_length=1)]
_Ids = Annotated[list[int], Field(min_length=1)]


class RequestBody(BaseModel):
    """A request body: strict types; unknown names kept (``model_extra``) for
    :func:`pagedkv.server.fields.check_unhonoured`."""

    model_config = ConfigDict(extra="allow", strict=True)


class ClosedObject(BaseModel):
    """A nested object of a constraint: strict types, and an unknown key is refused (a key naming
    a constraint must never be dropped)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=False)


class JsonSchemaFormat(ClosedObject):
    """``response_format.json_schema``: the output is JSON valid under ``schema`` (always
    enforced: ``strict`` false asks for no less)."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(ClosedObject):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object), ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(ClosedObject):
    """vLLM's ``structured_outputs``: one of ``json`` (a schema), ``regex``, ``choice``,
    ``grammar`` (Lark, llguidance's dialect) or ``json_object``; with a JSON one,
    ``whitespace_pattern`` (the whitespace allowed between its tokens) or
    ``disable_any_whitespace`` (none)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False

    def constraint(self) -> dict[str, Any]:
        """The fields of :class:`~pagedkv.grammar.StructuredOutputs` given."""
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": self.json_object or None}
        return {name: value for name, value in given.items() if value is not None}


class FunctionDefinition(ClosedObject):
    """A function the model may call: ``parameters`` a JSON schema of an object (always
    enforced on its calls' arguments: ``strict`` false asks for no less)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(ClosedObject):
    type: Literal["function"]
    function: FunctionDefinition


class _FunctionName(ClosedObject):
    name: str


class NamedToolChoice(ClosedObject):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"]
    function: _FunctionName


class StreamOptions(RequestBody):
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (guidellm asks for it to time each token).
    continuous_usage_stats: bool = False


class ChatMessage(RequestBody):
    """A message: ``content`` a string, a list of text parts (``{"type": "text", "text": …}``,
    joined by newlines as vLLM joins them), or null on an assistant message with ``tool_calls``;
    other keys (``tool_calls``, ``tool_call_id``…) go to the chat template as they are."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template reads it: its content one string."""
        message = self.model_dump(exclude_none=True)
        message["content"] = self._text(index)
        return message

    def _text(self, index: int) -> str:
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            if self.role == "assistant" and self.model_extra and self.model_extra.get("tool_calls"):
                return ""
            raise InvalidArgumentError(
                f"messages[{index}].content is required (null only on an assistant message with tool_calls)")
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text":
                raise NotSupportedError(f"content parts of type {kind!r} are not supported (text only)",
                                        f"messages[{index}].content[{j}]")
            if not isinstance(part.get("text"), str):
                raise InvalidArgumentError(f"messages[{index}].content[{j}].text must be a string")
            texts.append(part["text"])
        return "\n".join(texts)


class _Sampling(RequestBody):
    """Fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    logit_bias: dict[str, float] | None = None
    # Constraints (pagedkv.server.constraints): OpenAI's, vLLM's, and vLLM's legacy aliases.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    guided_whitespace_pattern: str | None = None

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _prompt_logprobs(self) -> int | None:
        return None

    def check(self) -> list[str]:
        """Refuses what OpenAI refuses and what pagedkv cannot honour (raising
        :class:`InvalidArgumentError`); returns the names of the fields ignored."""
        if self.stream_options is not None and not self.stream:
            raise InvalidArgumentError("stream_options is only allowed with stream: true")
        return check_unhonoured(self.model_extra or {}, n=self.n)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk of a stream carries the usage so far."""
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a text, a list of texts, token ids, or a list of
    token-id lists (one choice group of ``n`` per prompt); ``logprobs`` the number of
    alternatives per token (0: the chosen token's only). ``echo`` puts the prompt before each
    choice's text, and with ``logprobs`` its tokens' logprobs before the generated ones (the first
    null); ``max_tokens`` 0 with ``echo`` scores the prompt without generating (lm-eval's
    loglikelihood). ``prompt_logprobs`` (vLLM's) asks for the prompt's logprobs alone."""

    prompt: _Text | Annotated[list[_Text], Field(min_length=1)] | _Ids | Annotated[list[_Ids], Field(min_length=1)]
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None

    def _logprobs(self) -> tuple[bool, int]:
        return (False, 0) if self.logprobs is None else (True, self.logprobs)

    @property
    def score_only(self) -> bool:
        """``max_tokens`` 0 with ``echo``: the prompt scored, nothing generated (one token is
        sampled and left out of the answer)."""
        return self.echo and self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        return 1 if self.score_only else self.max_tokens

    def check(self) -> list[str]:
        if self.echo and self.stream:
            raise NotSupportedError("echo is not supported with stream", "echo")
        return super().check()

    def _prompt_logprobs(self) -> int | None:
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``max_completion_tokens`` is OpenAI's newer name of
    ``max_tokens`` (giving both is refused); ``tools`` the functions the model may call, as
    ``tool_choice`` says ("none", "auto" — the default with tools —, "required", or one function
    named), more than one call at once unless ``parallel_tool_calls`` is false."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def _logprobs(self) -> tuple[bool, int]:
        return self.logprobs, self.top_logprobs or 0

    def _max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidArgumentError("give max_tokens or max_completion_tokens, not both")
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens


class TokenizeRequest(RequestBody):
    """``POST /tokenize`` (vLLM's): a ``prompt`` text, or chat ``messages`` rendered as a chat
    request renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict[str, Any]] | None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidArgumentError("give prompt or messages, one of them")
        return None if self.messages is None else [m.for_template(i) for i, m in enumerate(self.messages)]


class DetokenizeRequest(RequestBody):
    """``POST /detokenize`` (vLLM's): the text of ``tokens``."""

    model: str | None = None
    tokens: list[int]


def _token_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) keyed by int."""
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError:
        raise InvalidArgumentError("logit_bias keys must be token ids (integers as strings)") from None


def sampling_params(request: CompletionRequest | ChatCompletionRequest, default: SamplingParams,
                    default_max_tokens: int, structured_outputs: StructuredOutputs | None = None) -> SamplingParams:
    """The engine's parameters for ``request``: its fields where given, else the engine's
    ``default`` parameters, except ``max_tokens``, which defaults to ``default_max_tokens`` (the
    scheduler ends a sample earlier if the model's length runs out, so a request without it gets
    what the model has room for, capped), and ``structured_outputs``, the request's constraint
    (:func:`pagedkv.server.constraints.request_constraint`). Raises
    :class:`InvalidArgumentError` for values :class:`SamplingParams` refuses."""
    logprobs, top_logprobs = request._logprobs()
    given = {
        "max_tokens": request._max_tokens(),
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "seed": request.seed,
        "stop_token_ids": None if request.stop_token_ids is None else tuple(request.stop_token_ids),
        "stop": None if request.stop is None else ((request.stop,) if isinstance(request.stop, str) else tuple(request.stop)),
        "logit_bias": None if request.logit_bias is None else _token_keys(request.logit_bias),
        "prompt_logprobs": request._prompt_logprobs(),
    }
    fields: dict[str, Any] = {name: value for name, value in given.items() if value is not None}
    fields.setdefault("max_tokens", default_max_tokens)
    fields.update(n=request.n, ignore_eos=request.ignore_eos, logprobs=logprobs, top_logprobs=top_logprobs,
                  structured_outputs=structured_outputs)
    return dataclasses.replace(default, **fields)

