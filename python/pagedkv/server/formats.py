"""The two response shapes: legacy completions (``text``) and chat (``message`` / ``delta``), whole
and as stream chunks. One :class:`Format` per endpoint; everything else the server does is shared.

Invariants: a response names the served model, the generation's id and creation time, and the
build that answered (``system_fingerprint``); every chunk of a stream carries its choice's
``index``; logprobs appear only when the request asked. A chat choice of a generation with tools
is its text read by a :class:`~pagedkv.server.tools.ToolCallParser` (``message.tool_calls``;
streamed, ``delta.tool_calls``: a call's id, type and name with empty arguments, then its
argument fragments), whole or streamed alike.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

from pagedkv._core import __version__
from pagedkv.engine import CompletionOutput, RequestOutput, TokenEvent
from pagedkv.server.generation import Generation, TokenText, chat_logprobs, completion_logprobs, finish_reason, usage
from pagedkv.server.tools import ToolCallParser

__all__ = ["SYSTEM_FINGERPRINT", "ChatFormat", "CompletionFormat", "Format", "StreamState"]

# What one stream keeps between its chunks, per choice index (a chat choice's tool-call parser).
StreamState = MutableMapping[int, ToolCallParser]

# OpenAI's field naming the backend configuration that answered: here the pagedkv build.
SYSTEM_FINGERPRINT = f"pagedkv-{__version__}"


class Format:
    """How one endpoint writes its choices."""

    object = ""
    chunk_object = ""

    def __init__(self, model: str, text: TokenText) -> None:
        self.model = model
        self.text = text

    def response(self, generation: Generation, outputs: Sequence[RequestOutput]) -> dict:
        choices = [self.choice(generation, generation.n * i + c.index, c) for i, o in enumerate(outputs) for c in o.outputs]
        return {**self._head(generation, self.object), "choices": choices, "usage": usage(outputs)}

    def chunk(self, generation: Generation, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {**self._head(generation, self.chunk_object), "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body

    def _head(self, generation: Generation, kind: str) -> dict:
        return {"id": generation.id, "object": kind, "created": generation.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def opening(self, index: int) -> dict | None:
        """The chunk that opens choice ``index`` of a stream, if the format has one."""
        return None

    def choice(self, generation: Generation, index: int, completion: CompletionOutput) -> dict:
        raise NotImplementedError

    def chunk_choices(self, generation: Generation, state: StreamState, index: int, event: TokenEvent, offset: int) -> list[dict]:
        """The choices (each for a chunk of its own) that ``event`` of choice ``index`` streams;
        ``offset``: the characters of that choice streamed before it."""
        raise NotImplementedError


class CompletionFormat(Format):
    object = chunk_object = "text_completion"

    def response(self, generation: Generation, outputs: Sequence[RequestOutput]) -> dict:
        if not generation.echo:
            return super().response(generation, outputs)
        choices = []
        for i, output in enumerate(outputs):
            prompt_text = output.prompt if output.prompt is not None else self.text.join(output.prompt_token_ids)
            for c in output.outputs:
                generated = [] if generation.score_only else (c.logprobs or [])
                lp = None
                if generation.params.logprobs:
                    prompt = (output.prompt_token_ids, output.prompt_logprobs or [None] * len(output.prompt_token_ids))
                    lp = completion_logprobs(generated, self.text, prompt=prompt)
                text = prompt_text + ("" if generation.score_only else c.text)
                reason = "length" if generation.score_only else finish_reason(c.finish_reason)
                choices.append({"index": generation.n * i + c.index, "text": text, "logprobs": lp, "finish_reason": reason})
        return {**self._head(generation, self.object), "choices": choices,
                "usage": usage(outputs, generated=not generation.score_only)}

    def choice(self, generation: Generation, index: int, completion: CompletionOutput) -> dict:
        lp = completion_logprobs(completion.logprobs or [], self.text) if generation.params.logprobs else None
        return {"index": index, "text": completion.text, "logprobs": lp, "finish_reason": finish_reason(completion.finish_reason)}

    def chunk_choices(self, generation: Generation, state: StreamState, index: int, event: TokenEvent, offset: int) -> list[dict]:
        logprobs = generation.params.logprobs and event.logprob is not None
        lp = completion_logprobs([event.logprob], self.text, offset) if logprobs else None  # type: ignore[list-item]
        return [{"index": index, "text": event.text, "logprobs": lp, "finish_reason": finish_reason(event.finish_reason)}]


class ChatFormat(Format):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, generation: Generation, index: int, completion: CompletionOutput) -> dict:
        lp = chat_logprobs(completion.logprobs or [], self.text) if generation.params.logprobs else None
        message: dict = {"role": "assistant", "content": completion.text}
        called = False
        if generation.tools is not None:
            parser = generation.tools.parser()
            parser.feed(completion.text)
            parser.finish()
            message, called = parser.message(), bool(parser.calls)
        reason = finish_reason(completion.finish_reason, called)
        return {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}

    def opening(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def chunk_choices(self, generation: Generation, state: StreamState, index: int, event: TokenEvent, offset: int) -> list[dict]:
        logprobs = generation.params.logprobs and event.logprob is not None
        lp = chat_logprobs([event.logprob], self.text) if logprobs else None  # type: ignore[list-item]
        if generation.tools is None:
            reason = finish_reason(event.finish_reason)
            return [{"index": index, "delta": {"content": event.text}, "logprobs": lp, "finish_reason": reason}]
        parser = state.get(index)
        if parser is None:
            parser = state[index] = generation.tools.parser()
        deltas = parser.feed(event.text)
        if event.finish_reason is not None:
            deltas += parser.finish()
        reason = finish_reason(event.finish_reason, bool(parser.calls))
        if not deltas:
            if lp is None and reason is None:
                return []  # text held back: a tag may be opening, or a call's name is not whole yet
            deltas = [{}]
        choices: list[dict] = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
        choices[0]["logprobs"] = lp
        choices[-1]["finish_reason"] = reason
        return choices
